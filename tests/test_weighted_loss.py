"""Token-weighted losses (``sc.weighted``): the train step trains one device's ``sum(loss * w) / sum(w)`` over the
global batch, and the eval step and ``sc.evaluate`` report it, for any distribution of real tokens: rows without a
real token, a device holding only padding (masked rows), an accumulation micro-batch without a token, a pipeline's
rows and a context axis whose devices hold different numbers of real tokens. The reference is plain ``jax.grad`` +
optax on one device over the whole batch (no spmdcomm)."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdcomm as sc
from tests.ddp_models import assert_trees_close

T, VOCAB, WIDTH, HEADS, ROWS, STEPS = 16, 11, 16, 4, 16, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        # No bias on q, k, v: a key bias has a zero gradient (softmax ignores it), which Adam turns into noise.
        q, k, v = jnp.split(nn.Dense(3 * WIDTH, use_bias=False)(nn.LayerNorm()(x)), 3, axis=-1)
        heads = lambda t: t.reshape(t.shape[:2] + (HEADS, WIDTH // HEADS))
        return x + nn.Dense(WIDTH)(sc.context_attention(heads(q), heads(k), heads(v), causal=True).reshape(x.shape))


class LM(nn.Module):
    """A causal LM whose two blocks form a stack: a scan, or a pipeline over the stage axis."""

    @nn.compact
    def __call__(self, tokens):
        positions = sc.context_positions(tokens.shape[1])
        h = nn.Embed(VOCAB, WIDTH)(tokens) + self.param("pos", nn.initializers.normal(0.1), (T, WIDTH))[positions]
        return nn.Dense(VOCAB)(nn.LayerNorm()(sc.PipelineStack(Block(), layers=2)(h)))


MODEL = LM()


def token_losses(params, batch):
    logits = MODEL.apply({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    # One forward pass for the loss and the accuracy (each pass more is one more model to trace and compile).
    logits, w = MODEL.apply({"params": params}, batch["tokens"]), batch["weights"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    right = (jnp.argmax(logits, -1) == batch["targets"]) * w
    return sc.weighted(jnp.sum(ce * w), jnp.sum(w)), {"accuracy": sc.weighted(jnp.sum(right), jnp.sum(w))}


def metric_fn(params, batch, *, apply_fn, model_state, mask):
    loss, aux = loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)
    return aux | {"loss": loss, "row_mean": sc.masked_mean(jnp.mean(batch["weights"], -1), mask)}


def tx():
    # Clipping is active (the gradient norm is about 1): it must see the gradient of the global token mean.
    return optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))


def lengths(step):
    """Real tokens per row: rows 2-3 (all of device 1 on data=8) and 4 (micro-batch 0 of device 2 with accumulation)
    hold none; the others from 1 to T, so the context devices of a row hold different numbers."""
    n = np.random.default_rng(step).integers(1, T + 1, ROWS)
    n[2:5] = 0
    return n


def global_batch(step):
    rng = np.random.default_rng(100 + step)
    tokens = rng.integers(1, VOCAB, (ROWS, T + 1)).astype(np.int32)
    weights = (np.arange(T)[None, :] < lengths(step)[:, None]).astype(np.float32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def masked(step, real=13):
    """Rows ``real`` and after are padding (all of device 7 on data=8) holding weights of 1 and other tokens: the
    step must hand them to loss_fn as zeros, so that they weigh nothing."""
    batch = global_batch(step)
    return sc.MaskedBatch({k: v.copy() for k, v in batch.items()}, np.arange(ROWS) < real)


@functools.cache
def reference():
    """One device, the real rows of each global batch: losses, accuracies and parameters after each step."""
    boxed = jax.jit(MODEL.init)(jax.random.key(0), global_batch(0)["tokens"][:1])["params"]  # the stack's boxes
    params = nn.unbox(boxed)

    @jax.jit
    def step(params, opt_state, batch):
        def mean(p):
            return jnp.sum(token_losses(p, batch) * batch["weights"]) / jnp.sum(batch["weights"])

        loss, grads = jax.value_and_grad(mean)(params)
        updates, opt_state = tx().update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, out = tx().init(params), []
    for i in range(STEPS):
        batch = {k: v[:13] for k, v in global_batch(i).items()}
        params, opt_state, loss = step(params, opt_state, batch)
        out.append((float(loss), jax.device_get(params)))
    return boxed, out


def train(mesh, *, accum_steps=1, **kwargs):
    start, _ = reference()
    state = sc.TrainState.create(params=start, apply_fn=MODEL.apply, tx=tx(), mesh=sc.make_mesh(mesh), **kwargs)
    step, out = sc.make_train_step(loss_fn, accum_steps=accum_steps), []
    for i in range(STEPS):
        state, metrics = step(state, masked(i))
        out.append(jax.device_get(metrics))
    return state, out


SLOW = pytest.mark.slow
CASES = [  # the fast tier runs context (masked rows, tokens split unevenly over the context devices); the slow the rest
    pytest.param({"data": 8}, {"strategy": "ddp"}, 2, id="data8-ddp-accum2", marks=SLOW),
    pytest.param({"data": 2, "context": 4}, {"strategy": "fsdp", "context": sc.ContextParallel()}, 1, id="context"),
    # Also tests/test_context_parallel.py's check that the context axis composes with a pipeline and FSDP.
    pytest.param(
        {"data": 2, "stage": 2, "context": 2},
        {"strategy": "fsdp", "pipeline": sc.Pipeline(microbatches=2), "context": sc.ContextParallel()},
        1,
        id="pipeline-context",
        marks=SLOW,
    ),
    # Each slow case adds what the others lack: a model axis with 4 micro-batches, hybrid ZeRO-2 over two data
    # axes, a pipeline with accumulation and dynamic loss scaling, the contiguous context layout.
    pytest.param({"data": 4, "model": 2}, {"strategy": "fsdp"}, 4, id="fsdp-model-axis-accum4", marks=SLOW),
    pytest.param(
        {"replica": 2, "data": 4}, {"strategy": "zero2", "axis": ("replica", "data")}, 2, id="hybrid-zero2", marks=SLOW
    ),
    pytest.param(
        {"data": 4, "stage": 2},
        {"strategy": "ddp", "pipeline": sc.Pipeline(microbatches=2), "loss_scale": "dynamic"},
        2,
        id="pipeline-accum2-loss-scale",
        marks=SLOW,
    ),
    pytest.param(
        {"data": 2, "context": 4},
        {"strategy": "ddp", "context": sc.ContextParallel(layout="contiguous")},
        2,
        id="context-contiguous-accum2",
        marks=SLOW,
    ),
    # The table schedules cut a device's micro-batch into parts, each with its own total and weight; 1F1B and ZB-H1
    # cut them alike (tables.py), ZB-H1 also splitting each backward pass: one case of both, with accumulation.
    pytest.param(
        {"data": 2, "stage": 2, "model": 2},
        {"strategy": "fsdp", "loss_scale": "dynamic", "pipeline": sc.Pipeline(microbatches=4, schedule="zb-h1")},
        2,
        id="zb-h1-loss-scale-accum2",
        marks=SLOW,
    ),
    # The table schedules with a context axis run lockstep tables (tables.py): the attention's collectives over the
    # context axis run on every stage at each unit. ZB-H1 zig-zag with FSDP; 1F1B contiguous with accumulation.
    pytest.param(
        {"data": 2, "stage": 2, "context": 2},
        {
            "strategy": "fsdp",
            "pipeline": sc.Pipeline(microbatches=2, schedule="zb-h1"),
            "context": sc.ContextParallel(),
        },
        1,
        id="zb-h1-context",
        marks=SLOW,
    ),
    pytest.param(
        {"stage": 2, "context": 4},
        {
            "strategy": "ddp",
            "pipeline": sc.Pipeline(microbatches=2, schedule="1f1b"),
            "context": sc.ContextParallel(layout="contiguous"),
        },
        2,
        id="1f1b-context-contiguous-accum2",
        marks=SLOW,
    ),
]


@pytest.mark.parametrize("mesh, kwargs, accum_steps", CASES)
def test_a_token_weighted_loss_trains_one_devices_global_token_mean(mesh, kwargs, accum_steps):
    _, expected = reference()
    state, metrics = train(mesh, accum_steps=accum_steps, **kwargs)
    np.testing.assert_allclose([m["loss"] for m in metrics], [loss for loss, _ in expected], rtol=1e-5)
    assert [float(m["tokens"]) for m in metrics] == [float(lengths(i)[:13].sum()) for i in range(STEPS)]
    assert [float(m["examples"]) for m in metrics] == [13.0] * STEPS
    assert_trees_close(jax.device_get(state.full_params()), expected[-1][1], rtol=1e-4, atol=1e-5)


def eval_set():
    """Three full batches and a last one of 5 real rows, padded to 16 with masked rows."""
    full = [global_batch(10 + i) for i in range(3)]
    last = {k: v[:5] for k, v in global_batch(13).items()}
    return full + [last], full + [sc.pad_batch(last, ROWS)]


def test_evaluate_gives_the_exact_token_weighted_mean_of_an_eval_set_with_a_padded_last_batch():
    boxed, _ = reference()
    params = nn.unbox(boxed)
    real, padded = eval_set()
    whole = {k: np.concatenate([b[k] for b in real]) for k in real[0]}
    # One compiled program for the one-device reference (eagerly, each of the model's ops compiles its own).
    ce, right = jax.jit(lambda p, b: (token_losses(p, b), jnp.argmax(MODEL.apply({"params": p}, b["tokens"]), -1)))(
        params, whole
    )
    ce, w = np.asarray(ce, np.float64), whole["weights"].astype(np.float64)
    right = np.asarray(right == whole["targets"], np.float64)
    state = sc.TrainState.create(
        params=boxed,
        apply_fn=MODEL.apply,
        tx=tx(),
        mesh=sc.make_mesh({"data": 2, "context": 4}),
        context=sc.ContextParallel(),
    )
    got = sc.evaluate(sc.make_eval_step(metric_fn), state, padded)
    assert got["tokens"] == w.sum() and got["examples"] == len(w)
    np.testing.assert_allclose(got["loss"], (ce * w).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], (right * w).sum() / w.sum(), rtol=1e-6)
    np.testing.assert_allclose(got["row_mean"], w.mean(-1).mean(), rtol=1e-6)  # a plain mean still weighs by rows


def scalar_loss(total, weight, aux=None):
    def fn(params, batch, *, apply_fn, model_state, rng, mask):
        return (sc.weighted(total(params, batch), weight(batch)), aux or {})

    return fn


@pytest.mark.parametrize(
    "total, weight, match",
    [
        (np.ones(3, np.float32), 1.0, r"total has shape \(3,\) and dtype float32; it must be a float scalar"),
        (np.int32(3), 1.0, r"total has shape \(\) and dtype int32"),
        (1.0, np.ones((2, 2)), r"weight has shape \(2, 2\); it must be a scalar"),
    ],
)
def test_weighted_refuses_what_is_not_a_sum_and_its_weight(total, weight, match):
    with pytest.raises(sc.ShapeError, match=match) as e:
        sc.weighted(total, weight)
    assert "jnp.sum(token_loss * weights), jnp.sum(weights)" in str(e.value)


def test_a_tokens_metric_beside_a_token_weighted_loss_is_refused():
    state = sc.TrainState.create(
        params={"w": np.zeros((), np.float32)}, tx=optax.sgd(0.1), mesh=sc.make_mesh({"data": 8})
    )
    loss = scalar_loss(lambda p, b: jnp.sum(b * p["w"]), jnp.sum, {"tokens": jnp.float32(1.0)})
    with pytest.raises(sc.SpmdError, match=r"aux holds \['tokens'\], which the step reports itself"):
        sc.make_train_step(loss)(state, np.ones((8, 4), np.float32))


def test_float16_loss_scaling_differentiates_the_global_token_mean():
    """Scale 2048, 32 tokens per device of 256: one device's ``scale * mean`` has a finite float16 gradient (4096), the
    scaled unnormalised sum of one device would not (2048 * 2 * 32 = 131072 > 65504). The step must not skip."""
    state = sc.TrainState.create(
        params={"w": np.ones((), np.float16)},
        tx=optax.sgd(0.1),
        mesh=sc.make_mesh({"data": 8}),
        loss_scale={"scale": 2048.0},
    )
    loss = scalar_loss(lambda p, b: jnp.sum((b["x"] * p["w"]) ** 2 * b["w"]), lambda b: jnp.sum(b["w"]))
    batch = {"x": np.ones((16, 16), np.float16), "w": np.ones((16, 16), np.float16)}
    state, metrics = sc.make_train_step(loss, accum_steps=2)(state, batch)
    assert float(metrics["skipped"]) == 0.0 and float(metrics["tokens"]) == 256.0
    np.testing.assert_allclose(float(state.params["w"]), 0.8, rtol=1e-3)  # w - 0.1 * d(mean w^2)/dw


def test_the_global_row_count_of_an_unmasked_batch_does_not_warn():
    """``sc.psum(jnp.sum(mask), "data")`` is the global row count: the step's all-True mask of an unmasked batch is
    per device, as a MaskedBatch's is, so the sum does not warn of a replicated value multiplied by the axis size."""

    def rows_loss(params, batch, *, apply_fn, model_state, rng, mask):
        rows = sc.psum(jnp.sum(mask, dtype=jnp.float32), "data")
        return sc.masked_mean((batch * params["w"]) ** 2, mask), {"rows": rows}

    state = sc.TrainState.create(
        params={"w": np.ones((), np.float32)}, tx=optax.sgd(0.1), mesh=sc.make_mesh({"data": 8})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", sc.ReplicatedReductionWarning)
        _, metrics = sc.make_train_step(rows_loss)(state, np.ones((16, 4), np.float32))
    assert float(metrics["rows"]) == 16.0
