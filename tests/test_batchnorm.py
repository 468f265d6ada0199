"""SyncBatchNorm (Linen and NNX): padded or not, on 1 to 8 devices and on a 2-D data mesh, training equals one device
running Flax's own BatchNorm on the real rows alone; without an axis it equals Flax's BatchNorm; bad input raises.

The fast tier (``-m "not slow"``) trains three of the step cases: devices holding no real row, no padding, and
FSDP with uneven real rows."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ddp_models import assert_trees_close, jit_once, mesh_of, reference_train
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdcomm as sc

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

ROWS = 64  # the padded global batch
STEPS = 3


def row_mask(mask: Any, x: jax.Array) -> Any:
    """The step's row mask shaped to broadcast over an NHWC activation (None stays None)."""
    return None if mask is None else mask.reshape((-1,) + (1,) * (x.ndim - 1))


class LinenNet(nn.Module):
    """Conv -> BatchNorm (Flax's or SyncBatchNorm) -> relu -> mean pool -> Dense."""

    bn: Any = nn.BatchNorm
    axis_name: Any = None

    @nn.compact
    def __call__(self, x, mask=None, train: bool = True):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)
        x = self.bn(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x, mask=row_mask(mask, x))
        return nn.Dense(3)(nn.relu(x).mean(axis=(1, 2)))


class NnxNet(nnx.Module):
    def __init__(self, bn: Any, axis_name: Any, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
        self.bn = bn(4, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x, mask=None):
        x = self.conv(x)
        return self.head(nnx.relu(self.bn(x, mask=row_mask(mask, x))).mean(axis=(1, 2)))


def cross_entropy(logits, batch, mask=None):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return ce.mean() if mask is None else sc.masked_mean(ce, mask)


@functools.cache
def jitted_init(model: nn.Module) -> Any:
    """``model.init`` as one compiled program per model (eagerly, each initializer and layer operation compiles its
    own); both networks' inits compiled alike, so that they give the same values."""
    return jit_once(model.init)


def models(api: str, axis_name: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(apply, params, model_state)`` of the network with Flax's BatchNorm (no axis) and of the one with
    SyncBatchNorm over ``axis_name``, both from the same initialisation; ``apply(params, model_state, x, mask, *,
    train=True) -> (logits, new model_state)``."""
    if api == "linen":
        ref = LinenNet()
        variables = jitted_init(ref)(jax.random.PRNGKey(0), np.zeros((2, 6, 6, 1), np.float32))
        params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
        sync = LinenNet(bn=sc.SyncBatchNorm, axis_name=axis_name)
        sync_vars = jitted_init(sync)(jax.random.PRNGKey(0), np.zeros((2, 6, 6, 1), np.float32))

        def linen_apply(module):
            def apply(params, model_state, x, mask, *, train=True):
                variables = {"params": params, **model_state}
                return module.apply(variables, x, mask, train=train, mutable=["batch_stats"])

            return apply

        return (linen_apply(ref), params, model_state), (
            linen_apply(sync),
            sync_vars["params"],
            {"batch_stats": sync_vars["batch_stats"]},
        )

    def nnx_model(bn, axis):
        graphdef, params, rest = nnx.split(NnxNet(bn, axis, nnx.Rngs(0)), nnx.Param, ...)

        def apply(params, model_state, x, mask, *, train=True):
            model = nnx.merge(graphdef, params, model_state, copy=True)
            if not train:
                model.eval()
            return model(x, mask), nnx.split(model, nnx.Param, ...)[2]

        return apply, params, rest

    return nnx_model(nnx.BatchNorm, None), nnx_model(sc.nnx.SyncBatchNorm, axis_name)


def step_loss(apply, *, pass_mask: bool):
    """A ``loss_fn`` of the step's contract; the reference trains on the real rows alone and passes no mask."""

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        logits, new_model_state = apply(params, model_state, batch["x"], mask if pass_mask else None)
        return cross_entropy(logits, batch, mask), {"model_state": new_model_state}

    return loss_fn


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5, momentum=0.9), "adam": lambda: optax.adam(0.05)}


