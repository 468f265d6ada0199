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
from spmdcomm.parallel.pipeline import gpipe
from spmdcomm.parallel.pipeline.layer_order import stage_order
from spmdcomm.parallel.pipeline.schedule import run_stack, schedule_context
from tests.ddp_models import assert_trees_close, mesh_of, write_initial

LAYERS, WIDTH = 8, 16


# --- the schedule against a scan -----------------------------------------------------------------------------


def residual(w, state, h, index, row):
    return h + jnp.tanh(h @ w), state


def scanned(weights, x, layer=residual):
    return run_stack(layer, weights, x, remat=False)[0]


@functools.cache
def scan_reference(layer=residual):
    """:func:`scanned` and its gradient as compiled programs (eagerly, every op of each new shape compiles its own)."""
    return jax.jit(functools.partial(scanned, layer=layer)), jax.jit(
        jax.grad(lambda w, x: jnp.sum(scanned(w, x, layer) ** 2))
    )


@functools.cache
def core_program(d, p, m, v, layer=residual):
    """The pipelined stack of ``layer`` on a ``data`` d x ``stage`` p mesh, and its gradient (compiled once per
    layout)."""
    mesh = jax.make_mesh(
        (d, p), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[: d * p]
    )
    schedule = sc.Pipeline(microbatches=m, repeats=v)

    def local(weights, x):
        with schedule_context(schedule):
            return run_stack(layer, weights, x)[0]

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P("stage"), P(("data", "stage"))), out_specs=P(("data", "stage"))
    )
    return jax.jit(mapped), jax.jit(jax.grad(lambda w, x: jnp.sum(mapped(w, x) ** 2)))


# A covering set: p = 2, 4, 8; m = p and m > p; v = 1 and 2; one data device and several (m = p = 2 on one data
# device adds nothing to (2, 4, 4, 1)'s m = p and (4, 2, 6, 1)'s p = 2).
CORE_CASES = [(2, 4, 4, 1), (4, 2, 6, 1), (2, 2, 4, 2), (1, 4, 8, 2), (1, 8, 8, 1)]


@pytest.mark.parametrize("d, p, m, v", CORE_CASES)
def test_the_schedule_equals_a_scan_forward_and_backward(d, p, m, v):
    rng = np.random.default_rng(0)
    weights = (rng.normal(size=(LAYERS, 6, 6)) / np.sqrt(6)).astype(np.float32)
    x = rng.normal(size=(d * m * 2, 6)).astype(np.float32)  # 2 rows per micro-batch
    order = stage_order(LAYERS, p, v)
    forward, grad = core_program(d, p, m, v)
    scan, scan_grad = scan_reference()
    np.testing.assert_allclose(forward(weights[order], x), scan(weights, x), rtol=1e-5, atol=1e-5)
    expected = scan_grad(weights, x)
    np.testing.assert_allclose(np.asarray(grad(weights[order], x))[np.argsort(order)], expected, rtol=1e-4, atol=1e-4)


def test_nan_in_every_bubble_slot_changes_nothing(monkeypatch):
    """The loop's buffers start as NaN instead of zeros: bubble ticks compute on a real stand-in and are never
    written, so the output and the gradient are bitwise those of the zero-filled run (praxis's NaN testing mode;
    tests/test_pipeline_bubbles.py: blocks that are not finite at zero)."""
    rng = np.random.default_rng(1)
    weights = (rng.normal(size=(LAYERS, 6, 6)) / np.sqrt(6)).astype(np.float32)
    x = rng.normal(size=(2 * 4 * 2, 6)).astype(np.float32)
    order = stage_order(LAYERS, 2, 2)
    results = []
    # Zeros: the core test's cached programs; NaN: traced anew and not cached, so no other test gets them.
    for fill, programs in [(0.0, core_program), (np.nan, core_program.__wrapped__)]:
        monkeypatch.setattr(gpipe, "_FILL", fill)
        forward, grad = programs(2, 2, 4, 2)
        results.append((np.asarray(forward(weights[order], x)), np.asarray(grad(weights[order], x))))
    zero, nan = results
    assert np.isfinite(nan[0]).all() and np.isfinite(nan[1]).all()
    np.testing.assert_array_equal(nan[0], zero[0])
    np.testing.assert_array_equal(nan[1], zero[1])


