"""Context parallelism in the train and eval steps: every sequence split over a ``context`` axis equals one device,
for a small causal transformer whose attention goes through ``sc.context_attention`` (both algorithms) and whose
positions come from ``sc.context_positions``; on ``data 2 x context 4`` and ``data 2 x context 2 x model 2``, and
with the blocks a pipeline under the table schedules on ``stage 2 x context 2 x model 2``."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdcomm as sc
from tests.ddp_models import assert_trees_close, mesh_of

T, VOCAB, WIDTH, HEADS = 16, 13, 16, 4


class Attention(nn.Module):
    algorithm: str
    model: bool = False

    @nn.compact
    def __call__(self, x, segments, valid):
        split = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")) if self.model else None
        rows = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)) if self.model else None
        qkv = nn.Dense(3 * WIDTH, use_bias=False, **({"kernel_init": split} if split else {}))(x)
        q, k, v = jnp.split(qkv.reshape(x.shape[:2] + (3 * HEADS, WIDTH // HEADS)), 3, axis=2)
        out = sc.context_attention(q, k, v, causal=True, segment_ids=segments, kv_mask=valid, algorithm=self.algorithm)
        return nn.Dense(WIDTH, use_bias=False, **({"kernel_init": rows} if rows else {}))(out.reshape(x.shape))


class LM(nn.Module):
    algorithm: str = "ring"
    model: bool = False

    @nn.compact
    def __call__(self, tokens, segments, valid):
        positions = sc.context_positions(tokens.shape[1])
        h = nn.Embed(VOCAB, WIDTH)(tokens) + self.param("pos", nn.initializers.normal(0.1), (T, WIDTH))[positions]
        h = h + Attention(self.algorithm, self.model)(nn.LayerNorm()(h), segments, valid)
        h = h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["tokens"], batch["segments"], batch["valid"])
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return sc.masked_mean(token_loss.mean(-1), mask)


def batches(steps=3, rows=8):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, VOCAB, (rows, T + 1)).astype(np.int32)
        segments = (np.arange(T)[None, :] >= rng.integers(4, T, (rows, 1))).astype(np.int32)  # two packed segments
        valid = np.arange(T)[None, :] < rng.integers(T - 3, T + 1, (rows, 1))  # padding at the end
        out.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segments": segments, "valid": valid})
    return out


@functools.cache
def init(model):
    """``model``'s variables on the host: traced and compiled once per model (a hashable Flax dataclass); each state
    places its own copy."""
    sample = batches(1)[0]
    variables = jax.jit(model.init)(
        jax.random.key(0), sample["tokens"][:1], sample["segments"][:1], sample["valid"][:1]
    )
    return jax.device_get(variables)


def train(state, data):
    step, losses = sc.make_train_step(loss_fn), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@functools.cache
def one_device():
    model = LM()
    state = sc.TrainState.create(
        params=init(model)["params"], apply_fn=model.apply, tx=optax.adam(1e-2), mesh=mesh_of(1)
    )
    state, losses = train(state, batches())
    return jax.device_get(state.params), losses


SLOW = pytest.mark.slow
CASES = [  # the fast tier runs the ring; the all-to-all algorithm meets the step in the slow tier (and
    # in tests/test_context_attention.py's fast tier on its own, in both layouts). The contiguous layout in the
    # step and FSDP with a context axis: tests/test_weighted_loss.py's context cases, against one device.
    pytest.param({"data": 2, "context": 4}, "ring", "zigzag", "ddp"),
    pytest.param({"data": 2, "context": 2, "model": 2}, "ring", "zigzag", "zero1", marks=SLOW),
    pytest.param({"data": 2, "context": 2, "model": 2}, "all_to_all", "zigzag", "ddp", marks=SLOW),
]


@pytest.mark.parametrize("layout, algorithm, order, strategy", CASES, ids=lambda x: str(x))
def test_train_step_with_a_context_axis_equals_one_device(layout, algorithm, order, strategy):
    expected, expected_losses = one_device()
    model = LM(algorithm, "model" in layout)
    state = sc.TrainState.create(
        params=init(model)["params"],
        apply_fn=model.apply,
        tx=optax.adam(1e-2),
        mesh=sc.make_mesh(layout),
        strategy=strategy,
        context=sc.ContextParallel(layout=order),
    )
    state, losses = train(state, batches())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-4, atol=1e-5)
    # The eval step with a context axis: tests/test_weighted_loss.py's sc.evaluate test (values and counts).


def test_a_sequence_that_does_not_split_is_refused():
    model = LM()
    state = sc.TrainState.create(
        params=init(model)["params"],
        apply_fn=model.apply,
        tx=optax.sgd(0.1),
        mesh=sc.make_mesh({"data": 2, "context": 4}),
        context=sc.ContextParallel(),
    )
    short = {k: v[:, :12] for k, v in batches(1)[0].items()}  # 12 tokens: not a multiple of 2 x 4 chunks
    with pytest.raises(sc.ShapeError, match=r"12 tokens does not split into 8 equal chunks"):
        sc.make_train_step(loss_fn)(state, short)


def test_a_context_axis_must_be_a_free_mesh_axis():
    with pytest.raises(sc.AxisError, match=r"context axis 'context' must be a mesh axis"):
        sc.TrainState.create(
            params={"w": np.zeros(3, np.float32)},
            tx=optax.sgd(0.1),
            mesh=sc.make_mesh({"data": 8}),
            context=sc.ContextParallel(),
        )


# The context axis with a pipeline and FSDP (data 2 x stage 2 x context 2): tests/test_weighted_loss.py's
# "pipeline-context" case, against one device's plain jax.grad run.


@pytest.mark.slow
def test_an_nnx_model_with_context_attention_equals_one_device():
    from flax import nnx

    class NnxLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.pos = nnx.Param(0.1 * jax.random.normal(rngs.params(), (T, WIDTH)))
            self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, use_bias=False, rngs=rngs)
            self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            h = self.embed(tokens) + self.pos[...][sc.context_positions(tokens.shape[1])]
            q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
            heads = lambda t: t.reshape(t.shape[:2] + (HEADS, WIDTH // HEADS))
            return self.out(h + sc.context_attention(heads(q), heads(k), heads(v), causal=True).reshape(h.shape))

    def nnx_loss(model, batch, *, rng, mask):
        losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["targets"])
        return sc.masked_mean(losses.mean(-1), mask)

    def run(mesh, **kwargs):
        state = sc.TrainState.create_nnx(NnxLM(nnx.Rngs(0)), tx=optax.adam(1e-2), mesh=mesh, **kwargs)
        step, losses = sc.make_train_step(sc.nnx_loss_fn(nnx_loss)), []
        for batch in batches():
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return state, losses

    expected, expected_losses = run(mesh_of(1))
    state, losses = run(sc.make_mesh({"data": 2, "context": 4}), context=sc.ContextParallel())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), jax.device_get(expected.params), rtol=1e-4, atol=1e-5)


class StackedBlock(nn.Module):
    """Pre-LayerNorm causal attention, its projections split over ``model`` (columns in, rows out) when asked."""

    model: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        split = nn.with_partitioning(init, (None, "model")) if self.model else init
        rows = nn.with_partitioning(init, ("model", None)) if self.model else init
        qkv = nn.Dense(3 * WIDTH, use_bias=False, kernel_init=split)(nn.LayerNorm()(x))
        q, k, v = jnp.split(qkv.reshape(x.shape[:2] + (3 * HEADS, WIDTH // HEADS)), 3, axis=2)
        return x + nn.Dense(WIDTH, use_bias=False, kernel_init=rows)(
            sc.context_attention(q, k, v, causal=True).reshape(x.shape)
        )


class StackedLM(nn.Module):
    """The LM with its blocks a ``sc.PipelineStack`` (a pipeline over the stage axis)."""

    model: bool = False

    @nn.compact
    def __call__(self, tokens):
        positions = sc.context_positions(tokens.shape[1])
        h = nn.Embed(VOCAB, WIDTH)(tokens) + self.param("pos", nn.initializers.normal(0.1), (T, WIDTH))[positions]
        return nn.Dense(VOCAB)(nn.LayerNorm()(sc.PipelineStack(StackedBlock(self.model), layers=2)(h)))


def stacked_loss(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["tokens"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1), mask)


def stacked_train(model, mesh, **kwargs):
    params = jax.jit(model.init)(jax.random.key(0), batches(1)[0]["tokens"][:1])["params"]
    devices = jax.devices()[: int(np.prod(list(mesh.values())))]
    state = sc.TrainState.create(
        params=params, apply_fn=model.apply, tx=optax.adam(1e-2), mesh=sc.make_mesh(mesh, devices=devices), **kwargs
    )
    step, losses = sc.make_train_step(stacked_loss), []
    for batch in batches(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.full_params()), losses


@functools.cache
def stacked_one_device():
    return stacked_train(StackedLM(), {"data": 1})


@SLOW
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_table_schedule_on_stage2_context2_model2_equals_one_device(schedule):
    """Every sequence split over context, the attention's projections over model, the blocks over stage: the table
    schedules run a lockstep table (the ring's collectives on every stage at each unit); one device's losses and
    parameters (GPipe with a context axis: tests/test_weighted_loss.py)."""
    expected, expected_losses = stacked_one_device()
    params, losses = stacked_train(
        StackedLM(model=True),
        {"stage": 2, "context": 2, "model": 2},
        pipeline=sc.Pipeline(microbatches=2, schedule=schedule),
        context=sc.ContextParallel(),
    )
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(params, expected, rtol=1e-4, atol=1e-5)