def real_batches(real: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((real, 6, 6, 1), dtype=np.float32) * 2.0 + 0.5,
            "y": rng.integers(0, 3, real).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def train_both(api, real, opt, *, mesh, axis="data", strategy="ddp"):
    """Trains the reference (one device, Flax's BatchNorm, the real rows only) and the synchronised model through
    make_train_step on the padded batches; returns both results."""
    (ref_apply, params, model_state), (sync_apply, sync_params, sync_state) = models(api, axis)
    assert_trees_close(sync_params, params, rtol=0, atol=0)  # same variables: checkpoints carry over
    assert_trees_close(sync_state, model_state, rtol=0, atol=0)
    data = real_batches(real)
    expected = reference(api, real, opt)
    state = sc.TrainState.create(
        params=sync_params,
        model_state=sync_state,
        tx=OPTIMIZERS[opt](),
        mesh=mesh,
        axis=axis,
        strategy=strategy,
    )
    fed = data if real == ROWS else [sc.pad_batch(b, ROWS) for b in data]
    step = sc.make_train_step(step_loss(sync_apply, pass_mask=True))
    state, history = sc.fit(step, state, fed)
    return state, history, expected


@functools.cache
def reference(api: str, real: int, opt: str) -> tuple[Any, Any, list[float]]:
    """What :func:`reference_train` gives for Flax's BatchNorm trained on ``real_batches(real)`` with ``opt``: one
    program per case, shared by every mesh and strategy that trains the same rows."""
    (ref_apply, params, model_state), _ = models(api, None)
    loss = step_loss(ref_apply, pass_mask=False)
    return reference_train(loss, None, params, model_state, OPTIMIZERS[opt](), real_batches(real))


def assert_equal_to_reference(state, history, expected):
    ref_params, ref_model_state, ref_losses = expected
    assert all(np.isfinite(h["loss"]) for h in history)
    assert_trees_close(state.full_params(), ref_params, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.model_state, ref_model_state, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    sc.assert_replicated(state)


def case(api, devices, real, opt, strategy="ddp", *, fast=False):
    return pytest.param(
        api,
        devices,
        real,
        opt,
        strategy,
        id=f"{api}-{devices}dev-{real}of{ROWS}-{opt}-{strategy}",
        marks=() if fast else pytest.mark.slow,
    )


@pytest.mark.parametrize(
    "api,devices,real,opt,strategy",
    [
        # Linen and NNX compute the statistics in one function (spmdcomm/train/batchnorm.py), and the strategy and the
        # optimizer are independent of it: each kind of batch (devices without real rows, a device with some, no
        # padding, one device) once, each strategy once, each API with devices holding no real row.
        case("linen", 8, 40, "sgd", fast=True),  # 3 devices hold no real row: Flax's pmean of masked means is NaN
        case("nnx", 8, 40, "adam"),
        case("linen", 4, 64, "adam", fast=True),  # no padding
        case("linen", 1, 60, "adam"),
        case("nnx", 8, 60, "sgd", "fsdp", fast=True),  # 7 devices with 8 real rows, one with 4
        case("linen", 8, 40, "adam", "zero1"),
    ],
)
def test_train_step_equals_one_device_on_the_real_rows(api, devices, real, opt, strategy):
    state, history, expected = train_both(api, real, opt, mesh=mesh_of(devices), strategy=strategy)
    assert [int(h["examples"]) for h in history] == [real] * STEPS
    assert_equal_to_reference(state, history, expected)


@pytest.mark.parametrize("api,real,strategy", [("linen", 40, "ddp"), ("nnx", 60, "fsdp")])
def test_hybrid_data_mesh_with_a_tuple_axis_name(api, real, strategy):
    axis = ("replica", "shard")
    mesh = sc.make_mesh({"replica": 2, "shard": 4})
    state, history, expected = train_both(api, real, "adam", mesh=mesh, axis=axis, strategy=strategy)
    assert_equal_to_reference(state, history, expected)


def test_nnx_adapters_and_create_nnx():
    # The usual NNX path: the model object in TrainState.create_nnx, sc.nnx_loss_fn and sc.nnx_metric_fn.
    (ref_apply, _, _), _ = models("nnx", None)
    data = real_batches(40)
    ref_params, ref_model_state, ref_losses = reference("nnx", 40, "adam")

    def loss(model, batch, *, rng, mask):
        return cross_entropy(model(batch["x"], mask), batch, mask)

    def metrics(model, batch, *, mask):
        return {"loss": cross_entropy(model(batch["x"], mask), batch, mask)}

    model = NnxNet(sc.nnx.SyncBatchNorm, "data", nnx.Rngs(0))
    state = sc.TrainState.create_nnx(model, tx=optax.adam(0.05), mesh=mesh_of(8))
    state, history = sc.fit(sc.make_train_step(sc.nnx_loss_fn(loss)), state, [sc.pad_batch(b, ROWS) for b in data])
    assert_equal_to_reference(state, history, (ref_params, ref_model_state, ref_losses))
    evaluated = sc.make_eval_step(sc.nnx_metric_fn(metrics))(state, sc.pad_batch(data[0], ROWS))
    want, _ = ref_apply(ref_params, ref_model_state, data[0]["x"], None, train=False)
    np.testing.assert_allclose(evaluated["loss"], cross_entropy(want, data[0]), rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# One device: Flax's BatchNorm on the same input and mask

# name: (input shape, input dtype, layer options, mask kind)
ONE_DEVICE = {
    "fast_unmasked": ((16, 3, 3, 5), jnp.float32, {}, None),
    "fast_rows": ((16, 3, 3, 5), jnp.float32, {}, "rows"),
    "two_pass_rows": ((16, 3, 3, 5), jnp.float32, {"use_fast_variance": False}, "rows"),
    "two_pass_entries": ((16, 3, 3, 5), jnp.float32, {"use_fast_variance": False}, "entries"),
    "fast_entries": ((16, 5), jnp.float32, {}, "entries"),
    "bf16_input": ((16, 3, 3, 5), jnp.bfloat16, {}, "rows"),
    "bf16_everything": ((16, 5), jnp.bfloat16, {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}, "rows"),
    "channels_first": ((16, 5, 3, 3), jnp.float32, {"axis": 1}, "rows"),
    "no_scale_no_bias": ((16, 5), jnp.float32, {"use_scale": False, "use_bias": False, "epsilon": 1e-3}, "rows"),
}


def one_device_input(shape, dtype, mask_kind, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape, dtype=np.float32) * 3.0 + 1.0).astype(dtype)
    if mask_kind is None:
        return x, None
    mask_shape = shape if mask_kind == "entries" else (shape[0],) + (1,) * (len(shape) - 1)
    mask = rng.random(mask_shape) < 0.6
    return x, mask


def assert_outputs_close(got, want):
    # Statistics are float32 and agree to float32 rounding (XLA orders the fused sums its own way); a bfloat16
    # output may then round to the neighbouring bfloat16 value.
    assert got.dtype == want.dtype
    tol = 1e-6 if got.dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(ONE_DEVICE))
def test_linen_without_axis_equals_flax(name):
    shape, dtype, options, mask_kind = ONE_DEVICE[name]
    x, mask = one_device_input(shape, dtype, mask_kind)
    ref, sync = nn.BatchNorm(momentum=0.8, **options), sc.SyncBatchNorm(momentum=0.8, **options)
    variables = ref.init(jax.random.PRNGKey(0), x, use_running_average=False)
    assert_trees_close(sync.init(jax.random.PRNGKey(0), x, use_running_average=False), variables, rtol=0, atol=0)
    variables = {**variables, "batch_stats": jax.tree.map(lambda v: v + 0.5, variables["batch_stats"])}
    for use_running_average in (False, True):
        want, want_state = ref.apply(variables, x, use_running_average, mask=mask, mutable=["batch_stats"])
        got, got_state = sync.apply(variables, x, use_running_average, mask=mask, mutable=["batch_stats"])
        assert_outputs_close(got, want)
        assert_trees_close(got_state, want_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(ONE_DEVICE))
def test_nnx_without_axis_equals_flax(name):
    shape, dtype, options, mask_kind = ONE_DEVICE[name]
    x, mask = one_device_input(shape, dtype, mask_kind)
    features = shape[options.get("axis", -1)]
    ref = nnx.BatchNorm(features, momentum=0.8, rngs=nnx.Rngs(0), **options)
    sync = sc.nnx.SyncBatchNorm(features, momentum=0.8, rngs=nnx.Rngs(0), **options)
    assert isinstance(sync, nnx.BatchNorm)
    assert_trees_close(nnx.state(sync), nnx.state(ref), rtol=0, atol=0)
    for use_running_average in (False, True):
        want, got = ref(x, use_running_average, mask=mask), sync(x, use_running_average, mask=mask)
        assert_outputs_close(got, want)
        assert_trees_close(nnx.state(sync), nnx.state(ref), rtol=1e-6, atol=1e-6)


def test_a_feature_without_real_entries_keeps_its_running_statistics():
    x, _ = one_device_input((12, 3), jnp.float32, None)
    mask = np.ones((12, 3), bool)
    mask[:, 1] = False  # feature 1 is never seen (Flax would store 0/0 = NaN)
    bn = sc.SyncBatchNorm(use_running_average=False, momentum=0.5)
    variables = bn.init(jax.random.PRNGKey(0), x)
    y, new = bn.apply(variables, x, mask=mask, mutable=["batch_stats"])
    want, want_new = nn.BatchNorm(use_running_average=False, momentum=0.5).apply(
        variables, x, mask=mask, mutable=["batch_stats"]
    )
    for stat, init in (("mean", 0.0), ("var", 1.0)):
        got, expected = np.asarray(new["batch_stats"][stat]), np.asarray(want_new["batch_stats"][stat])
        assert got[1] == init and np.isnan(expected[1])
        np.testing.assert_allclose(got[[0, 2]], expected[[0, 2]], rtol=1e-6)
    np.testing.assert_allclose(y[:, [0, 2]], want[:, [0, 2]], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y[:, 1], x[:, 1] / np.sqrt(1e-5), rtol=1e-6)  # mean 0 and variance 0


@pytest.mark.parametrize("devices, accum, masked", [(1, 2, False), (2, 2, False), (4, 4, False), (2, 2, True)])
def test_running_statistics_under_accumulation_update_once_per_micro_batch(devices, accum, masked):
    """Each device updates the running mean once per micro-batch, in order, and the step averages the devices' results
    (weighted by their real rows when masked); unmasked, the average once divided by accum_steps too often."""

    class Norm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False, momentum=0.5)(x))

    def loss(params, batch, *, apply_fn, model_state, rng, mask):
        out, new = apply_fn({"params": params, **model_state}, batch, mutable=["batch_stats"])
        return sc.masked_mean(out[:, 0] ** 2, mask), {"model_state": new}

    x = np.random.default_rng(3).normal(size=(32, 3)).astype(np.float32)
    variables = Norm().init(jax.random.PRNGKey(0), x)
    state = sc.TrainState.create(
        params=variables["params"],
        apply_fn=Norm().apply,
        model_state={"batch_stats": variables["batch_stats"]},
        tx=optax.sgd(0.0),
        mesh=mesh_of(devices),
    )
    step = sc.make_train_step(loss, accum_steps=accum)
    state, _ = step(state, sc.MaskedBatch(x, np.ones(32, bool)) if masked else x)
    means = []
    for block in np.split(x, devices):  # one device's rows, then its micro-batches in order
        mean = np.zeros(3, np.float32)
        for micro in np.split(block, accum):
            mean = 0.5 * mean + 0.5 * micro.mean(0)
        means.append(mean)
    np.testing.assert_allclose(state.model_state["batch_stats"]["BatchNorm_0"]["mean"], np.mean(means, 0), rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Plain jax.shard_map, evaluation, variable names, errors


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_plain_shard_map_statistics_and_gradient_equal_one_device(api):
    mesh, real = mesh_of(8), 60  # one device holds 4 real rows, the others 8
    (ref_apply, params, model_state), (sync_apply, _, _) = models(api, "data")
    data = real_batches(real)[0]
    padded = sc.pad_batch(data, ROWS)
    blocks = (P(), P(), P("data"), P("data"))

    def forward(params, model_state, x, mask):
        return sync_apply(params, model_state, x, mask)

    def global_loss(params, model_state, batch, mask):
        # The exact mean over every device's real rows: its derivative is the one-device gradient.
        logits, _ = sync_apply(params, model_state, batch["x"], mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        total = jax.lax.psum(jnp.sum(jnp.where(mask, ce, 0.0)), "data")
        return total / jax.lax.psum(jnp.sum(mask), "data")

    # Forward: NaN in the padded rows reaches neither the real rows' outputs nor the running statistics.
    x = padded.data["x"].copy()
    x[~padded.mask] = np.nan
    logits, new_state = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=blocks, out_specs=(P("data"), P())))(
        params, model_state, x, padded.mask
    )
    # The references run as compiled programs (eagerly, each operation would compile its own).
    want_logits, want_state = jax.jit(ref_apply)(params, model_state, data["x"], None)
    np.testing.assert_allclose(np.asarray(logits)[:real], want_logits, rtol=1e-5, atol=1e-6)
    assert_trees_close(new_state, want_state, rtol=1e-5, atol=1e-6)

    # Gradient with respect to replicated parameters, taken outside shard_map.
    loss = jax.shard_map(global_loss, mesh=mesh, in_specs=blocks, out_specs=P())
    grads = jax.jit(jax.grad(loss))(params, model_state, padded.data, padded.mask)
    want_grads = jax.jit(jax.grad(lambda p: cross_entropy(ref_apply(p, model_state, data["x"], None)[0], data)))(params)
    assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_eval_step_uses_the_running_statistics_as_flax(api):
    (ref_apply, params, model_state), (sync_apply, _, _) = models(api, "data")
    model_state = jax.tree.map(lambda v: v * 1.5 + 0.25, model_state)  # statistics no batch has
    data = real_batches(60, seed=3)[0]

    def metric(apply):
        def metric_fn(params, batch, *, apply_fn, model_state, mask):
            logits, _ = apply(params, model_state, batch["x"], mask, train=False)
            return {"loss": cross_entropy(logits, batch, mask), "logit": sc.masked_mean(logits.sum(-1), mask)}

        return metric_fn

    state = sc.TrainState.create(params=params, model_state=model_state, tx=optax.sgd(0.1), mesh=mesh_of(4))
    got = sc.make_eval_step(metric(sync_apply))(state, sc.pad_batch(data, ROWS))
    want_logits, _ = ref_apply(params, model_state, data["x"], None, train=False)
    np.testing.assert_allclose(got["loss"], cross_entropy(want_logits, data), rtol=1e-6)
    np.testing.assert_allclose(got["logit"], want_logits.sum(-1).mean(), rtol=1e-5)