def counted(w, state, h, index, row):
    """A residual layer whose state counts its calls and keeps a running mean of its input (as BatchNorm's)."""
    mean = 0.5 * state["mean"] + 0.5 * jnp.mean(h, axis=0)
    return h + jnp.tanh(h @ w), {"calls": state["calls"] + 1, "mean": mean}


@pytest.mark.parametrize("p, m, v, fill", [(2, 4, 2, 0.0), (4, 4, 1, np.nan), (2, 2, 1, np.nan)])
def test_layer_state_updates_once_per_micro_batch_in_order_and_never_in_a_bubble(monkeypatch, p, m, v, fill):
    """Each layer's state moves on once per micro-batch, in micro-batch order, as a scan over the micro-batches in
    turn gives (one device with accum_steps=m); bubble ticks (their buffers NaN here) never update it, and every
    stage device ends with the whole state in canonical layer order."""
    monkeypatch.setattr(gpipe, "_FILL", fill)
    rng = np.random.default_rng(4)
    weights = (rng.normal(size=(LAYERS, 6, 6)) / np.sqrt(6)).astype(np.float32)
    x = rng.normal(size=(m * 2, 6)).astype(np.float32)
    state = {"calls": np.zeros(LAYERS, np.int32), "mean": np.zeros((LAYERS, 6), np.float32)}
    expected = state
    for micro in np.split(x, m):
        _, expected = run_stack(counted, weights, micro, state=expected, remat=False)
    mesh = jax.make_mesh((p,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:p])

    def local(weights, state, x):
        with schedule_context(sc.Pipeline(microbatches=m, repeats=v)):
            out, new = run_stack(counted, weights, state=state, x=x)
        return out, jax.tree.map(lambda a: a[None], new)  # each stage device's copy

    order = stage_order(LAYERS, p, v)
    specs = (P("stage"), P(), P("stage"))
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P("stage"), P("stage"))))
    out, got = run(weights[order], state, x)
    np.testing.assert_allclose(out, scan_reference()[0](weights, x), rtol=1e-5, atol=1e-5)
    assert np.asarray(got["calls"]).tolist() == [[m] * LAYERS] * p
    for copy in np.asarray(got["mean"]):
        np.testing.assert_allclose(copy, expected["mean"], rtol=1e-5, atol=1e-6)


def test_a_stack_state_without_a_row_per_layer_is_refused():
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])

    def local(weights, state, x):
        with schedule_context(sc.Pipeline(microbatches=2)):
            return run_stack(counted, weights, x, state=state)[0]

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("stage"), P(), P("stage")), out_specs=P("stage")))
    state = {"calls": np.zeros(LAYERS - 1, np.int32), "mean": np.zeros((LAYERS - 1, 6), np.float32)}
    with pytest.raises(sc.ShapeError, match=r"7 layers on dimension 0, the parameters 8.*one row per layer"):
        run(np.zeros((LAYERS, 6, 6), np.float32), state, np.zeros((4, 6), np.float32))


# --- the train step against one device -----------------------------------------------------------------------


def rms(x):
    """RMS normalisation with no epsilon: finite on any non-zero row, NaN (value and derivative) at zero."""
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))


class Block(nn.Module):
    """A pre-LayerNorm residual MLP block; ``model``: its kernels split Megatron-style over ``"model"``; ``rms``:
    :func:`rms` in place of the LayerNorm."""

    model: bool = False
    dropout: float = 0.0
    rms: bool = False

    @nn.compact
    def __call__(self, x):
        columns = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")) if self.model else None
        rows = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)) if self.model else None
        h = rms(x) if self.rms else nn.LayerNorm()(x)
        h = nn.Dense(2 * WIDTH, **({"kernel_init": columns} if columns else {}))(h)
        h = nn.Dropout(self.dropout, deterministic=self.dropout == 0.0)(nn.gelu(h))
        return x + nn.Dense(WIDTH, **({"kernel_init": rows} if rows else {}))(h)


class Net(nn.Module):
    model: bool = False
    dropout: float = 0.0
    rms: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        h = sc.PipelineStack(Block(self.model, self.dropout, self.rms), layers=LAYERS)(h)
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
    step = train_step(rng, accum)
    losses = []
    for batch in data:
        state, metrics = step(state, batch if pad_to is None else sc.pad_batch(batch, pad_to))
        losses.append(float(metrics["loss"]))
    return state, losses


