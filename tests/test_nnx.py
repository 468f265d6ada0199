"""Flax NNX through the DDP step: RNG streams (dropout, several nnx.Rngs streams), BatchNorm, the eval
adapter, checkpoints and several processes. The fast tier (``-m "not slow"``) leaves out the two-process job, the
CNN trained end to end, several streams and the stream keys under per-device keys."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_rng import NnxDropout, batches, nnx_mse

import spmdcomm as sc

WIDTH = 32


def mesh_of(n):
    return sc.data_mesh(devices=jax.devices()[:n])


def data_of(x):
    """NumPy copy of an array, typed keys as their key data (bitwise comparisons)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def assert_bitwise_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(data_of(x), data_of(y))


def streams(state):
    """{stream path: (key data, count)} of every RNG stream in an NNX TrainState."""
    model = nnx.merge(state.apply_fn, state.params, state.model_state)
    return {
        path: (data_of(node.key.get_value()).tolist(), int(node.count.get_value()))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.RngStream)
    }


class Probe(nnx.Module):
    """Dropout on its input; stores the mean dropped-out row in a float state variable, which the step
    averages over devices: all-equal masks would leave only the values 0 and 2 there."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((WIDTH,)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.seen = nnx.BatchStat(jnp.zeros((WIDTH,)))

    def __call__(self, x):
        y = self.drop(x * self.w[...])
        self.seen[...] = y.mean(0)
        return y


def probe_loss(model, batch, *, rng, mask):
    return sc.masked_mean(model(batch).sum(-1), mask)


class CNN(nnx.Module):
    """Conv -> cross-replica BatchNorm -> relu -> mean pool -> Dropout -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, axis_name="data", rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x))).mean(axis=(1, 2))
        return self.head(self.drop(x))


