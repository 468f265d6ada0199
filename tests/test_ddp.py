"""DDP step features: reduction layout in HLO, skipping, replica checks, NNX, checkpoints. The fast tier
(``-m "not slow"``) checks skipping under DDP and one bucket size; ZeRO-1's runs, resuming, BatchNorm's statistics,
the other bucket sizes and the two-process job are slow."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ddp_models import (
    BATCHES,
    assert_trees_close,
    example_batch,
    init,
    loss_fn,
    mesh_of,
    reference_train,
    token_batches,
    token_mean_loss,
    write_initial,
)

import spmdcomm as sc


def test_accumulation_reduces_gradients_once():
    apply_fn, params, model_state = init("mlp")
    mesh = mesh_of(2)
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.sgd(0.1), mesh=mesh)
    step = sc.make_train_step(loss_fn, accum_steps=4)
    hlo = step.lower(state, BATCHES["mlp"][0]).compile().as_text()
    assert len(all_reduce_lines(hlo)) == 1


def test_eval_step_gives_exact_masked_means():
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(4)
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.sgd(0.1), mesh=mesh)
    batch = example_batch("mlp", 15, seed=3)

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        loss, aux = loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)
        return {"loss": loss, "accuracy": aux["accuracy"]}

    got = sc.make_eval_step(metric_fn)(state, sc.pad_batch(batch, 4))
    logits = apply_fn({"params": params}, batch["x"])
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
    np.testing.assert_allclose(float(got["loss"]), ce.mean(), rtol=1e-6)
    assert float(got["accuracy"]) == pytest.approx(np.mean(np.argmax(logits, -1) == batch["y"]))
    assert float(got["examples"]) == 15


def all_reduce_lines(hlo):
    return [line for line in hlo.splitlines() if " all-reduce(" in line or " all-reduce-start(" in line]


def all_reduce_buffers(hlo):
    """The operand shapes of every all-reduce in compiled HLO, e.g. ['f32[100]', 'f32[3]']."""
    shapes = []
    for line in all_reduce_lines(hlo):
        result = line.split("=", 1)[1].split(" all-reduce", 1)[0]
        shapes += re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", result)
    return shapes


@pytest.mark.parametrize(
    "bucket_bytes", [pytest.param(10**9, marks=pytest.mark.slow), 400, pytest.param(100, marks=pytest.mark.slow)]
)
def test_buckets_give_one_all_reduce_buffer_each(bucket_bytes):
    apply_fn, params, _ = init("mlp")  # 8*16 + 16 + 16*4 + 4 = 212 float32 = 848 bytes
    mesh = mesh_of(2)
    state = sc.TrainState.create(
        params=params, apply_fn=apply_fn, tx=optax.sgd(0.1), mesh=mesh, strategy=sc.DDP(bucket_bytes=bucket_bytes)
    )
    step = sc.make_train_step(loss_fn)
    shapes = all_reduce_buffers(step.lower(state, BATCHES["mlp"][0]).compile().as_text())
    # The example count, loss and accuracy (3 floats) lead the float32 gradients: 215 floats.
    per_bucket = bucket_bytes // 4
    buckets = [min(per_bucket, 215 - start) for start in range(0, 215, per_bucket)]
    assert sorted(shapes) == sorted(f"f32[{size}]" for size in buckets)
    state, _ = sc.fit(step, state, BATCHES["mlp"])
    ref_params, _, _ = reference_train(loss_fn, apply_fn, params, {}, optax.sgd(0.1), BATCHES["mlp"])
    assert_trees_close(state.params, ref_params)


def test_default_reduction_is_one_fused_all_reduce_of_the_leaves():
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(2)
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.sgd(0.1), mesh=mesh)
    hlo = sc.make_train_step(loss_fn).lower(state, BATCHES["mlp"][0]).compile().as_text()
    assert len(all_reduce_lines(hlo)) == 1
    assert sorted(all_reduce_buffers(hlo)) == sorted(["f32[3]", "f32[16]", "f32[8,16]", "f32[4]", "f32[16,4]"])


@pytest.mark.parametrize("zero", ["ddp", pytest.param("zero1", marks=pytest.mark.slow)])
def test_skip_nonfinite_skips_on_every_replica(zero):
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(4)
    bad = example_batch("mlp", 16, seed=9)
    bad["x"][13, 0] = np.inf  # only device 3 sees it
    batches = [BATCHES["mlp"][0], bad, BATCHES["mlp"][1]]
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh, strategy=zero)
    state, history = sc.fit(
        sc.make_train_step(loss_fn, skip_nonfinite=True),
        state,
        batches,
    )
    assert [h["skipped"] for h in history] == [0.0, 1.0, 0.0]
    sc.assert_replicated(state)
    ref_params, _, _ = reference_train(
        loss_fn, apply_fn, params, {}, optax.adam(1e-2), [BATCHES["mlp"][0], BATCHES["mlp"][1]]
    )
    assert_trees_close(state.params, ref_params)
    assert int(state.step) == 3


def test_without_skip_nonfinite_a_bad_batch_poisons_the_params():
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(4)
    bad = example_batch("mlp", 16, seed=9)
    bad["x"][13, 0] = np.inf
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh)
    state, _ = sc.fit(sc.make_train_step(loss_fn), state, [bad])
    assert not np.all(np.isfinite(np.asarray(state.params["Dense_0"]["kernel"])))


def test_assert_replicated_names_the_diverging_leaf_and_device():
    _, params, _ = init("mlp")
    mesh = mesh_of(4)
    state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh)
    leaf = state.params["Dense_1"]["bias"]
    copies = [np.asarray(leaf) + (1e-7 if d.id == 2 else 0.0) for d in mesh.devices.flat]
    broken = jax.make_array_from_single_device_arrays(
        leaf.shape,
        leaf.sharding,
        [jax.device_put(c, d) for c, d in zip(copies, mesh.devices.flat, strict=True)],
    )
    state = state.replace(params={**state.params, "Dense_1": {**state.params["Dense_1"], "bias": broken}})
    assert sc.check_replicas_in_sync(state) == [sc.runtime.Divergence(".params['Dense_1']['bias']", 2, 0)]
    with pytest.raises(sc.ReplicaDivergenceError, match=r"leaf \.params\['Dense_1'\]\['bias'\].*device 2"):
        sc.assert_replicated(state)


@pytest.mark.slow
def test_nnx_model_with_batchnorm_equals_one_device():
    from flax import nnx

    def make(axis_name):
        return nnx.Sequential(
            nnx.Linear(8, 16, use_bias=False, rngs=nnx.Rngs(0)),
            nnx.BatchNorm(16, momentum=0.9, axis_name=axis_name, rngs=nnx.Rngs(0)),
            nnx.relu,
            nnx.Linear(16, 4, rngs=nnx.Rngs(1)),
        )

    def ce(model, batch, *, rng, mask):
        logits = model(batch["x"])
        return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)

    mesh = mesh_of(4)
    state = sc.TrainState.create_nnx(make("data"), tx=optax.adam(1e-2), mesh=mesh)
    state, _ = sc.fit(sc.make_train_step(sc.nnx_loss_fn(ce)), state, BATCHES["mlp"])
    graphdef, params, rest = nnx.split(make(None), nnx.Param, ...)
    ref_params, ref_rest, _ = reference_train(
        sc.nnx_loss_fn(ce), graphdef, params, rest, optax.adam(1e-2), BATCHES["mlp"]
    )
    assert_trees_close(state.params, ref_params)
    assert_trees_close(state.model_state, ref_rest)


@pytest.mark.slow
def test_linen_batchnorm_state_is_averaged_over_devices():
    # Per-device BatchNorm (no axis_name): the step still averages batch_stats, so replicas stay
    # identical and the running mean equals the mean of the per-device running means.
    apply_fn, params, model_state = init("cnn", axis_name=None)
    mesh = mesh_of(4)
    state = sc.TrainState.create(
        params=params, model_state=model_state, apply_fn=apply_fn, tx=optax.sgd(0.0), mesh=mesh
    )
    batch = BATCHES["cnn"][0]
    state, _ = sc.make_train_step(loss_fn)(state, batch)
    sc.assert_replicated(state)
    means = []
    for i in range(4):
        block = {k: v[4 * i : 4 * i + 4] for k, v in batch.items()}
        _, upd = apply_fn({"params": params, **model_state}, block["x"], mutable=["batch_stats"])
        means.append(np.asarray(upd["batch_stats"]["BatchNorm_0"]["mean"]))
    np.testing.assert_allclose(
        state.model_state["batch_stats"]["BatchNorm_0"]["mean"],
        np.mean(means, 0),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_checkpoint_resume_is_bitwise_identical(tmp_path, strategy):
    def noisy_loss(params, batch, *, apply_fn, model_state, rng, mask):
        noisy = {**batch, "x": batch["x"] + 0.1 * jax.random.normal(rng, batch["x"].shape)}
        return loss_fn(params, noisy, apply_fn=apply_fn, model_state=model_state, rng=rng, mask=mask)

    apply_fn, params, model_state = init("cnn", axis_name="data")
    mesh = mesh_of(4)
    batches = [example_batch("cnn", 8, seed=s) for s in range(6)]

    def fresh():
        return sc.TrainState.create(
            params=params,
            model_state=model_state,
            apply_fn=apply_fn,
            tx=optax.adam(1e-2),
            mesh=mesh,
            rng=7,
            strategy=strategy,
        )

    step = sc.make_train_step(noisy_loss)
    straight, _ = sc.fit(step, fresh(), batches)
    first, _ = sc.fit(step, fresh(), batches[:3])
    assert sc.save_checkpoint(tmp_path, first) == 3
    resumed = sc.restore_checkpoint(tmp_path, fresh())
    assert int(resumed.step) == 3
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(first.opt_state), strict=True):
        assert a.sharding == b.sharding
    resumed, _ = sc.fit(step, resumed, batches[3:])
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_failed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    _, params, _ = init("mlp")
    state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh_of(2))
    sc.save_checkpoint(tmp_path, state, step=1)
    changed = state.replace(params=jax.tree.map(lambda x: x + 1, state.params))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    for cls in vars(atomicity).values():
        if isinstance(cls, type) and hasattr(cls, "finalize"):
            monkeypatch.setattr(cls, "finalize", crash)
    with pytest.raises(Exception, match="disk full"):
        sc.save_checkpoint(tmp_path, changed, step=2)
    monkeypatch.undo()
    assert sc.latest_checkpoint_step(tmp_path) == 1
    restored = sc.restore_checkpoint(tmp_path, changed)
    assert_trees_close(restored.params, params, rtol=0, atol=0)


def test_restore_without_checkpoint_says_so(tmp_path):
    _, params, _ = init("mlp")
    state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh_of(2))
    with pytest.raises(sc.SpmdError, match="no checkpoint"):
        sc.restore_checkpoint(tmp_path, state)


def test_fit_runs_many_steps_without_deadlock():
    _, params, _ = init("mlp")

    def tiny_loss(params, batch, *, apply_fn, model_state, rng, mask):
        return sc.masked_mean(batch["x"] @ params["Dense_0"]["kernel"], mask) ** 2

    state = sc.TrainState.create(params=params, tx=optax.sgd(1e-3))
    step = sc.make_train_step(tiny_loss, max_in_flight=16)
    state, history = sc.fit(step, state, [BATCHES["mlp"][0]] * 100)
    assert len(history) == 100 and int(state.step) == 100


# --- bad input ------------------------------------------------------------------------------------


def simple_state(mesh, **kwargs):
    apply_fn, params, model_state = init("mlp")
    return sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.sgd(0.1), mesh=mesh, **kwargs)


def test_non_scalar_loss_is_rejected():
    def per_example(params, batch, *, apply_fn, model_state, rng, mask):
        return optax.softmax_cross_entropy_with_integer_labels(apply_fn({"params": params}, batch["x"]), batch["y"])

    mesh = mesh_of(4)
    with pytest.raises(sc.ShapeError, match=r"'loss' with shape \(4,\).*float scalar.*masked_mean"):
        sc.make_train_step(per_example)(simple_state(mesh), BATCHES["mlp"][0])


def test_batch_the_devices_cannot_split_needs_a_mask():
    mesh = mesh_of(4)
    with pytest.raises(sc.ShapeError, match=r"10 examples.*4 devices.*pad_batch\(batch, 4\)"):
        sc.make_train_step(loss_fn)(simple_state(mesh), example_batch("mlp", 10, seed=0))
    with pytest.raises(sc.ShapeError, match=r"accum_steps=2.*multiple of 8"):
        sc.make_train_step(loss_fn, accum_steps=2)(simple_state(mesh), example_batch("mlp", 12, seed=0))


def test_mismatched_model_state_tree_is_rejected():
    def drops_state(params, batch, *, apply_fn, model_state, rng, mask):
        loss, aux = loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=rng, mask=mask)
        return loss, {**aux, "model_state": {"other": jnp.zeros(3)}}

    apply_fn, params, model_state = init("cnn", axis_name="data")
    mesh = mesh_of(2)
    state = sc.TrainState.create(
        params=params, model_state=model_state, apply_fn=apply_fn, tx=optax.sgd(0.1), mesh=mesh
    )
    with pytest.raises(sc.SpmdError, match="model_state whose tree or shapes differ"):
        sc.make_train_step(drops_state)(state, BATCHES["cnn"][0])


def test_loss_fn_returning_a_bad_tuple_is_rejected():
    def three(params, batch, **kw):
        return loss_fn(params, batch, **kw) + (1.0,)

    mesh = mesh_of(2)
    with pytest.raises(sc.SpmdError, match=r"tuple of 3 items.*\(loss, aux dict\)"):
        sc.make_train_step(three)(simple_state(mesh), BATCHES["mlp"][0])


def test_the_step_follows_the_state_strategy():
    # The strategy is chosen once, at TrainState.create; one step object serves states of either kind.
    step = sc.make_train_step(loss_fn, donate=False)
    for strategy, kinds in (("ddp", {"all-reduce"}), ("zero1", {"all-reduce", "reduce-scatter", "all-gather"})):
        state = simple_state(mesh_of(4), strategy=strategy)
        hlo = step.lower(state, BATCHES["mlp"][0]).compile().as_text()
        found = {k for k in ("all-reduce", "reduce-scatter", "all-gather") if f" {k}(" in hlo or f" {k}-start(" in hlo}
        assert found == kinds, (strategy, found)
        assert int(step(state, BATCHES["mlp"][0])[0].step) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"accum_steps": 0}, "accum_steps=0"),
        ({"accum_steps": True}, "accum_steps=True"),
        ({"max_in_flight": 40}, r"max_in_flight=40.*\[1, 16\]"),
        ({"backend": "xmap"}, "unknown backend"),
        ({"rng": "per_host"}, "rng='per_host' is not one of"),
        ({"host_input": "mine"}, r"host_input='mine' is not one of \('local', 'global'\)"),
    ],
)
def test_bad_step_options(kwargs, match):
    with pytest.raises(sc.SpmdError, match=match):
        sc.make_train_step(loss_fn, **kwargs)


@pytest.mark.parametrize("make", [sc.make_train_step, sc.make_eval_step], ids=["train", "eval"])
def test_the_pmap_step_backend_is_retired(make):
    with pytest.raises(sc.BackendError) as err:
        make(loss_fn, backend="pmap")
    message = str(err.value)
    assert message.startswith(f"spmdcomm.{make.__name__}: backend='pmap': the pmap step backend was retired.")
    assert "Since JAX 0.10 jax.pmap is jax.jit(jax.shard_map(...))" in message
    assert message.endswith("Fix: drop backend=..., or pass backend='shard_map'.")
    with pytest.raises(sc.BackendError, match=r"unknown backend 'xmap'; the steps run on 'shard_map' only\. Fix: drop"):
        make(loss_fn, backend="xmap")
    make(loss_fn, backend="shard_map")  # the one backend, accepted


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: simple_state(mesh_of(2), strategy="zero3"),
            r"strategy='zero3' is not a strategy.*\('ddp', 'zero1', 'zero2', 'fsdp'\)",
        ),
        (lambda: simple_state(mesh_of(2), strategy=sc.DDP(bucket_bytes=-1)), "DDP: bucket_bytes=-1 must be a positive"),
        (lambda: sc.DDP(bucket_bytes=True), "bucket_bytes=True must be a positive"),
        (lambda: simple_state(mesh_of(2), axis="model"), "axis 'model' is not an axis of the mesh"),
    ],
)
def test_bad_state_options(make, match):
    with pytest.raises(sc.SpmdError, match=match):
        make()


def test_step_rejects_a_state_that_is_not_a_trainstate():
    @dataclasses.dataclass
    class Other:
        params: dict

    with pytest.raises(sc.SpmdError, match="not a TrainState"):
        sc.make_train_step(loss_fn)(Other({}), BATCHES["mlp"][0])


# --- multi-process --------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_of_two_devices_equal_one_device(launch, tmp_path):
    apply_fn, params, _ = init("mlp", seed=0)
    write_initial(tmp_path, seed0=params, seed1=init("mlp", seed=1)[1])
    out = launch("mp_ddp.py", tmp_path, timeout=300)
    assert out.stdout.count("DDP OK") == 2 * len(sc.train.STRATEGIES)
    # One device on the 15 real rows of each batch (the job pads them to 16): one reference for every strategy,
    # compiled once, where a 4-device run per strategy compiled four programs.
    batches = [example_batch("mlp", 15, seed=s) for s in range(5)]
    ref_params, _, ref_losses = reference_train(loss_fn, apply_fn, params, {}, optax.adam(1e-2), batches)
    for strategy in sc.train.STRATEGIES:
        got = np.load(tmp_path / f"params_{strategy}.npz")
        for path, x in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
            name = f"{strategy} {jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(
                got[jax.tree_util.keystr(path)], np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=name
            )
        np.testing.assert_allclose(
            np.load(tmp_path / f"losses_{strategy}.npy"), ref_losses, rtol=1e-5, err_msg=strategy
        )
    # The token-weighted loss: one device's sum(loss * w) / sum(w) over each whole global batch, though process 0
    # holds most of the real tokens (a per-process or per-device token mean would weigh process 1's few as many).
    assert out.stdout.count("WEIGHTED OK") == 2 * 2
    # Rows of 0 to 6 real tokens on process 0's devices, of 0 or 1 on one device of process 1, none on the other
    # (whose accumulation micro-batches are empty too).
    tokens = token_batches(16, 6, 3)
    ref_params, _, ref_losses = reference_train(token_mean_loss, apply_fn, params, {}, optax.adam(1e-2), tokens)
    # The data tells them apart: the mean of the token means of the devices that hold tokens is another number.
    blocks = [jax.tree.map(lambda x, d=d: x[4 * d : 4 * d + 4], tokens[0]) for d in range(3)]
    means = [token_mean_loss(params, b, apply_fn=apply_fn, model_state={}, rng=None, mask=None)[0] for b in blocks]
    assert abs(float(np.mean(means)) / ref_losses[0] - 1) > 1e-2, (means, ref_losses[0])
    for strategy in ("ddp", "fsdp"):
        got = np.load(tmp_path / f"params_weighted_{strategy}.npz")
        for path, x in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
            np.testing.assert_allclose(got[jax.tree_util.keystr(path)], np.asarray(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.load(tmp_path / f"losses_weighted_{strategy}.npy"), ref_losses, rtol=1e-5)