@functools.cache
def train_step(rng, accum):
    """One step object per setting for every test in the process: it compiles once per state layout, so runs on a
    layout another test (or the same one) already trained reuse that program."""
    return sc.make_train_step(loss_fn, rng=rng, accum_steps=accum)


@functools.cache
def init(model):
    """``model``'s parameters on the host: traced and compiled once per model (a hashable Flax dataclass) for every
    test in the process; each state places its own copy. Dropout has no parameters and the RMS block only lacks
    the LayerNorm's, so those variants take the plain model's draw (what Flax's init of them gives: same names,
    same keys)."""
    if model.dropout or model.rms:
        params = init(model.clone(dropout=0.0, rms=False))
        if not model.rms:
            return params
        layers = {k: v for k, v in params["PipelineStack_0"]["layers"].items() if k != "LayerNorm_0"}
        return {**params, "PipelineStack_0": {**params["PipelineStack_0"], "layers": layers}}
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    return jax.device_get(jax.jit(model.init)(keys, np.zeros((2, 5), np.float32))["params"])


@functools.cache
def net_of(net):
    """One object per equal ``Net`` (a hashable Flax dataclass) for the process: a state's ``apply_fn`` keys its
    step's program, and the bound methods of two equal modules are not equal, so states built from ``net_of(...)``
    reuse each other's programs."""
    return net


@functools.cache
def one_device(real_rows, model=False, dropout=0.0, rng="per_device", rms=False):
    net = net_of(Net(model, dropout, rms))
    state = sc.TrainState.create(params=init(Net(False, dropout, rms)), apply_fn=net.apply, tx=TX, mesh=mesh_of(1))
    data = [{k: v[:real_rows] for k, v in b.items()} for b in batches()]
    state, losses = train(state, data, rng=rng)
    return jax.device_get(state.params), losses


SLOW = pytest.mark.slow
LAYOUTS = [
    # (mesh, data axes, strategy, microbatches, repeats, accumulation, padded); the fast tier runs the second. DDP
    # on data 4 x stage 2 is test_checkpoints_keep_the_canonical_layer_order_and_restore_onto_any_layout's run.
    pytest.param({"data": 2, "stage": 4}, "data", "fsdp", 8, 1, 1, True, marks=SLOW),
    pytest.param({"data": 2, "stage": 2, "model": 2}, "data", "zero1", 4, 2, 1, False),
    pytest.param({"data": 4, "stage": 2}, "data", "zero2", 2, 2, 2, True, marks=SLOW),
    pytest.param({"replica": 2, "shard": 2, "stage": 2}, ("replica", "shard"), "fsdp", 4, 1, 1, False, marks=SLOW),
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


@pytest.mark.parametrize(
    "layout, strategy, m, v",
    [
        ({"stage": 2}, "ddp", 2, 1),
        pytest.param({"stage": 8}, "zero2", 8, 1, marks=SLOW),
        pytest.param({"stage": 4, "model": 2}, "fsdp", 4, 2, marks=SLOW),
    ],
    ids=str,
)
def test_a_mesh_without_a_data_axis_runs_the_pipeline_as_one_device(layout, strategy, m, v):
    """A mesh of stage (and model) axes needs no data axis: the state's mesh gets one of size 1, on the same
    devices, and a batch placed on the user's mesh runs as it is."""
    model = "model" in layout
    expected, expected_losses = one_device(32)
    mesh = sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))])
    state = sc.TrainState.create(
        params=init(Net(model)),
        apply_fn=Net(model).apply,
        tx=TX,
        mesh=mesh,
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, repeats=v),
    )
    assert dict(state.mesh.shape) == {"data": 1, **layout}
    assert list(state.mesh.devices.flat) == list(mesh.devices.flat)
    assert str(state.roles).startswith(f"shard data=1, stage stage={layout['stage']}")
    placed = [jax.device_put(b, jax.sharding.NamedSharding(mesh, P("stage"))) for b in batches()]
    state, losses = train(state, placed)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=1e-5)


