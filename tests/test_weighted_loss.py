"""Token-weighted losses (``sc.weighted``): the train step trains one device's ``sum(loss * w) / sum(w)`` over the
global batch, and the eval step and ``sc.evaluate`` report it, for any distribution of real tokens: rows without a
real token, a device holding only padding (masked rows), an accumulation micro-batch without a token, a pipeline's
rows and a context axis whose devices hold different numbers of real tokens. The reference is plain ``jax.grad`` +
optax on one device over the whole batch (no spmdcomm)."""

from __future__ import annotations

import functools

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
    ce, w = token_losses(params, batch), batch["weights"]
    right = (jnp.argmax(MODEL.apply({"params": params}, batch["tokens"]), -1) == batch["targets"]) * w
    return sc.weighted(jnp.sum(ce * w), jnp.sum(w)), {"accuracy": sc.weighted(jnp.sum(right), jnp.sum(w))}


def metric_fn(params, batch, *, apply_fn, model_state, mask):
    return loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)[1] | {
        "loss": loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)[0],
        "row_mean": sc.masked_mean(jnp.sum(batch["weights"], -1), mask),
    }


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
CASES = [  # the fast tier runs one case of each kind of split: data and accumulation, context, pipeline
    pytest.param({"data": 8}, {"strategy": "ddp"}, 2, id="data8-ddp-accum2"),
    pytest.param({"data": 2, "context": 4}, {"strategy": "fsdp", "context": sc.ContextParallel()}, 1, id="context"),
    pytest.param(
        {"data": 2, "stage": 2, "context": 2},
        {"strategy": "zero1", "pipeline": sc.Pipeline(microbatches=2), "context": sc.ContextParallel()},
        1,
        id="pipeline-context",
    ),
    pytest.param({"data": 8}, {"strategy": "zero2"}, 4, id="data8-zero2-accum4", marks=SLOW),
    pytest.param({"data": 4, "model": 2}, {"strategy": "fsdp"}, 1, id="fsdp-model-axis", marks=SLOW),
    pytest.param(
        {"replica": 2, "data": 4}, {"strategy": "fsdp", "axis": ("replica", "data")}, 2, id="hybrid", marks=SLOW
    ),
    pytest.param(
        {"data": 4, "stage": 2},
        {"strategy": "ddp", "pipeline": sc.Pipeline(microbatches=4)},
        2,
        id="pipeline-accum2",
        marks=SLOW,
    ),
    pytest.param(
        {"data": 2, "context": 4},
        {"strategy": "ddp", "context": sc.ContextParallel(layout="contiguous")},
        2,
        id="context-contiguous-accum2",
        marks=SLOW,
    ),
    pytest.param({"data": 8}, {"strategy": "ddp", "loss_scale": "dynamic"}, 2, id="loss-scale", marks=SLOW),
]


@pytest.mark.parametrize("mesh, kwargs, accum_steps", CASES)
def test_a_token_weighted_loss_trains_one_devices_global_token_mean(mesh, kwargs, accum_steps):
    _, expected = reference()
    state, metrics = train(mesh, accum_steps=accum_steps, **kwargs)
    np.testing.assert_allclose([m["loss"] for m in metrics], [loss for loss, _ in expected], rtol=1e-5)
    assert [float(m["tokens"]) for m in metrics] == [float(lengths(i)[:13].sum()) for i in range(STEPS)]
    assert [float(m["examples"]) for m in metrics] == [13.0] * STEPS
    assert_trees_close(jax.device_get(state.full_params()), expected[-1][1], rtol=1e-4, atol=1e-5)