class TwoNorms(nn.Module):
    bn: Any = nn.BatchNorm

    @nn.compact
    def __call__(self, x):
        x = self.bn(use_running_average=False)(nn.Dense(3)(x))
        return self.bn(use_running_average=False, use_bias=False)(nn.Dense(2)(x))


def test_linen_variables_are_named_as_flax_batchnorm():
    x = np.ones((4, 5), np.float32)
    want = TwoNorms().init(jax.random.PRNGKey(1), x)
    got = TwoNorms(bn=sc.SyncBatchNorm).init(jax.random.PRNGKey(1), x)
    assert set(got["params"]) == {"Dense_0", "Dense_1", "BatchNorm_0", "BatchNorm_1"}
    assert_trees_close(got, want, rtol=0, atol=0)
    assert issubclass(sc.SyncBatchNorm, nn.BatchNorm) and sc.SyncBatchNorm.__qualname__ == "SyncBatchNorm"


def linen_train(x, mask=None, **options):
    bn = sc.SyncBatchNorm(use_running_average=False, **options)
    variables = bn.init(jax.random.PRNGKey(0), x)
    return bn.apply(variables, x, mask=mask, mutable=["batch_stats"])


def nnx_train(x, mask=None, *, features=4, **options):
    return sc.nnx.SyncBatchNorm(features, rngs=nnx.Rngs(0), **options)(x, mask=mask)


