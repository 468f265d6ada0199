"""Dynamic loss scaling in the train step, against a hand-written Flax ``DynamicScale`` program on the same data;
the step's metrics (hyperparameters, refused aux names) and the step number handed to ``loss_fn``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale

import spmdcomm as sc
from tests.ddp_models import assert_trees_close, mesh_of


def half_loss(params, batch, *, apply_fn, model_state, rng, mask):
    """A float16 two-layer model whose backward pass overflows at large loss scales."""
    h = jnp.tanh(batch["x"].astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
    return sc.masked_mean((pred - batch["y"]) ** 2, mask)


def init_params():
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(6, 16)).astype(np.float32), "w2": rng.normal(size=(16, 1)).astype(np.float32)}


def batches(steps, size=16):
    rng = np.random.default_rng(1)
    return [
        {
            "x": 0.05 * rng.normal(size=(size, 6)).astype(np.float32),
            "y": 40 * rng.normal(size=(size, 1)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def one_device(tx, scale, data):
    """The program a user writes for one device: Flax's ``DynamicScale.value_and_grad`` on the whole batch (its real
    rows), then ``where(is_fin)`` on the update. Returns the parameters and ``(scale used, skipped)`` per step."""

    @jax.jit
    def step(params, opt_state, ds, batch):
        loss = functools.partial(half_loss, apply_fn=None, model_state=None, rng=None)
        mask = jnp.ones(batch["x"].shape[0], bool)
        ds, is_fin, _, grads = ds.value_and_grad(lambda p: loss(p, batch, mask=mask))(params)
        updates, new_opt = tx.update(grads, opt_state, params)
        keep = lambda new, old: jax.tree.map(functools.partial(jnp.where, is_fin), new, old)
        return keep(optax.apply_updates(params, updates), params), keep(new_opt, opt_state), ds, is_fin

    params = init_params()
    opt_state, trace = tx.init(params), []
    for batch in data:
        used = float(scale.scale)
        params, opt_state, scale, is_fin = step(params, opt_state, scale, batch)
        trace.append((used, not bool(is_fin)))
    return params, trace


TXS = {
    "sgd": optax.sgd(1e-3),
    "adam": optax.adam(1e-2),
    "clip": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2)),
}


SLOW = pytest.mark.slow


# The fast tier keeps a case with accumulation over a whole batch (ZeRO-2, global-norm clipping), one accumulating a
# padded batch (FSDP) and one padded without accumulation (DDP on 8 devices).
@pytest.mark.parametrize(
    "n, strategy, tx, batch, accum",
    [
        pytest.param(1, "ddp", "sgd", "whole", 1, marks=SLOW),
        pytest.param(2, "zero1", "adam", "padded", 1, marks=SLOW),
        # sc.pad_batch of rows that are all real: masked, nothing padded
        pytest.param(4, "ddp", "adam", "all real", 1, marks=SLOW),
        (4, "zero2", "clip", "whole", 2),
        (4, "fsdp", "sgd", "padded", 2),
        pytest.param(8, "fsdp", "adam", "whole", 1, marks=SLOW),
        (8, "ddp", "clip", "padded", 1),
    ],
)
def test_dynamic_loss_scale_equals_one_device(n, strategy, tx, batch, accum):
    """Skipped steps, the scale at every step and the parameters are one device's on the global batch, masked or
    not, at any device count, strategy and accumulation: every device's backward pass sees the values one
    device's would (each loss weighed by its share of the global batch before the scale)."""
    tx = TXS[tx]
    rows = 13 if batch == "padded" else 16
    data = batches(12, size=rows)
    scale = DynamicScale(scale=2.0**13, growth_interval=2)
    expected, expected_trace = one_device(tx, scale, data)
    # The recipe must exercise every branch: overflowing steps skipped and shrinking, finite ones growing.
    assert any(skip for _, skip in expected_trace) and not all(skip for _, skip in expected_trace)
    assert any(b > a for (a, _), (b, _) in zip(expected_trace, expected_trace[1:]))

    state = sc.TrainState.create(params=init_params(), tx=tx, mesh=mesh_of(n), strategy=strategy, loss_scale=scale)
    step, trace = sc.make_train_step(half_loss, accum_steps=accum), []
    for b in data:
        state, metrics = step(state, b if batch == "whole" else sc.pad_batch(b, 16))
        trace.append((float(metrics["loss_scale"]), bool(metrics["skipped"])))
    assert trace == expected_trace
    assert_trees_close(jax.device_get(state.full_params()), jax.device_get(expected), rtol=2e-3, atol=1e-4)