def run_with_a_non_finite_step(state):
    """Three steps of ``state`` with a NaN in one row of step 2's batch: the parameters, and each step's loss,
    skipped flag and loss scale."""
    data = batches()
    data[1]["x"][5, 2] = np.nan
    step, seen = train_step("per_device", 1), []
    for batch in data:
        state, metrics = step(state, batch)
        seen.append([float(metrics[k]) for k in ("loss", "skipped", "loss_scale")])
    return jax.device_get(state.full_params()), np.array(seen)


LOSS_SCALE = {"scale": 2.0**15}


@functools.cache
def one_device_with_a_non_finite_step():
    """:func:`run_with_a_non_finite_step` on one device (GPipe's test here and 1F1B's compare with it)."""
    state = sc.TrainState.create(
        params=init(Net()), apply_fn=Net().apply, tx=TX, mesh=mesh_of(1), loss_scale=LOSS_SCALE
    )
    want, want_seen = run_with_a_non_finite_step(state)
    assert want_seen[:, 1].tolist() == [0.0, 1.0, 0.0] and want_seen[2, 2] == 2.0**14
    return want, want_seen


@SLOW
def test_a_non_finite_step_is_skipped_on_every_stage_and_the_loss_scale_is_one_devices():
    """A NaN in one row of step 2's batch makes the gradient of every stage non-finite at once: the step is skipped
    everywhere, the loss scale backs off once, and the run goes on as one device's (clipping sees each stage)."""
    want, want_seen = one_device_with_a_non_finite_step()
    state = sc.TrainState.create(
        params=init(Net()),
        apply_fn=Net().apply,
        tx=TX,
        mesh=sc.make_mesh({"data": 4, "stage": 2}),
        loss_scale=LOSS_SCALE,
        strategy="fsdp",
        pipeline=sc.Pipeline(microbatches=2),
    )
    got, seen = run_with_a_non_finite_step(state)
    np.testing.assert_allclose(seen, want_seen, rtol=1e-5)  # a NaN loss equals a NaN loss
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)


# --- what a user can get wrong -------------------------------------------------------------------------------


def error_of(layout, *, m=2, v=1, axis="data", params=None, stage_axis="stage"):
    params = init(Net()) if params is None else params
    with pytest.raises((sc.SpmdError, sc.AxisError, sc.ShapeError)) as e:
        sc.TrainState.create(
            params=params,
            tx=optax.sgd(0.1),
            mesh=sc.make_mesh(layout),
            axis=axis,
            pipeline=sc.Pipeline(microbatches=m, repeats=v, axis=stage_axis),
        )
    return e


@pytest.mark.parametrize(
    "layout, kwargs, kind, facts",
    [
        ({"data": 2, "stage": 4}, {"m": 2}, sc.SpmdError, ["microbatches=2 on 4 stages", "microbatches=4"]),
        ({"data": 2, "stage": 4}, {"m": 6}, sc.SpmdError, ["microbatches=6 on 4 stages", "multiple of 4"]),
        ({"data": 2, "stage": 4}, {"m": 4, "v": 4}, sc.SpmdError, ["8 layers", "v * p = 16", "repeats=4"]),
        ({"data": 8}, {}, sc.AxisError, ["stage axis 'stage'", "{'data': 8}", "sc.Pipeline(axis=...)"]),
        ({"data": 2, "stage": 4}, {"axis": ("data", "stage")}, sc.AxisError, ["'stage'", "not a data axis"]),
        ({"stage": 8}, {"stage_axis": "pp"}, sc.AxisError, ["{'stage': 8}", "neither the data axis 'data'", "'pp'"]),
        ({"stage": 8}, {"axis": ("replica", "shard")}, sc.AxisError, ["axis 'replica' is not an axis of the mesh"]),
    ],
)
def test_schedules_that_cannot_run_are_refused_before_compiling(layout, kwargs, kind, facts):
    e = error_of(layout, **kwargs)
    assert isinstance(e.value, kind), e.value
    for fact in facts:
        assert fact in str(e.value), (fact, str(e.value))


def test_a_pipeline_needs_stacked_layers():
    with pytest.raises(sc.SpmdError, match=r"no parameter is split over the stage axis 'stage'.*PipelineStack"):
        sc.TrainState.create(
            params={"w": np.zeros((4, 4), np.float32)},
            tx=optax.sgd(0.1),
            mesh=sc.make_mesh({"data": 4, "stage": 2}),
            pipeline=sc.Pipeline(microbatches=2),
        )