X = np.ones((8, 4), np.float32)

# name: (call, error type, facts the message must state)
ERRORS = {
    "lower_rank_mask": (
        lambda: linen_train(X, np.ones(8, bool)),
        sc.ShapeError,
        ["spmdcomm.SyncBatchNorm", "(8,)", "(8, 4)", "rank (2)", "mask.reshape((-1,) + (1,) * 1)"],
    ),
    "mask_dimension": (
        lambda: nnx_train(X, np.ones((4, 1), bool)),
        sc.ShapeError,
        ["spmdcomm.nnx.SyncBatchNorm", "(4, 1)", "(8, 4)"],
    ),
    "unbound_axis": (
        lambda: nnx_train(X, axis_name="data"),
        sc.AxisError,
        [
            "spmdcomm.nnx.SyncBatchNorm",
            "axis_name='data' is not a bound axis",
            "not inside spmd",
            "sc.make_train_step",
            "state's data axis (state.axis",
            "axis_name=None",
        ],
    ),
    "axis_index_groups": (
        lambda: linen_train(X, axis_index_groups=[[0, 1], [2, 3]]),
        sc.SpmdError,
        ["spmdcomm.SyncBatchNorm", "axis_index_groups=((0, 1), (2, 3))", "2-D mesh"],
    ),
    "num_features": (
        lambda: nnx_train(X, features=3),
        sc.ShapeError,
        ["spmdcomm.nnx.SyncBatchNorm", "(8, 4)", "4 features on axis -1", "num_features=3"],
    ),
    "no_mode": (
        lambda: nnx_train(X, use_running_average=None),
        sc.SpmdError,
        ["spmdcomm.nnx.SyncBatchNorm", "use_running_average is None", "model.train()"],
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_layer_the_sizes_and_the_fix(name):
    call, error, facts = ERRORS[name]
    with pytest.raises(error) as info:
        call()
    for fact in facts:
        assert fact in str(info.value), (fact, str(info.value))


def test_unknown_axis_in_a_tuple_inside_shard_map():
    # Under jit the layer raises while tracing, as eagerly, without compiling each of its operations first.
    f = jax.jit(
        jax.shard_map(
            lambda x: linen_train(x, axis_name=("data", "model"))[0],
            mesh=mesh_of(2),
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    with pytest.raises(sc.AxisError) as info:
        f(np.ones((4, 3), np.float32))
    message = str(info.value)
    assert "spmdcomm.SyncBatchNorm: axis_name=('data', 'model') names axis 'model', which is not bound" in message
    assert "the axes bound here are ('data',)" in message and "SyncBatchNorm(..., axis_name='data')" in message


@pytest.mark.parametrize(
    "api, mesh_axes, axis, axis_name, fix",
    [
        ("linen", {"data": 4}, "data", "batch", "SyncBatchNorm(..., axis_name='data')"),
        ("nnx", {"data": 4}, "data", "batch", "nnx.SyncBatchNorm(..., axis_name='data')"),
        # several data axes: the layer's axis_name is the state's tuple
        ("linen", {"replica": 2, "shard": 2}, ("replica", "shard"), "data", "axis_name=('replica', 'shard')"),
    ],
)
def test_an_axis_name_the_train_step_does_not_bind_names_the_state_data_axis(api, mesh_axes, axis, axis_name, fix):
    # As the step reports Flax's BatchNorm over another axis: the layer's axis, the step's axes, and the fix.
    _, (sync_apply, params, model_state) = models(api, axis_name)
    mesh = sc.make_mesh(mesh_axes, devices=jax.devices()[:4])
    state = sc.TrainState.create(params=params, model_state=model_state, tx=optax.sgd(0.1), mesh=mesh, axis=axis)
    step = sc.make_train_step(step_loss(sync_apply, pass_mask=True))
    with pytest.raises(sc.AxisError) as info:
        step(state, real_batches(8)[0])
    message = str(info.value)
    bound = axis if isinstance(axis, tuple) else (axis,)
    assert f"axis_name={axis_name!r} is not a bound axis: the axes bound here are {bound}" in message
    assert "sc.make_train_step" in message and "the state's data axis (state.axis)" in message and fix in message
