"""The 1F1B schedule (``sc.Pipeline(..., schedule="1f1b")``): the train step equals one device, as GPipe's does,
under every strategy and layout; a stage keeps at most ``2p - 1`` micro-batches' activations whatever ``m``; what
it does not run is refused with a clear error. The models and references are tests/test_pipeline.py's."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import spmdcomm as sc
from tests.ddp_models import assert_trees_close
from tests.test_pipeline import (
    SLOW,
    TX,
    Net,
    NormNet,
    batches,
    init,
    loss_fn,
    nnx_one_device,
    nnx_train,
    norm_loss,
    one_device,
    train,
)


def create(layout, strategy, m, *, net=None, axis="data", **kwargs):
    net = Net("model" in layout) if net is None else net
    return sc.TrainState.create(
        params=init(net),
        apply_fn=net.apply,
        tx=TX,
        mesh=sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))]),
        axis=axis,
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, schedule="1f1b", **kwargs),
    )


@pytest.mark.parametrize(
    "layout, strategy, m, accum, padded, rms",
    [
        ({"data": 2, "stage": 2}, "ddp", 4, 1, False, False),
        pytest.param({"data": 2, "stage": 4}, "fsdp", 8, 1, True, False, marks=SLOW),
        pytest.param({"data": 2, "stage": 2, "model": 2}, "zero1", 2, 1, False, False, marks=SLOW),
        pytest.param({"data": 4, "stage": 2}, "zero2", 2, 2, True, False, marks=SLOW),
        # A block not finite at zero (RMS normalisation without epsilon): 1F1B's idle items run on real rows too.
        pytest.param({"stage": 8}, "ddp", 8, 1, False, True, marks=SLOW),
    ],
    ids=str,
)
def test_1f1b_train_step_equals_one_device(layout, strategy, m, accum, padded, rms):
    expected, expected_losses = one_device(29 if padded else 32, rms=rms)
    state = create(layout, strategy, m, net=Net("model" in layout, rms=rms))
    data = [{k: v[:29] for k, v in b.items()} for b in batches()] if padded else batches()
    state, losses = train(state, data, accum=accum, pad_to=32 if padded else None)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=1e-5)
    # The eval step runs the stack's forward loop (GPipe's): one device's metric on the trained parameters.
    metric = lambda params, batch, *, apply_fn, model_state, mask: {
        "loss": loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=jax.random.key(0), mask=mask)
    }
    mesh = sc.make_mesh({"data": 1}, devices=jax.devices()[:1])
    one = sc.TrainState.create(params=expected, apply_fn=Net(rms=rms).apply, tx=TX, mesh=mesh)
    batch = sc.pad_batch(data[0], 32) if padded else data[0]
    want = sc.make_eval_step(metric)(one, batch)["loss"]
    np.testing.assert_allclose(sc.make_eval_step(metric)(state, batch)["loss"], want, rtol=1e-5)


@SLOW
def test_1f1b_with_loss_scaling_skips_a_non_finite_step_as_one_device():
    """Loss scaling weighs each part of a micro-batch by its share of the global batch: a NaN in one row skips
    the step on every stage, the scale backs off once, and the run is one device's."""

    def run(state):
        data = batches(steps=3)
        data[1]["x"][5, 2] = np.nan
        step, seen = sc.make_train_step(loss_fn), []
        for batch in data:
            state, metrics = step(state, batch)
            seen.append([float(metrics[k]) for k in ("loss", "skipped", "loss_scale")])
        return jax.device_get(state.full_params()), np.array(seen)

    scale = {"scale": 2.0**15}
    mesh = sc.make_mesh({"data": 1}, devices=jax.devices()[:1])
    want, want_seen = run(
        sc.TrainState.create(params=init(Net()), apply_fn=Net().apply, tx=TX, mesh=mesh, loss_scale=scale)
    )
    state = create({"data": 2, "stage": 4}, "zero2", 8)
    got, seen = run(state.replace(loss_scale=sc.TrainState.create(params={}, tx=TX, loss_scale=scale).loss_scale))
    assert want_seen[:, 1].tolist() == [0.0, 1.0, 0.0]
    np.testing.assert_allclose(seen, want_seen, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)