def test_a_batch_that_does_not_split_into_microbatches_is_refused():
    state = sc.TrainState.create(
        params=init(Net()),
        apply_fn=Net().apply,
        tx=optax.sgd(0.1),
        mesh=sc.make_mesh({"data": 2, "stage": 4}),
        pipeline=sc.Pipeline(microbatches=8),
    )
    rows = {k: np.concatenate([v, v[:8]]) for k, v in batches()[0].items()}  # 40 rows: 20 per data replica
    with pytest.raises(sc.ShapeError, match=r"a data replica's 20 rows do not split into microbatches=8"):
        sc.make_train_step(loss_fn)(state, rows)


@pytest.mark.slow
def test_per_example_dropout_draws_one_devices_masks():
    """Dropout keyed by example and layer (rng="per_example"): the same masks as one device, whatever the stages,
    micro-batches, chunks and accumulation (a stage device's rows of one accumulated micro-batch are not next to
    its neighbour's). Two accumulated micro-batches: the examples' key offsets are one formula for any accumulation
    (spmdcomm/train/_micro.py), checked here at a micro-batch offset of zero and one past it."""
    expected, expected_losses = one_device(32, dropout=0.2, rng="per_example")
    net = Net(dropout=0.2)
    state = sc.TrainState.create(
        params=init(net),
        apply_fn=net.apply,
        tx=TX,
        mesh=sc.make_mesh({"data": 2, "stage": 2, "other": 2}),
        axis=("data", "other"),
        pipeline=sc.Pipeline(microbatches=4, repeats=2),
    )
    state, losses = train(state, batches(), rng="per_example", accum=2)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_checkpoints_keep_the_canonical_layer_order_and_restore_onto_any_layout(tmp_path):
    """Saved at p = 2, v = 1; restored at p = 4, v = 2 (stage order differs) under another strategy, and on one
    device (no stage axis): the same model, and one more step gives the uninterrupted run's parameters, one
    device's. The run saved is DDP over data 4 x stage 2, the train step grid's DDP case: its three steps equal one
    device's. Restoring onto other data-parallel strategies and device counts:
    tests/test_sharded.py's test_checkpoint_restores_onto_another_strategy_and_device_count."""
    expected, expected_losses = one_device(32)
    data = batches(steps=3)
    net = net_of(Net())

    def create(mesh, strategy, pipeline):
        return sc.TrainState.create(
            params=init(net), apply_fn=net.apply, tx=TX, mesh=mesh, strategy=strategy, pipeline=pipeline
        )

    state = create(sc.make_mesh({"data": 4, "stage": 2}), "ddp", sc.Pipeline(microbatches=2))
    assert state.params["PipelineStack_0"]["layers"]["Dense_0"]["kernel"].sharding.spec[0] == "stage"
    state, losses = train(state, data[:2])
    sc.save_checkpoint(tmp_path, state)
    saved = jax.device_get(state.full_params())
    straight, more = train(state, data[2:])
    np.testing.assert_allclose(losses + more, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(straight.full_params()), expected, rtol=1e-5, atol=1e-5)
    for mesh, strategy, pipeline in [
        (sc.make_mesh({"data": 2, "stage": 4}), "fsdp", sc.Pipeline(microbatches=4, repeats=2)),
        (mesh_of(1), "ddp", None),
    ]:
        restored = sc.restore_checkpoint(tmp_path, create(mesh, strategy, pipeline))
        assert_trees_close(jax.device_get(restored.full_params()), saved, rtol=0, atol=0)
        resumed, more = train(restored, data[2:])
        np.testing.assert_allclose(more, expected_losses[2:], rtol=1e-5)
        assert_trees_close(jax.device_get(resumed.full_params()), expected, rtol=1e-5, atol=1e-5)


@functools.cache
def explained(strategy, remat, m, copies):
    """``sc.explain`` of ``Net``'s step on ``data`` 2 x ``stage`` 4 with ``m`` micro-batches of ``copies`` x 32 rows
    (one compile per setting for the tests that read it)."""
    state = sc.TrainState.create(
        params=init(Net()),
        apply_fn=Net().apply,
        tx=TX,
        mesh=sc.make_mesh({"data": 2, "stage": 4}),
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, remat=remat),
    )
    batch = {k: np.concatenate([v] * copies) for k, v in batches()[0].items()}
    return sc.explain(sc.make_train_step(loss_fn), state, batch)