def test_loss_scale_state_survives_checkpoints_and_matches_a_padded_batch(tmp_path):
    """A masked (padded) batch scales the same way, and the scale and its count are saved and restored."""
    mesh = mesh_of(4)
    data = [sc.pad_batch(b, 16) for b in batches(6, size=13)]
    state = sc.TrainState.create(
        params=init_params(), tx=optax.sgd(1e-3), mesh=mesh, loss_scale=DynamicScale(scale=2.0**16, growth_interval=1)
    )
    step = sc.make_train_step(half_loss, donate=False)
    for batch in data[:3]:
        state, _ = step(state, batch)
    sc.save_checkpoint(tmp_path, state)
    template = sc.TrainState.create(params=init_params(), tx=optax.sgd(1e-3), mesh=mesh, loss_scale="dynamic")
    restored = sc.restore_checkpoint(tmp_path, template)
    assert float(restored.loss_scale.scale) == float(state.loss_scale.scale) != 2.0**16
    assert int(restored.loss_scale.fin_steps) == int(state.loss_scale.fin_steps)
    assert restored.loss_scale.growth_interval == 2000  # static settings are the template's


@pytest.mark.parametrize(
    "loss_scale, message",
    [
        ("static", "is not a loss scale"),
        (1024.0, "is not a loss scale"),
        (DynamicScale(scale=0.0), "scale=0.0 must be a positive finite scalar"),
        (DynamicScale(backoff_factor=2.0), "backoff_factor=2.0 must be in (0, 1]"),
        ({"init_scale": 1024.0}, "sets ['init_scale'], which are not loss-scale settings"),
        ({"growth_factor": 0.5}, "growth_factor=0.5 must be >= 1"),
    ],
)
def test_bad_loss_scales_are_refused(loss_scale, message):
    with pytest.raises(sc.SpmdError, match=r"TrainState\.create") as e:
        sc.TrainState.create(params=init_params(), tx=optax.sgd(0.1), loss_scale=loss_scale)
    assert message in str(e.value)


def linear_loss(params, batch, *, apply_fn, model_state, rng, mask):
    return sc.masked_mean((batch["x"] @ params["w"] - batch["y"]) ** 2, mask)


def linear_data():
    rng = np.random.default_rng(2)
    return {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=8).astype(np.float32)}


@pytest.mark.parametrize("name", ["loss", "examples", "learning_rate", "skipped"])
def test_aux_names_the_step_reports_itself_are_refused(name):
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = sc.TrainState.create(params={"w": np.zeros(3, np.float32)}, tx=tx)

    def loss_fn(params, batch, **kw):
        loss = linear_loss(params, batch, **kw)
        return loss, {name: loss * 2}

    with pytest.raises(sc.SpmdError, match=rf"aux holds \['{name}'\].*rename") as e:
        sc.make_train_step(loss_fn, skip_nonfinite=True)(state, linear_data())
    assert "learning_rate" in str(e.value) and "examples" in str(e.value)


def test_injected_hyperparameters_are_metrics_as_the_step_used_them():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.5, warmup_steps=2, decay_steps=6)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.9)
    )
    state = sc.TrainState.create(params={"w": np.zeros(3, np.float32)}, tx=tx, strategy="zero1")
    step = sc.make_train_step(linear_loss)
    seen = []
    for _ in range(5):
        state, metrics = step(state, linear_data())
        seen.append((float(metrics["learning_rate"]), float(metrics["momentum"])))
    np.testing.assert_allclose([lr for lr, _ in seen], [float(schedule(i)) for i in range(5)], rtol=1e-6)
    np.testing.assert_allclose([m for _, m in seen], 0.9, rtol=1e-6)


