"""Pipeline parallelism: the schedule equals a scan over the layers, and the train step with a stage axis equals one
device running the same model as a plain scan over the global batch, under every strategy and layout.

One model throughout: a dense embedding, a ``PipelineStack`` of 8 residual blocks (optionally with tensor-parallel
kernels and dropout), a dense head, squared error."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmdcomm as sc
from spmdcomm.train import pipeline as pipeline_module
from spmdcomm.train.pipeline import pipeline_context, run_stack, stage_order
from tests.ddp_models import assert_trees_close, mesh_of

LAYERS, WIDTH = 8, 16


# --- the schedule against a scan -----------------------------------------------------------------------------


def residual(w, h, index, row):
    return h + jnp.tanh(h @ w)


def scanned(weights, x):
    return run_stack(residual, weights, x, remat=False)


@functools.cache
def core_program(d, p, m, v):
    """The pipelined stack on a ``data`` d x ``stage`` p mesh, and its gradient (compiled once per layout)."""
    mesh = jax.make_mesh(
        (d, p), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[: d * p]
    )
    schedule = sc.Pipeline(microbatches=m, repeats=v)

    def local(weights, x):
        with pipeline_context(schedule):
            return run_stack(residual, weights, x)

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P("stage"), P(("data", "stage"))), out_specs=P(("data", "stage"))
    )
    return jax.jit(mapped), jax.jit(jax.grad(lambda w, x: jnp.sum(mapped(w, x) ** 2)))


CORE_CASES = [(1, 2, 2, 1), (2, 4, 4, 1), (4, 2, 6, 1), (2, 2, 4, 2), (1, 4, 8, 2), (1, 8, 8, 1)]


@pytest.mark.parametrize("d, p, m, v", CORE_CASES)
def test_the_schedule_equals_a_scan_forward_and_backward(d, p, m, v):
    rng = np.random.default_rng(0)
    weights = (rng.normal(size=(LAYERS, 6, 6)) / np.sqrt(6)).astype(np.float32)
    x = rng.normal(size=(d * m * 2, 6)).astype(np.float32)  # 2 rows per micro-batch
    order = stage_order(LAYERS, p, v)
    forward, grad = core_program(d, p, m, v)
    np.testing.assert_allclose(forward(weights[order], x), scanned(weights, x), rtol=1e-5, atol=1e-5)
    expected = jax.grad(lambda w: jnp.sum(scanned(w, x) ** 2))(weights)
    np.testing.assert_allclose(np.asarray(grad(weights[order], x))[np.argsort(order)], expected, rtol=1e-4, atol=1e-4)


def test_nan_in_every_bubble_slot_changes_nothing(monkeypatch):
    """The loop's buffers start as NaN instead of zeros: bubble ticks compute on zeros and are never written, so the
    output and the gradient are bitwise those of the zero-filled run (praxis's NaN testing mode)."""
    rng = np.random.default_rng(1)
    weights = (rng.normal(size=(LAYERS, 6, 6)) / np.sqrt(6)).astype(np.float32)
    x = rng.normal(size=(2 * 4 * 2, 6)).astype(np.float32)
    order = stage_order(LAYERS, 2, 2)
    results = {}
    for fill in (0.0, np.nan):
        monkeypatch.setattr(pipeline_module, "_FILL", fill)
        core_program.cache_clear()
        forward, grad = core_program(2, 2, 4, 2)
        results[str(fill)] = (np.asarray(forward(weights[order], x)), np.asarray(grad(weights[order], x)))
    core_program.cache_clear()
    zero, nan = results["0.0"], results["nan"]
    assert np.isfinite(nan[0]).all() and np.isfinite(nan[1]).all()
    np.testing.assert_array_equal(nan[0], zero[0])
    np.testing.assert_array_equal(nan[1], zero[1])


# --- the train step against one device -----------------------------------------------------------------------


class Block(nn.Module):
    """A pre-LayerNorm residual MLP block; ``model``: its kernels split Megatron-style over ``"model"``."""

    model: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        columns = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")) if self.model else None
        rows = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)) if self.model else None
        h = nn.LayerNorm()(x)
        h = nn.Dense(2 * WIDTH, **({"kernel_init": columns} if columns else {}))(h)
        h = nn.Dropout(self.dropout, deterministic=self.dropout == 0.0)(nn.gelu(h))
        return x + nn.Dense(WIDTH, **({"kernel_init": rows} if rows else {}))(h)


class Net(nn.Module):
    model: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        h = sc.PipelineStack(Block(self.model, self.dropout), layers=LAYERS)(h)
        return nn.Dense(3)(nn.LayerNorm()(h))


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    out = apply_fn({"params": params}, batch["x"], rngs={"dropout": rng})
    return sc.masked_mean(jnp.sum((out - batch["y"]) ** 2, -1), mask)


def batches(rows=32, steps=3):
    rng = np.random.default_rng(2)
    return [
        {"x": rng.normal(size=(rows, 5)).astype(np.float32), "y": rng.normal(size=(rows, 3)).astype(np.float32)}
        for _ in range(steps)
    ]


TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))  # the global norm must see every stage


def train(state, data, *, rng="per_device", accum=1, pad_to=None):
    step = sc.make_train_step(loss_fn, rng=rng, accum_steps=accum)
    losses = []
    for batch in data:
        state, metrics = step(state, batch if pad_to is None else sc.pad_batch(batch, pad_to))
        losses.append(float(metrics["loss"]))
    return state, losses


def init(model):
    return jax.jit(model.init)(jax.random.key(0), np.zeros((2, 5), np.float32))["params"]


@functools.cache
def one_device(real_rows, model=False, dropout=0.0, rng="per_device"):
    net = Net(model, dropout)
    state = sc.TrainState.create(params=init(Net(False, dropout)), apply_fn=net.apply, tx=TX, mesh=mesh_of(1))
    data = [{k: v[:real_rows] for k, v in b.items()} for b in batches()]
    state, losses = train(state, data, rng=rng)
    return jax.device_get(state.params), losses


LAYOUTS = [
    # (mesh, data axes, strategy, microbatches, repeats, accumulation, padded)
    ({"data": 4, "stage": 2}, "data", "ddp", 2, 1, 1, False),
    ({"data": 2, "stage": 4}, "data", "fsdp", 8, 1, 1, True),
    ({"data": 2, "stage": 2, "model": 2}, "data", "zero1", 4, 2, 1, False),
    ({"data": 4, "stage": 2}, "data", "zero2", 2, 2, 2, True),
    ({"replica": 2, "shard": 2, "stage": 2}, ("replica", "shard"), "fsdp", 4, 1, 1, False),
]


@pytest.mark.parametrize("layout, axis, strategy, m, v, accum, padded", LAYOUTS, ids=lambda x: str(x))
def test_train_step_with_a_stage_axis_equals_one_device(layout, axis, strategy, m, v, accum, padded):
    model = "model" in layout
    expected, expected_losses = one_device(29 if padded else 32)
    state = sc.TrainState.create(
        params=init(Net(model)),
        apply_fn=Net(model).apply,
        tx=TX,
        mesh=sc.make_mesh(layout),
        axis=axis,
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, repeats=v),
    )
    stacked = state.params["PipelineStack_0"]["layers"]["Dense_0"]["kernel"]
    assert stacked.sharding.spec[0] == "stage"
    data = [{k: v[:29] for k, v in b.items()} for b in batches()] if padded else batches()
    pad_to = 32 if padded else None
    state, losses = train(state, data, accum=accum, pad_to=pad_to)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=1e-5)