# The FSDP case is test_each_tick_is_rematerialised_under_fsdp_too's program without remat (slow tier with it).
@pytest.mark.parametrize(
    "strategy, remat, m, copies", [("ddp", True, 4, 1), pytest.param("fsdp", False, 8, 8, marks=SLOW)]
)
def test_explain_shows_the_schedule_and_that_stages_keep_their_layers(strategy, remat, m, copies):
    report = explained(strategy, remat, m, copies)
    pipeline = report.pipeline
    ticks = m + 3
    assert (pipeline.stages, pipeline.repeats, pipeline.microbatches, pipeline.ticks) == (4, 1, m, ticks)
    assert pipeline.bubble == pytest.approx(3 / ticks)
    # GPipe keeps one item per tick until the backward pass; with remat only the stage input, recomputing once.
    kept = "stage input" if remat else "every layer's activations"
    assert (pipeline.in_flight, pipeline.kept, pipeline.recomputed) == (ticks, kept, int(remat))
    said = f"kept for the backward pass: {kept} of {ticks} micro-batches, {int(remat)} forward recomputed"
    assert said in str(pipeline)
    # 1/p of the stack per device, and 1/(p N) under FSDP (N = 2 data devices).
    assert pipeline.stacked_bytes * 4 * (2 if strategy == "fsdp" else 1) == pipeline.stack_bytes
    assert pipeline.stage_gathers == 0 and report.count("all-gather", over="stage") == 0
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("stage",) and c.where == "while" for c in permutes)
    assert pipeline.permutes == sum(c.count for c in permutes) and "pipeline over 'stage', gpipe: p=4" in report.table()
    if strategy == "fsdp":  # the stage's layers are gathered once per step, outside the schedule's loop
        assert all(c.where == "entry" for c in report.collectives if c.kind == "all-gather")


# --- BatchNorm in a stage -------------------------------------------------------------------------------------


