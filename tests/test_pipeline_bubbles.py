"""Bubbles change nothing, whatever the block computes: blocks whose value or derivative is not finite at zero
(RMS normalisation without epsilon, a norm, a log) with NaN in every buffer slot a bubble reads train exactly as on
one device, under GPipe and the circular schedule, Linen and NNX, every strategy.

Every test here traces its programs with NaN as the buffers' fill (``nan_fill``); their models and layer functions
are used nowhere else, so no program traced with another fill is reused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.parallel.pipeline import gpipe
from spmdcomm.parallel.pipeline.layer_order import stage_order
from tests.ddp_models import assert_trees_close
from tests.test_pipeline import (
    LAYERS,
    SLOW,
    TX,
    Net,
    batches,
    core_program,
    init,
    nnx_one_device,
    nnx_train,
    one_device,
    rms,
    scan_reference,
    train,
)


@pytest.fixture(autouse=True)
def nan_fill(monkeypatch):
    monkeypatch.setattr(gpipe, "_FILL", np.nan)


# --- the schedule against a scan -----------------------------------------------------------------------------


def rms_layer(w, state, h, index, row):
    """NaN at zero, value and derivative."""
    return h + rms(h @ w), state


def norm_layer(w, state, h, index, row):
    """Zero at zero, but ``jnp.linalg.norm``'s derivative there is NaN."""
    return h + 0.3 * jnp.linalg.norm(h, axis=-1, keepdims=True) * jnp.tanh(h @ w), state


def log_layer(w, state, h, index, row):
    """Minus infinity at zero, its derivative NaN."""
    return h + 0.1 * jnp.log(jnp.mean(h * h, axis=-1, keepdims=True)) + jnp.tanh(h @ w), state


LAYER_FNS = {"rms": rms_layer, "norm": norm_layer, "log": log_layer}


# A covering set: each block (rms and log twice), d = 1, 2, 4; p = 2, 4, 8; v = 1 and 2; m = p and m > p.
@pytest.mark.parametrize(
    "name, d, p, m, v",
    [
        ("rms", 2, 2, 4, 2),
        pytest.param("log", 2, 4, 4, 1, marks=SLOW),
        pytest.param("log", 1, 4, 8, 2, marks=SLOW),
        pytest.param("rms", 1, 8, 8, 1, marks=SLOW),
        pytest.param("norm", 4, 2, 2, 2, marks=SLOW),
    ],
)
def test_a_block_not_finite_at_zero_pipelines_as_a_scan_forward_and_backward(name, d, p, m, v):
    layer = LAYER_FNS[name]
    rng = np.random.default_rng(5)
    weights = (rng.normal(size=(LAYERS, 6, 6)) / np.sqrt(6)).astype(np.float32)
    x = rng.normal(size=(d * m * 2, 6)).astype(np.float32)
    # Jitted: one program instead of one per operation and shape run eagerly.
    at_zero = jax.jit(jax.value_and_grad(lambda w, h: jnp.sum(layer(w, {}, h, 0, 0)[0]), argnums=(0, 1)))
    value, grads = at_zero(weights[0], np.zeros((2, 6), np.float32))
    assert not all(np.isfinite(a).all() for a in (value, *grads))  # what a bubble computing on zeros would meet
    order = stage_order(LAYERS, p, v)
    forward, grad = core_program(d, p, m, v, layer)
    scan, scan_grad = scan_reference(layer)
    np.testing.assert_allclose(forward(weights[order], x), scan(weights, x), rtol=1e-5, atol=1e-5)
    expected = scan_grad(weights, x)
    got = np.asarray(grad(weights[order], x))[np.argsort(order)]
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


# --- the train step against one device -----------------------------------------------------------------------


# A covering set of the strategies: the bubbles are the schedule's, which every strategy runs alike; they differ in
# how the stage's gradient is reduced after it and where the layers are gathered. ZeRO-1 here stands for DDP too
# (replicated layers; only the optimizer state is split), the NNX test below runs ZeRO-2, and FSDP runs in both.
@SLOW
@pytest.mark.parametrize(
    "layout, strategy, m, v",
    [({"data": 2, "stage": 4}, "zero1", 4, 2), ({"data": 2, "stage": 2, "model": 2}, "fsdp", 2, 2)],
    ids=str,
)
def test_a_block_without_epsilon_trains_as_one_device(layout, strategy, m, v):
    """The issue's block: RMS normalisation with no epsilon, NaN at zero; one device trains it, and so must every
    layout (its first step used to make the stacked kernels NaN)."""
    model = "model" in layout
    expected, expected_losses = one_device(32, rms=True)
    net = Net(model, rms=True)
    state = sc.TrainState.create(
        params=init(net),
        apply_fn=net.apply,
        tx=TX,
        mesh=sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))]),
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, repeats=v),
    )
    state, losses = train(state, batches())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # A block without epsilon divides by its rows' RMS, which magnifies the rounding in which the layouts' programs
    # differ: one kernel entry of 4096 is 2.5e-5 apart after the steps (compiled without backend optimisation).
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=5e-5)


@SLOW
@pytest.mark.parametrize(
    "layout, strategy, m, v",
    [({"data": 2, "stage": 4}, "zero2", 4, 1), ({"data": 4, "stage": 2}, "fsdp", 4, 2)],
    ids=str,
)
def test_an_nnx_block_without_epsilon_trains_as_one_device(layout, strategy, m, v):
    reference, expected = nnx_one_device(rms_norm=True)
    pipeline = sc.Pipeline(microbatches=m, repeats=v)
    state, losses = nnx_train(sc.make_mesh(layout), strategy, rms_norm=True, pipeline=pipeline)
    assert state.params["stack"]["layers"]["up"]["kernel"].sharding.spec[0] == "stage"
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), reference, rtol=1e-5, atol=1e-5)