@SLOW
def test_1f1b_draws_one_devices_dropout_masks_per_example():
    """Dropout keyed by example and layer: a stage running another device's micro-batch draws that micro-batch's
    bits, with accumulation too."""
    expected, expected_losses = one_device(32, dropout=0.2, rng="per_example")
    state = create({"data": 2, "stage": 4}, "ddp", 4, net=Net(dropout=0.2))
    state, losses = train(state, batches(), rng="per_example", accum=2)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=1e-5)


@SLOW
def test_1f1b_nnx_stack_trains_as_one_device():
    reference, expected = nnx_one_device()
    pipeline = sc.Pipeline(microbatches=4, schedule="1f1b")
    state, losses = nnx_train(sc.make_mesh({"data": 2, "stage": 4}), "zero2", pipeline=pipeline)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), reference, rtol=1e-5, atol=1e-5)


@SLOW
def test_a_1f1b_checkpoint_resumes_under_gpipe_as_one_device(tmp_path):
    """The schedule changes nothing of the state: saved after two 1F1B steps, restored under GPipe (another
    layout), the third step gives one device's parameters."""
    expected, expected_losses = one_device(32)
    data = batches()
    state, losses = train(create({"data": 2, "stage": 4}, "zero1", 4), data[:2])
    sc.save_checkpoint(tmp_path, state)
    target = create({"data": 4, "stage": 2}, "fsdp", 2).replace(pipeline=sc.Pipeline(microbatches=2))
    restored, more = train(sc.restore_checkpoint(tmp_path, target), data[2:])
    np.testing.assert_allclose(losses + more, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(restored.full_params()), expected, rtol=1e-5, atol=1e-5)


@SLOW
def test_1f1b_keeps_a_bounded_number_of_micro_batches_and_recomputes_nothing():
    """The compiled step's temporaries: 1F1B's ring of 2p - 1 micro-batches' activations, against GPipe keeping
    every tick's (v m + p - 1) without remat; explain reports the schedule's numbers."""
    batch = {k: np.concatenate([v] * 8) for k, v in batches()[0].items()}
    step = sc.make_train_step(loss_fn)
    layout = {"data": 2, "stage": 2}
    reports = {
        name: sc.explain(step, state, batch)
        for name, state in [
            ("1f1b", create(layout, "ddp", 16)),
            ("gpipe", create(layout, "ddp", 16, net=Net()).replace(pipeline=sc.Pipeline(microbatches=16, remat=False))),
        ]
    }
    pipeline = reports["1f1b"].pipeline
    assert (pipeline.ticks, pipeline.in_flight, pipeline.kept, pipeline.recomputed) == (
        18,
        3,
        "every layer's activations",
        0,
    )
    assert pipeline.bubble == pytest.approx(1 / 17)
    assert reports["gpipe"].pipeline.in_flight == 17
    assert reports["1f1b"].memory.temp_bytes * 2 < reports["gpipe"].memory.temp_bytes, {
        k: r.memory.temp_bytes for k, r in reports.items()
    }


def test_what_1f1b_does_not_run_is_refused():
    with pytest.raises(sc.SpmdError, match=r"schedule='1f1b' with repeats=2.*interleaved 1F1B is not built yet"):
        sc.Pipeline(microbatches=4, repeats=2, schedule="1f1b")
    with pytest.raises(sc.SpmdError, match=r"schedule='zb'"):
        sc.Pipeline(microbatches=4, schedule="zb")
    variables = jax.jit(NormNet().init)(jax.random.key(0), np.zeros((2, 5), np.float32))
    state = sc.TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        apply_fn=NormNet().apply,
        tx=optax.sgd(0.1),
        mesh=sc.make_mesh({"data": 2, "stage": 2}, devices=jax.devices()[:4]),
        pipeline=sc.Pipeline(microbatches=2, schedule="1f1b"),
    )
    with pytest.raises(sc.SpmdError, match=r"mutable state \(BatchNorm's statistics\) under schedule='1f1b'"):
        sc.make_train_step(norm_loss)(state, batches(rows=16)[0])