class NormBlock(nn.Module):
    """A residual block with BatchNorm (synchronised over ``axis_name``, if given) in it."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dense(WIDTH, use_bias=False)(x)  # a bias before BatchNorm has no gradient: Adam would amplify noise
        h = sc.SyncBatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(h)
        return x + jnp.tanh(h)


class NormNet(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        h = sc.PipelineStack(NormBlock(self.axis_name), layers=4)(nn.Dense(WIDTH)(x), train)
        return nn.Dense(3)(h)


def norm_loss(params, batch, *, apply_fn, model_state, rng, mask):
    out, new = apply_fn({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
    return sc.masked_mean(jnp.sum((out - batch["y"]) ** 2, -1), mask), {"model_state": new}


def norm_metrics(params, batch, *, apply_fn, model_state, mask):
    out = apply_fn({"params": params, **model_state}, batch["x"], train=False)
    return {"error": sc.masked_mean(jnp.sum((out - batch["y"]) ** 2, -1), mask)}


@functools.cache
def init_norm(cls=NormNet):
    """The variables of ``cls`` (``NormNet``, or another net of the same fields) on the host, one compiled init for
    every run."""
    return jax.device_get(jax.jit(cls().init)(jax.random.key(0), np.zeros((2, 5), np.float32)))


def train_norm(net, mesh, data, *, accum=1, **kwargs):
    variables = init_norm(type(net))
    state = sc.TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        apply_fn=net.apply,
        tx=optax.adam(1e-2),
        mesh=mesh,
        **kwargs,
    )
    step, losses = sc.make_train_step(norm_loss, accum_steps=accum), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    error = float(sc.make_eval_step(norm_metrics)(state, data[0])["error"])
    if state.pipeline is not None and kwargs["strategy"] == "ddp":
        # The statistics are gathered over the stage axis once per step; explain does not take them for layers.
        report = sc.explain(step, state, data[0])
        gathers = [c for c in report.collectives if c.kind == "all-gather" and "stage" in (c.axes or ())]
        assert gathers and report.pipeline.stage_gathers == 0, report.pipeline
    return jax.device_get((state.full_params(), state.model_state)), losses, error


@functools.cache
def norm_one_device(replicas, m, cls=NormNet, *, accum=1, stages=2):
    """One device's run of ``cls("data")`` with ``accum_steps=accum m``, its micro-batch ``g m + j`` holding every
    replica's micro-batch j of accumulation group g. A replica's R rows are split over its ``stages`` devices, each
    device's into ``accum`` groups, and a group's m micro-batches are q = m / stages parts of each device's group in
    turn (accum 1: replica d's micro-batch j is global rows d R + j R/m)."""
    rows, q = 16 // replicas, m // stages
    group, mb = rows // (stages * accum), rows // (stages * accum * q)
    order = [
        d * rows + (j // q) * (rows // stages) + g * group + (j % q) * mb + i
        for g in range(accum)
        for j in range(m)
        for d in range(replicas)
        for i in range(mb)
    ]
    data = [{k: a[order] for k, a in b.items()} for b in batches(rows=16)]
    return train_norm(cls("data"), mesh_of(1), data, accum=accum * m)


@pytest.mark.parametrize(
    "layout, strategy, m, v",
    [
        pytest.param({"data": 1, "stage": 2}, "ddp", 4, 2, marks=SLOW),  # the fast tier counts updates in the core test
        pytest.param({"data": 2, "stage": 2}, "fsdp", 4, 1, marks=SLOW),
        pytest.param({"data": 2, "stage": 2, "model": 2}, "zero1", 2, 2, marks=SLOW),
    ],
    ids=str,
)
def test_batchnorm_in_a_stage_equals_one_device_with_one_micro_batch_at_a_time(layout, strategy, m, v):
    """GPipe's rule: each micro-batch is normalised by its own statistics (synchronised over the data axis, so over
    the micro-batch's rows on every replica) and the running statistics update once per micro-batch, in order. One
    device computes the same with accum_steps=m, its micro-batch j holding every replica's micro-batch j."""
    (want, want_stats), want_losses, want_error = norm_one_device(layout["data"], m)
    (got, got_stats), losses, error = train_norm(
        NormNet("data"),
        sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))]),
        batches(rows=16),
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, repeats=v),
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    assert_trees_close(got_stats, want_stats, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(error, want_error, rtol=1e-5)  # the eval step normalises by the running statistics


# --- Flax NNX --------------------------------------------------------------------------------------------------


def nnx_net(rms_norm=False):
    """The NNX twin of ``Net``; ``rms_norm``: :func:`rms` in place of the blocks' LayerNorm."""
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.norm = rms if rms_norm else nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
            self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(self.norm(x))))

    class NnxNet(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(5, WIDTH, rngs=rngs)
            self.stack = sc.nnx.PipelineStack(NnxBlock, layers=LAYERS, rngs=rngs)
            self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.stack(self.embed(x)))

    return NnxNet(nnx.Rngs(0))


def nnx_loss(model, batch, *, rng, mask):
    return sc.masked_mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, -1), mask)


def nnx_train(mesh, strategy="ddp", *, rms_norm=False, **kwargs):
    """``(state, losses)`` of three steps of :func:`nnx_net` on ``mesh`` (``kwargs``: more of ``create_nnx``'s)."""
    state = sc.TrainState.create_nnx(nnx_net(rms_norm), tx=TX, mesh=mesh, strategy=strategy, **kwargs)
    step, losses = sc.make_train_step(sc.nnx_loss_fn(nnx_loss)), []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@functools.cache
def nnx_one_device(rms_norm=False):
    state, losses = nnx_train(mesh_of(1), rms_norm=rms_norm)
    return jax.device_get(state.params), losses


def test_nnx_stack_trains_as_one_device():
    """Without a stage axis, the stack is a scan on every device. With one: tests/test_pipeline_1f1b.py's
    interleaved 1F1B of this model, and tests/test_pipeline_bubbles.py's NNX test under GPipe (FSDP, v = 2, ZeRO-2,
    its kernels split over the stage axis)."""
    reference, expected = nnx_one_device()
    state, losses = nnx_train(sc.make_mesh({"data": 8}), "ddp")
    assert state.params["stack"]["layers"]["up"]["kernel"].sharding.spec[0] is None
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), reference, rtol=1e-5, atol=1e-5)