def test_hyperparameters_of_several_injected_states_are_named_by_path():
    tx = optax.multi_transform(
        {"a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), "b": optax.inject_hyperparams(optax.sgd)(0.2)},
        {"w": "a", "v": "b"},
    )
    params = {"w": np.zeros(3, np.float32), "v": np.zeros(3, np.float32)}
    state = sc.TrainState.create(params=params, tx=tx)

    def loss_fn(params, batch, **kw):
        return linear_loss({"w": params["w"] + params["v"]}, batch, **kw)

    _, metrics = sc.make_train_step(loss_fn)(state, linear_data())
    rates = {k: round(float(v), 6) for k, v in metrics.items() if k.endswith("learning_rate")}
    assert sorted(rates.values()) == [0.1, 0.2] and len(rates) == 2
    assert all("inner_states" in k for k in rates), rates


def test_loss_fn_that_takes_step_gets_the_step_count():
    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask, step):
        # The loss is scaled by the step count: the gradient tells which step the function saw.
        return linear_loss(params, batch, apply_fn=apply_fn, model_state=model_state, rng=rng, mask=mask), {
            "seen_step": step.astype(jnp.float32)
        }

    state = sc.TrainState.create(params={"w": np.zeros(3, np.float32)}, tx=optax.sgd(0.1), mesh=mesh_of(2))
    step = sc.make_train_step(loss_fn, accum_steps=2)
    seen = []
    for _ in range(3):
        state, metrics = step(state, linear_data())
        seen.append(float(metrics["seen_step"]))
    assert seen == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("which", ["train", "eval"])
def test_model_collective_over_another_axis_names_both_axes(which):
    """Flax's BatchNorm(axis_name="batch") under a state on "data" fails inside JAX with a bare AssertionError."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Dense(4)(x)
            return nn.BatchNorm(use_running_average=not train, axis_name="batch")(x).sum(-1)

    model = Net()
    variables = model.init(jax.random.PRNGKey(0), np.zeros((2, 3), np.float32))
    state = sc.TrainState.create(
        params=variables["params"],
        tx=optax.sgd(0.1),
        apply_fn=model.apply,
        model_state={"batch_stats": variables["batch_stats"]},
        mesh=mesh_of(2),
    )

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        out, new = apply_fn({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
        return sc.masked_mean((out - batch["y"]) ** 2, mask), {"model_state": new}

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        out, _ = apply_fn({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
        return sc.masked_mean((out - batch["y"]) ** 2, mask)

    run = sc.make_train_step(loss_fn) if which == "train" else sc.make_eval_step(metric_fn)
    fn = "make_train_step" if which == "train" else "make_eval_step"
    with pytest.raises(sc.AxisError, match=rf"{fn}: .*collective over axis 'batch'.*data axes \('data',\)") as e:
        run(state, linear_data())
    assert "axis_name='data'" in str(e.value) and "axis='batch'" in str(e.value)


def test_loss_scale_settings_are_given_where_the_loss_scale_is():
    """``"dynamic"`` is Flax's ``DynamicScale()``; a dict sets any of its fields and keeps the others' defaults."""
    defaults = sc.TrainState.create(params=init_params(), tx=optax.sgd(0.1), loss_scale="dynamic").loss_scale
    assert (float(defaults.scale), defaults.growth_interval, defaults.growth_factor, defaults.backoff_factor) == (
        65536.0,
        2000,
        2.0,
        0.5,
    )
    given = {"scale": 256.0, "growth_interval": 1, "growth_factor": 4.0, "backoff_factor": 0.25, "minimum_scale": 64.0}
    state = sc.TrainState.create(params=init_params(), tx=optax.sgd(0.0), loss_scale=given)
    step, scales = sc.make_train_step(half_loss), []
    rng = np.random.default_rng(3)
    small = {"x": rng.normal(size=(8, 6)).astype(np.float32), "y": rng.normal(size=(8, 1)).astype(np.float32)}
    huge = {"x": small["x"], "y": np.full((8, 1), np.inf, np.float32)}
    for batch in [small, small, small, huge, huge, huge]:
        state, metrics = step(state, batch)
        scales.append(float(metrics["loss_scale"]))
    # Grows x4 when fin_steps reaches 1 (every second finite step), backs off x0.25, never below 64.
    assert scales == [256.0, 256.0, 1024.0, 1024.0, 256.0, 64.0]
    assert float(state.loss_scale.scale) == 64.0