def cnn_loss(model, batch, *, rng, mask):
    logits = model(batch["x"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)


def cnn_metrics(model, batch, *, mask):
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    accuracy = (logits.argmax(-1) == batch["y"]).astype(jnp.float32)
    return {"loss": sc.masked_mean(ce, mask), "accuracy": sc.masked_mean(accuracy, mask)}


def cnn_batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.standard_normal((16, 6, 6, 1), dtype=np.float32), "y": rng.integers(0, 3, 16).astype(np.int32)}
        for _ in range(steps)
    ]


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
def test_create_nnx_with_several_rng_streams():
    model = NnxDropout(nnx.Rngs(params=0, dropout=1, noise=2))
    _, _, rest = nnx.split(model, nnx.Param, ...)
    state = sc.TrainState.create_nnx(model, tx=optax.sgd(0.1), mesh=mesh_of(4))
    # Keys stay typed keys of the same implementation, placed replicated, with the model's values.
    assert_bitwise_equal(state.model_state, rest)
    keys = [x for x in jax.tree.leaves(state.model_state) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert len(keys) == 4  # params, dropout, noise (Rngs) and the Dropout layer's forked stream
    assert all(k.sharding.is_fully_replicated and len(k.sharding.device_set) == 4 for k in keys)
    assert sc.check_replicas_in_sync(state) == []


@pytest.mark.parametrize("rng", ["per_device", "per_example"])
def test_dropout_masks_differ_across_devices_and_steps(rng):
    mesh = mesh_of(8)
    state = sc.TrainState.create_nnx(Probe(nnx.Rngs(0)), tx=optax.sgd(0.0), mesh=mesh)
    step = sc.make_train_step(sc.nnx_loss_fn(probe_loss), rng=rng)
    ones = np.ones((8, WIDTH), np.float32)  # one identical row per device
    seen = []
    for _ in range(2):
        state, _ = step(state, ones)
        seen.append(data_of(state.model_state["seen"]))
    for s in seen:
        # Averaged over 8 devices: entries strictly between 0 and 2 come from devices that differ.
        assert np.mean((s > 0) & (s < 2)) > 0.5, s
        assert abs(float(s.mean()) - 1.0) < 0.4  # about half of the entries kept, scaled by 2
    assert not np.array_equal(seen[0], seen[1])
    sc.assert_replicated(state)


def test_one_device_mask_is_a_real_dropout_mask():
    mesh = mesh_of(1)
    state = sc.TrainState.create_nnx(Probe(nnx.Rngs(0)), tx=optax.sgd(0.0), mesh=mesh)
    state, _ = sc.make_train_step(sc.nnx_loss_fn(probe_loss))(state, np.ones((1, WIDTH), np.float32))
    assert set(np.unique(data_of(state.model_state["seen"]))) == {0.0, 2.0}


@pytest.mark.parametrize(
    "rng,accum_steps",
    [
        pytest.param("per_device", 1, marks=pytest.mark.slow),
        pytest.param("per_device", 2, marks=pytest.mark.slow),
        ("per_example", 2),
    ],
)
def test_stream_keys_are_restored_and_counts_advance_identically(rng, accum_steps):
    mesh = mesh_of(4)
    state = sc.TrainState.create_nnx(NnxDropout(nnx.Rngs(params=0, dropout=1, noise=2)), tx=optax.adam(1e-3), mesh=mesh)
    before = streams(state)
    step = sc.make_train_step(sc.nnx_loss_fn(nnx_mse), rng=rng, accum_steps=accum_steps)
    state, _ = sc.fit(step, state, batches(3))
    after = streams(state)
    sc.assert_replicated(state)  # keys, counts, params on every device
    assert after.keys() == before.keys()
    # One dropout call and one noise draw per forward pass: accum_steps forward passes per step.
    drawn = {path for path in before if path[-1] in ("noise", "rngs")}
    assert len(drawn) == 2, before.keys()
    for path, (key, count) in after.items():
        assert key == before[path][0]  # keys are never averaged nor advanced
        assert count == before[path][1] + (3 * accum_steps if path in drawn else 0), path


@pytest.mark.slow
def test_cnn_with_batchnorm_and_dropout_end_to_end(tmp_path):
    mesh = mesh_of(4)
    data = cnn_batches(4)

    def fresh():
        return sc.TrainState.create_nnx(CNN(nnx.Rngs(0)), tx=optax.sgd(0.1, momentum=0.9), mesh=mesh)

    step = sc.make_train_step(sc.nnx_loss_fn(cnn_loss))
    state, history = sc.fit(step, fresh(), data[:2])
    sc.assert_replicated(state)
    assert all(np.isfinite(h["loss"]) for h in history)

    # Evaluation: dropout off, BatchNorm on its running statistics, the state untouched.
    evaluate = sc.make_eval_step(sc.nnx_metric_fn(cnn_metrics))
    metrics = evaluate(state, data[0])
    assert float(evaluate(state, data[0])["loss"]) == float(metrics["loss"])
    model = nnx.merge(state.apply_fn, *jax.device_get((state.params, state.model_state)))
    model.eval()
    local = cnn_metrics(model, data[0], mask=np.ones(16, bool))
    np.testing.assert_allclose(float(metrics["loss"]), float(local["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), float(local["accuracy"]), rtol=1e-6)

    # Checkpoint round trip (typed keys included), then resume: bitwise the uninterrupted run.
    sc.save_checkpoint(tmp_path, state)
    restored = sc.restore_checkpoint(tmp_path, fresh())
    assert_bitwise_equal(
        (restored.params, restored.opt_state, restored.model_state, restored.step),
        (state.params, state.opt_state, state.model_state, state.step),
    )
    resumed, _ = sc.fit(step, restored, data[2:])
    uninterrupted, _ = sc.fit(step, state, data[2:])
    assert_bitwise_equal(resumed, uninterrupted)


def test_nnx_metric_fn_turns_dropout_off():
    model = nnx.Sequential(nnx.Linear(WIDTH, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.9, rngs=nnx.Rngs(1)))
    state = sc.TrainState.create_nnx(model, tx=optax.sgd(0.1), mesh=mesh_of(2))
    x = np.random.default_rng(0).standard_normal((8, WIDTH), dtype=np.float32)
    evaluate = sc.make_eval_step(sc.nnx_metric_fn(lambda m, b, *, mask: sc.masked_mean(m(b).sum(-1), mask)))
    model.eval()
    np.testing.assert_allclose(float(evaluate(state, x)["loss"]), float(model(x).sum(-1).mean()), rtol=1e-5)
    assert_bitwise_equal(evaluate(state, x)["loss"], evaluate(state, x)["loss"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_create_nnx_broadcasts_stream_keys_across_processes(launch, tmp_path):
    out = launch("mp_nnx.py", tmp_path, timeout=120).stdout
    keys = [json.loads((tmp_path / f"keys.{p}.json").read_text()) for p in range(2)]
    assert keys[0] and keys[0] == keys[1], keys  # process 1 got process 0's keys
    assert out.count("NNX OK") == 2
    # Same result as one process on 4 devices (per-example randomness, process 0's seeds).
    mesh = mesh_of(4)
    state = sc.TrainState.create_nnx(
        NnxDropout(nnx.Rngs(params=0, dropout=1, noise=2)), tx=optax.sgd(0.05), rng=7, mesh=mesh
    )
    step = sc.make_train_step(sc.nnx_loss_fn(nnx_mse), rng="per_example")
    state, _ = sc.fit(step, state, batches(2))
    saved = np.load(tmp_path / "nnx_params.npz")
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        np.testing.assert_allclose(saved[jax.tree_util.keystr(path)], data_of(leaf), rtol=2e-5, atol=2e-6)