def test_an_nnx_block_with_its_own_rng_streams_is_refused():
    from flax import nnx

    class DropoutBlock(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    with pytest.raises(ValueError, match=r"RNG streams.*Keep dropout \(and its nnx.Rngs\) outside the stack"):
        sc.nnx.PipelineStack(DropoutBlock, layers=2, rngs=nnx.Rngs(0))


def nnx_norm_run(model, mesh, accum, *, rng="per_device", **kwargs):
    """``((parameters, model state), losses)`` of three steps of the NNX ``model(rngs)`` on 16 rows, Adam."""
    from flax import nnx

    state = sc.TrainState.create_nnx(model(nnx.Rngs(0)), tx=optax.adam(1e-2), mesh=mesh, **kwargs)
    step, losses = sc.make_train_step(sc.nnx_loss_fn(nnx_loss), accum_steps=accum, rng=rng), []
    for batch in batches(rows=16):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.device_get((state.full_params(), state.model_state)), losses


@SLOW
def test_nnx_batchnorm_in_a_stage_equals_one_device_with_one_micro_batch_at_a_time():
    from flax import nnx

    class NormBlock(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
            self.norm = nnx.BatchNorm(WIDTH, momentum=0.8, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.norm(self.dense(x)))

    class NormNet(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(5, WIDTH, rngs=rngs)
            self.stack = sc.nnx.PipelineStack(NormBlock, layers=4, rngs=rngs)
            self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.stack(self.embed(x)))

    (want, want_stats), want_losses = nnx_norm_run(NormNet, mesh_of(1), 4)
    stats = want_stats["stack"]["layers"]["norm"]["mean"]
    assert stats.shape == (4, WIDTH) and np.abs(stats).max() > 0.01  # stacked and trained
    mesh = sc.make_mesh({"data": 1, "stage": 2}, devices=jax.devices()[:2])
    (got, got_stats), losses = nnx_norm_run(NormNet, mesh, 1, pipeline=sc.Pipeline(microbatches=4, repeats=2))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    assert_trees_close(got_stats, want_stats, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_with_the_stage_or_the_expert_axis_across_them_equal_one_device(launch, tmp_path):
    """One job (tests/workers/mp_pipeline.py): GPipe, 1F1B and ZB-H1 with the stage axis across the processes, then
    tests/test_expert_parallel.py's MoE step with the expert axis across them, on a padded batch."""
    from tests.test_expert_parallel import MODEL, REAL_ROWS, batch, one_device_step

    experts_init = jax.jit(MODEL.init)(jax.random.key(0), batch()["x"][:1])["params"]
    write_initial(tmp_path, pipeline=init(Net()), experts=experts_init)
    out = launch("mp_pipeline.py", tmp_path, timeout=300)
    assert out.stdout.count("PIPELINE OK") == 2 and out.stdout.count("EXPERTS OK") == 2  # one each per process
    expected, expected_losses = one_device(32)
    for schedule in ("pipeline", "pipeline_1f1b", "pipeline_zb"):  # GPipe, 1F1B, ZB-H1
        got = np.load(tmp_path / f"params_{schedule}.npz")
        for path, x in jax.tree_util.tree_flatten_with_path(expected)[0]:
            name = jax.tree_util.keystr(path)
            np.testing.assert_allclose(got[name], np.asarray(x), rtol=1e-5, atol=1e-5, err_msg=f"{schedule} {name}")
        np.testing.assert_allclose(np.load(tmp_path / f"losses_{schedule}.npy"), expected_losses, rtol=1e-5)
    got = np.load(tmp_path / "params_experts.npz")
    want, loss, _ = one_device_step(experts_init, REAL_ROWS)  # one device on the padded batch's real rows
    for path, x in jax.tree_util.tree_flatten_with_path(want)[0]:
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(got[name], np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=f"experts {name}")
    np.testing.assert_allclose(np.load(tmp_path / "losses_experts.npy"), [loss], rtol=1e-5)


@SLOW
def test_each_tick_is_rematerialised_under_fsdp_too():
    """The schedule keeps one stage input per tick: its compiled temporaries are a fraction of what keeping every
    layer's activations takes, also under FSDP (whose own checkpoint policy must not override the schedule's)."""
    temporaries = {remat: explained("fsdp", remat, 8, 8).memory.temp_bytes for remat in (True, False)}
    assert temporaries[True] * 3 < temporaries[False], temporaries
