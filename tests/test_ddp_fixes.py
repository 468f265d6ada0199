"""Train/eval step correctness: consumed (donated) states, states from another mesh, NaN in masked-out rows,
float64 under x64 and low-precision model state."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from ddp_models import init, loss_fn, mesh_of
from jax.sharding import Mesh

import spmdcomm as sc
from spmdcomm.errors import DeletedArrayError, check_not_deleted

# These cases build two disjoint 4-device meshes or average 8 device values (the default 8 fake devices).
NEEDS_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def square_loss(params, batch, *, apply_fn, model_state, rng, mask):
    return sc.masked_mean((batch @ params["w"] - 1.0) ** 2, mask)


def metric_fn(params, batch, *, apply_fn, model_state, mask):
    return {"loss": sc.masked_mean((batch @ params["w"] - 1.0) ** 2, mask)}


def small_state(mesh):
    return sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.25), mesh=mesh)


X = np.ones((8, 2), np.float32)

# --------------------------------------------------------------------------------------------------
# A state consumed by a donating step


def test_check_not_deleted_names_the_leaf_and_skips_tracers_and_host_values():
    tree = {"a": jnp.ones(3), "b": [np.ones(2), 3.0, jnp.zeros(2)]}
    check_not_deleted("f", tree, arg="tree", fix="keep it.")
    jax.jit(lambda t: check_not_deleted("f", t, arg="tree", fix="keep it.") or t)(tree)  # tracers: skipped
    tree["b"][2].delete()
    with pytest.raises(DeletedArrayError) as err:
        check_not_deleted("f", tree, arg="tree", fix="keep it.")
    msg = str(err.value)
    assert msg.startswith("spmdcomm.f: leaf tree['b'][2]: `tree` holds 1 deleted array(s) out of 4 leaves")
    assert msg.endswith("Fix: keep it.")
    # Code catching JAX's own "Array has been deleted" RuntimeError, or ValueError, still catches it.
    assert isinstance(err.value, sc.SpmdError) and isinstance(err.value, RuntimeError)


def test_reusing_a_consumed_state_raises_instead_of_crashing():
    mesh = mesh_of(8)
    step = sc.make_train_step(square_loss)
    old = small_state(mesh)
    new, _ = step(old, X)
    # Without the check, XLA:CPU is handed deleted buffers and the process dies with a segfault.
    leaves = len(jax.tree.leaves(old))
    with pytest.raises(DeletedArrayError, match=rf"leaf state\.step: `state` holds {leaves} deleted array") as err:
        step(old, X)
    assert "make_train_step(..., donate=False)" in str(err.value)
    assert "copy the state first" in str(err.value)
    new, metrics = step(new, X)  # the step and the new state are unharmed
    assert int(new.step) == 2 and float(metrics["loss"]) == pytest.approx(0.0)


def test_donate_false_keeps_the_old_state_usable():
    mesh = mesh_of(4)
    step = sc.make_train_step(square_loss, donate=False)
    old = small_state(mesh)
    a, _ = step(old, X)
    b, _ = step(old, X)
    np.testing.assert_array_equal(np.asarray(a.params["w"]), np.asarray(b.params["w"]))


def test_eval_step_rejects_a_consumed_state():
    mesh = mesh_of(4)
    old = small_state(mesh)
    sc.make_train_step(square_loss)(old, X)
    with pytest.raises(DeletedArrayError, match=r"spmdcomm\.make_eval_step: leaf state\.step") as err:
        sc.make_eval_step(metric_fn)(old, X)
    assert "donate=False" in str(err.value)


def test_save_checkpoint_rejects_a_consumed_state(tmp_path):
    mesh = mesh_of(2)
    old = small_state(mesh)
    sc.make_train_step(square_loss)(old, X)
    with pytest.raises(DeletedArrayError, match=r"spmdcomm\.save_checkpoint: leaf state\.step") as err:
        sc.save_checkpoint(tmp_path, old)
    assert "save the state the step returned" in str(err.value)
    assert sc.latest_checkpoint_step(tmp_path) is None


# --------------------------------------------------------------------------------------------------
# A state placed on another mesh


@pytest.mark.parametrize("kind", ["train", "eval"])
@NEEDS_8
def test_state_moved_to_another_mesh_names_both_meshes(kind):
    devices = jax.devices()
    state = small_state(sc.data_mesh(devices=devices[:4]))
    moved = jax.device_put(state, jax.NamedSharding(sc.data_mesh(devices=devices[4:]), sc.P()))
    step = sc.make_train_step(square_loss) if kind == "train" else sc.make_eval_step(metric_fn)
    fn = "make_train_step" if kind == "train" else "make_eval_step"
    with pytest.raises(sc.SpmdError) as err:
        step(moved, X)
    msg = str(err.value)
    assert msg.startswith(
        f"spmdcomm.{fn}: leaf state.step: the state lives on mesh {{'data': 4}} over devices "
        "[4, 5, 6, 7], but it was created for (and the step runs on) mesh {'data': 4} over devices [0, 1, 2, 3]."
    )
    assert "TrainState.create(..., mesh=...)" in msg and "restore it into a state created on the new mesh" in msg
    assert not moved.step.is_deleted()  # nothing was donated


@NEEDS_8
def test_state_with_one_leaf_on_another_mesh_is_named():
    mesh = mesh_of(4)
    state = small_state(mesh)
    other = jax.device_put(np.ones(2, np.float32), jax.NamedSharding(sc.data_mesh(devices=jax.devices()[4:]), sc.P()))
    state = state.replace(params={"w": other})
    with pytest.raises(sc.SpmdError, match=r"leaf state\.params\['w'\]: the state lives on mesh"):
        sc.make_train_step(square_loss)(state, X)


def test_same_devices_under_another_mesh_object_still_run():
    # JAX accepts a replicated state on the same devices in the same order whatever the axis is called.
    devices = jax.devices()[:4]
    state = sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.25), mesh=mesh_of(4))
    state = jax.device_put(state, jax.NamedSharding(Mesh(np.array(devices), ("batch",)), sc.P()))
    step = sc.make_train_step(square_loss)
    for _ in range(2):
        state, metrics = step(state, X)
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


# --------------------------------------------------------------------------------------------------
# NaN/Inf in masked-out rows


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_masked_mean_ignores_masked_out_values_and_their_gradient(bad):
    values = np.array([[1.0, 2.0], [bad, bad], [4.0, 8.0]], np.float32)
    mask = np.array([True, False, True])
    assert float(sc.masked_mean(values, mask)) == pytest.approx(np.mean(values[mask]))
    grad = np.asarray(jax.grad(lambda v: sc.masked_mean(v, mask))(jnp.asarray(values)))
    np.testing.assert_array_equal(grad, [[0.25, 0.25], [0.0, 0.0], [0.25, 0.25]])
    assert float(sc.masked_mean(values, np.zeros(3, bool))) == 0.0


def test_nan_in_masked_out_rows_changes_nothing_in_the_step():
    """Params, optimizer state, metrics and BatchNorm statistics are bit-identical whether the masked-out rows
    hold zeros (pad_batch) or NaN/Inf, through the model, the gradient and the batch statistics."""
    apply_fn, params, model_state = init("cnn", axis_name="data")
    mesh = mesh_of(4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((14, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 4, 14).astype(np.int32)
    clean = sc.pad_batch({"x": x, "y": y}, 8)  # 16 rows, two masked out
    dirty_x = np.asarray(clean.data["x"]).copy()
    dirty_x[14], dirty_x[15] = np.nan, np.inf
    dirty = sc.MaskedBatch({"x": dirty_x, "y": np.asarray(clean.data["y"])}, clean.mask)

    def run(batch):
        state = sc.TrainState.create(
            params=params, model_state=model_state, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh
        )
        state, metrics = sc.make_train_step(loss_fn, accum_steps=2)(state, batch)
        evaluated = sc.make_eval_step(eval_fn)(state, batch)
        return jax.device_get((state.params, state.opt_state, state.model_state, metrics, evaluated))

    def eval_fn(params, batch, *, apply_fn, model_state, mask):
        logits = apply_fn({"params": params, **model_state}, batch["x"], train=False)
        return {"loss": sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)}

    want, got = run(clean), run(dirty)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------------------------------
# Dtypes of model state and metrics


@NEEDS_8
def test_low_precision_model_state_is_averaged_in_float32_and_cast_back():
    # bfloat16 keeps 8 significant bits: summing 256 + 1 + ... in bfloat16 would lose every 1.
    values = np.array([256, 1, 1, 1, 1, 1, 1, 1], np.float32)
    mesh = mesh_of(8)

    def stat_loss(params, batch, *, apply_fn, model_state, rng, mask):
        new = jax.tree.map(lambda s: sc.masked_mean(batch, mask).astype(s.dtype), model_state)
        return sc.masked_mean((batch * params["w"]) ** 2, mask), {"model_state": new}

    model_state = {"bf16": np.zeros((), ml_dtypes.bfloat16), "f16": np.zeros((), np.float16)}
    state = sc.TrainState.create(params={"w": np.float32(0.0)}, model_state=model_state, tx=optax.sgd(0.1), mesh=mesh)
    step = sc.make_train_step(stat_loss, donate=False)
    for batch in (values, sc.pad_batch(values[:7], 8)):
        out, _ = step(state, batch)
        real = np.asarray(batch.data)[np.asarray(batch.mask)] if isinstance(batch, sc.MaskedBatch) else batch
        mean = real.astype(np.float64).mean()
        assert out.model_state["bf16"].dtype == jnp.bfloat16 and out.model_state["f16"].dtype == jnp.float16
        assert float(out.model_state["bf16"]) == float(ml_dtypes.bfloat16(mean))
        assert float(out.model_state["f16"]) == float(np.float16(mean))


X64_SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np, optax
    import spmdcomm as sc

    def loss(params, batch, *, apply_fn, model_state, rng, mask):
        mean = sc.masked_mean(batch, mask)
        new = {"mean": mean, "f32": mean.astype(np.float32)}
        return sc.masked_mean((batch * params["w"]) ** 2, mask), {"model_state": new, "third": mean}

    def metric(params, batch, *, apply_fn, model_state, mask):
        return {"third": sc.masked_mean(batch, mask), "f32": sc.masked_mean(batch, mask).astype(np.float32)}

    out = {}
    v = np.array([0.0, 0.0, 1.0])
    for name, n, batch in [("plain", 3, v), ("masked", 4, sc.pad_batch(v, 4))]:
        mesh = sc.data_mesh(devices=jax.devices()[:n])
        state = sc.TrainState.create(params={"w": np.float64(1.0) / 3}, tx=optax.sgd(0.1), mesh=mesh,
                                     model_state={"mean": np.float64(0.0), "f32": np.float32(0.0)})
        state, m = sc.make_train_step(loss)(state, batch)
        e = sc.make_eval_step(metric)(state, batch)
        out[name] = {
            "state": [repr(state.model_state["mean"].item()), str(state.model_state["mean"].dtype),
                      str(state.model_state["f32"].dtype)],
            "w": [repr(state.params["w"].item()), str(state.params["w"].dtype)],
            "metrics": {k: [repr(x.item()), str(x.dtype)] for k, x in m.items()},
            "eval": {k: [repr(x.item()), str(x.dtype)] for k, x in e.items()},
        }
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_float64_stays_float64_under_x64():
    # x64 is process-global: a child process keeps it away from every other test.
    run = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    third = repr(1.0 / 3.0)
    w = 1.0 / 3.0 - 0.1 * 2.0 * (1.0 / 3.0) * np.mean([0.0, 0.0, 1.0])  # w - lr * d/dw mean((v w)^2)
    for name in ("plain", "masked"):
        got = out[name]
        assert got["state"] == [third, "float64", "float32"], name
        assert got["w"][1] == "float64" and float(got["w"][0]) == pytest.approx(w, rel=1e-15, abs=0), name
        assert got["metrics"]["third"] == [third, "float64"], name
        assert got["metrics"]["loss"][1] == "float64", name
        assert got["eval"]["third"] == [third, "float64"], name
        assert got["eval"]["f32"] == [repr(float(np.float32(1.0) / np.float32(3.0))), "float32"], name
        assert float(got["metrics"]["examples"][0]) == 3.0, name
