"""sc.explain: the exact collectives and the memory of compiled programs, read from the optimised HLO."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ddp_models import example_batch, init, loss_fn, optimizer
from jax import lax

import spmdcomm as sc
from spmdcomm import P
from spmdcomm.explain.memory import DeviceMemory, device_memory
from spmdcomm.explain.report import Explanation, _inventory, _parse_module

N = jax.device_count()
ALL = (tuple(range(N)),)
RING = tuple((i, (i + 1) % N) for i in range(N))


def one(report):
    """The report's only collective row."""
    assert len(report.collectives) == 1, report.collectives
    return report.collectives[0]


ROWS = P("data")


def per_device(fn, out_specs=ROWS):
    """``fn`` on each device's block of rows of its argument."""
    return sc.spmd(fn, in_specs=ROWS, out_specs=out_specs)


# --------------------------------------------------------------------------------------------------
# Collectives of spmd functions: kind, bytes (nccl-tests message size), dtypes, groups, axes


def test_psum_is_one_all_reduce_of_its_buffer_over_the_data_axis():
    f = per_device(lambda x: sc.psum(x[0], "data"), out_specs=P())
    report = sc.explain(f, np.ones((N, 1024), np.float32))
    c = one(report)
    assert (c.kind, c.count, c.bytes, c.total_bytes, c.buffers) == ("all-reduce", 1, 4096, 4096, 1)
    assert (c.dtypes, c.replica_groups, c.source_target_pairs, c.axes) == (("float32",), ALL, (), ("data",))
    assert (c.where, c.in_loop) == ("entry", False)
    assert report.devices == N and report.mesh.shape == {"data": N}
    assert report.count() == report.count("all-reduce") == 1 and report.count("all-gather") == 0
    assert report.total_bytes() == 4096


@pytest.mark.parametrize(
    "fn, shape, out, kind",
    [
        # all-gather: the gathered size (N blocks of 128 floats)
        (lambda x: sc.all_gather(x, "data"), (N * 128,), P(), "all-gather"),
        # reduce-scatter: the size before scattering (this device's whole row)
        (lambda x: sc.reduce_scatter(x.reshape(-1), "data"), (N, N * 128), P("data"), "reduce-scatter"),
        # all-to-all: the bytes each device sends (its whole block)
        (lambda x: sc.all_to_all(x, "data", split_dim=1, concat_dim=1), (N, N * 128), P("data"), "all-to-all"),
    ],
    ids=["all_gather", "reduce_scatter", "all_to_all"],
)
def test_each_collective_shows_its_kind_and_message_bytes(fn, shape, out, kind):
    c = one(sc.explain(per_device(fn, out_specs=out), np.ones(shape, np.float32)))
    assert (c.kind, c.count, c.bytes, c.dtypes) == (kind, 1, N * 128 * 4, ("float32",))
    assert (c.replica_groups, c.axes, c.where) == (ALL, ("data",), "entry")


def test_permute_shows_its_pairs_and_bytes():
    c = one(sc.explain(per_device(lambda x: sc.shift(x, "data", offset=1)), np.ones(N * 128, np.float32)))
    assert (c.kind, c.count, c.bytes, c.dtypes) == ("collective-permute", 1, 128 * 4, ("float32",))
    assert (c.replica_groups, c.source_target_pairs, c.axes) == ((), RING, ("data",))


def test_identical_collectives_are_counted_and_dtypes_named():
    def f(x):
        gathered = sc.all_gather(x, "data"), sc.all_gather(x * 2, "data")
        return gathered, sc.psum(x.astype(jnp.int32), "data"), sc.psum(x[:4] + 1, "data")

    report = sc.explain(per_device(f, out_specs=P()), np.ones(N * 64, np.float32))
    got = [(c.kind, c.count, c.bytes, c.total_bytes, c.dtypes) for c in report.collectives]
    assert got == [
        ("all-gather", 2, N * 64 * 4, 2 * N * 64 * 4, ("float32",)),
        ("all-reduce", 1, 64 * 4, 64 * 4, ("int32",)),
        ("all-reduce", 1, 4 * 4, 4 * 4, ("float32",)),
    ]
    assert report.count() == 4 and report.total_bytes() == 2 * N * 256 + 256 + 16


def test_collective_in_a_loop_is_flagged():
    def f(x):
        return lax.fori_loop(0, 3, lambda i, v: lax.pcast(sc.psum(v, "data"), "data", to="varying") / N, x)

    c = one(sc.explain(per_device(f), np.ones(N * 256, np.float32)))
    assert (c.kind, c.count, c.bytes, c.where, c.in_loop) == ("all-reduce", 1, 1024, "while", True)


# --------------------------------------------------------------------------------------------------
# Other functions: jitted, plain, lowered, compiled


def test_jitted_function_without_collectives_shows_none():
    report = sc.explain(jax.jit(lambda x: jnp.sin(x) * 2), np.ones((4, 8), np.float32))
    assert report.collectives == () and report.count() == 0 and report.total_bytes() == 0
    assert report.devices == 1 and report.memory.argument_bytes == report.memory.output_bytes == 128
    assert "no collectives" in str(report)


def test_plain_function_is_jitted_and_keyword_arguments_reach_it():
    def f(x, *, scale):
        return x * scale

    report = sc.explain(f, np.ones(16, np.float32), scale=3.0)
    assert report.collectives == () and report.memory.argument_bytes >= 64


def test_lowered_and_compiled_programs_are_accepted():
    f = per_device(lambda x: sc.psum(x[0], "data"), out_specs=P())
    x = np.ones((N, 1024), np.float32)
    lowered = f.lower(x)
    want = sc.explain(f, x).collectives
    assert sc.explain(lowered).collectives == sc.explain(lowered.compile()).collectives == want
    assert sc.explain(lowered).name == "jit__lambda"  # the HLO module's name


# --------------------------------------------------------------------------------------------------
# Mesh axes of the groups


@pytest.fixture
def mesh_2x4():
    if N < 8:
        pytest.skip("needs 8 devices")
    return sc.make_mesh({"data": 2, "model": 4}, devices=jax.devices()[:8])


@pytest.mark.parametrize(
    "axis, out, groups",
    [
        ("data", P(None, "model"), ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("model", P("data"), ((0, 1, 2, 3), (4, 5, 6, 7))),
        (("data", "model"), P(), ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ],
)
def test_groups_of_a_2d_mesh_name_their_axes(mesh_2x4, axis, out, groups):
    f = sc.spmd(lambda x: sc.psum(x, axis), in_specs=P("data", "model"), out_specs=out, mesh=mesh_2x4)
    c = one(sc.explain(f, np.ones((8, 8), np.float32)))
    assert c.replica_groups == groups and c.axes == ((axis,) if isinstance(axis, str) else axis)
    assert c.bytes == 4 * 2 * 4  # this device's (4, 2) block of the (8, 8) array split 2 x 4


def test_permute_along_one_axis_of_a_2d_mesh(mesh_2x4):
    specs = P("data", "model")
    f = sc.spmd(lambda x: sc.shift(x, "model", offset=1), in_specs=specs, out_specs=specs, mesh=mesh_2x4)
    c = one(sc.explain(f, np.ones((8, 8), np.float32)))
    ring = ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4))
    assert (c.kind, c.source_target_pairs, c.axes, c.bytes) == ("collective-permute", ring, ("model",), 4 * 2 * 4)


def test_explicit_mesh_names_the_axes_of_a_jitted_function(mesh_2x4):
    f = jax.jit(
        jax.shard_map(lambda x: lax.psum(x, "model"), mesh=mesh_2x4, in_specs=P("data", "model"), out_specs=P("data"))
    )
    assert one(sc.explain(f, np.ones((8, 8), np.float32), mesh=mesh_2x4)).axes == ("model",)


# --------------------------------------------------------------------------------------------------
# Train and eval steps (one process, the MLP of ddp_models: 212 float32 parameters)


def build(strategy):
    """The placed MLP state and a train step for it: the one place that spells a strategy."""
    apply_fn, params, model_state = init("mlp")
    state = sc.TrainState.create(
        params=params, model_state=model_state, apply_fn=apply_fn, tx=optimizer("adam"), strategy=strategy
    )
    return state, sc.make_train_step(loss_fn)


PARAM_FLOATS = 8 * 16 + 16 + 16 * 4 + 4  # Dense(16) and Dense(4) kernels and biases
METRIC_FLOATS = 3  # the example count, the loss and the accuracy, reduced with the gradients


def state_bytes_per_device(state):
    device = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == device)


def test_ddp_step_reduces_the_parameters_and_metrics_in_one_variadic_all_reduce():
    state, step = build("ddp")
    report = sc.explain(step, state, example_batch("mlp", 2 * N, seed=0))
    c = one(report)
    # XLA fuses the four gradient leaves and the metrics vector into one all-reduce of five buffers.
    assert (c.kind, c.count, c.buffers, c.axes) == ("all-reduce", 1, 5, ("data",))
    assert c.bytes == 4 * (PARAM_FLOATS + METRIC_FLOATS)
    assert report.name == "TrainStep" and report.mesh.shape == {"data": N}
    assert state.step.is_deleted() is False  # explained, not run: the donated state is untouched


def test_ddp_one_bucket_is_one_all_reduce_of_one_flat_buffer():
    state, step = build(sc.DDP(bucket_bytes=2**40))
    c = one(sc.explain(step, state, example_batch("mlp", 2 * N, seed=0)))
    assert (c.kind, c.count, c.buffers, c.bytes) == ("all-reduce", 1, 1, 4 * (PARAM_FLOATS + METRIC_FLOATS))


def test_zero1_reduce_scatters_and_all_gathers_the_split_leaves_in_one_buffer():
    state, step = build("zero1")
    report = sc.explain(step, state, example_batch("mlp", 2 * N, seed=0))
    # Leaves with a dimension the device count divides are reduce-scattered and all-gathered, all in one buffer;
    # the others (the 4-entry bias on 8 devices) ride in the metrics' all-reduce.
    sizes = [(math.prod(x.shape), any(d % N == 0 for d in x.shape)) for x in jax.tree.leaves(state.params)]
    split = 4 * sum(size for size, divides in sizes if divides)
    whole = 4 * sum(size for size, divides in sizes if not divides)
    got = {c.kind: (c.count, c.bytes) for c in report.collectives}
    assert got == {"reduce-scatter": (1, split), "all-gather": (1, split), "all-reduce": (1, 4 * METRIC_FLOATS + whole)}
    assert all(c.axes == ("data",) for c in report.collectives)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_step_memory_is_positive_and_holds_the_placed_state(strategy):
    state, step = build(strategy)
    batch = example_batch("mlp", 2 * N, seed=0)
    m = sc.explain(step, state, batch).memory
    assert m.argument_bytes >= state_bytes_per_device(state) > 0
    assert m.output_bytes > 0 and m.temp_bytes > 0
    # XLA's own figure (XLA:CPU reports 0), not a missing one (None).
    assert m.generated_code_bytes == step.lower(state, batch).compile().memory_analysis().generated_code_size_in_bytes
    assert 0 < m.alias_bytes <= m.argument_bytes  # the donated state's buffers are reused for the new state
    want = m.argument_bytes + m.output_bytes + m.temp_bytes + m.generated_code_bytes - m.alias_bytes
    assert m.total_bytes == want


def test_zero1_holds_less_optimizer_state_than_ddp():
    if N < 2:
        pytest.skip("needs 2 devices")
    batch = example_batch("mlp", 2 * N, seed=0)
    held = {}
    for strategy in ("ddp", "zero1"):
        state, step = build(strategy)
        held[strategy] = sc.explain(step, state, batch).memory.argument_bytes
    assert held["zero1"] < held["ddp"]


def test_eval_step_reduces_its_metric_sums():
    state, _ = build("ddp")

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        return {"loss": loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)[0]}

    report = sc.explain(sc.make_eval_step(metric_fn), state, example_batch("mlp", 2 * N, seed=0))
    assert report.count("all-reduce") == 1 and report.total_bytes() == 4 * 2  # the example count and the loss sum


# --------------------------------------------------------------------------------------------------
# The printed table


def test_table_is_aligned():
    f = per_device(lambda x: (sc.psum(x[0], "data"), sc.all_gather(x, "data")), out_specs=(P(), P()))
    text = str(sc.explain(f, np.ones((N, 1024), np.float32)))
    lines = text.splitlines()
    assert lines[0] == f"<lambda> on {N} device(s) (mesh data={N})"
    header, rows = lines[1], lines[2:4]
    assert header.split() == ["collective", "count", "bytes", "total", "buffers", "dtypes", "axes", "groups", "where"]
    for row in rows:  # every column starts where its header does
        for name in ("dtypes", "axes", "groups", "where"):
            assert row[header.index(name) - 1] == " " and row[header.index(name)] != " "
    assert sorted(r.split()[0] for r in rows) == ["all-gather", "all-reduce"]
    assert lines[4].startswith("total: 2 collective(s), ") and lines[5].startswith("memory per device: arguments ")


def test_unknown_memory_prints_as_not_available():
    class NoAnalysis:
        def memory_analysis(self):
            return None

    memory = device_memory(NoAnalysis())
    assert memory == DeviceMemory(None, None, None, None, None) and memory.total_bytes is None
    report = Explanation(name="p", devices=1, mesh=None, collectives=(), memory=memory, hlo="")
    assert str(report).splitlines()[-2:] == [
        "memory per device: arguments n/a, outputs n/a, temporaries n/a, generated code n/a, aliased n/a, total n/a",
        "work: 0 FLOP per device, 0 FLOP over 1 device(s) (matmuls and convolutions)",  # no program, no work
    ]


# --------------------------------------------------------------------------------------------------
# Asynchronous collectives (GPU/TPU HLO): start/done pairs count once, async wrappers are transparent


GPU_STYLE = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[1024]{0})->f32[256]{0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%async_computation (param_0: f32[1024]) -> f32[256] {
  %param_0 = f32[1024]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[256]{0} reduce-scatter(%param_0), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[256]{0} get-tuple-element(%p), index=1
  %all-reduce-start = f32[256]{0} all-reduce-start(%v), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[256]{0} all-reduce-done(%all-reduce-start)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %all-reduce-done)
}

%cond (p.1: (s32[], f32[256])) -> pred[] {
  %p.1 = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (param: f32[1024]) -> f32[256] {
  %param = f32[1024]{0} parameter(0)
  %slice = bf16[128]{0} convert(%param)
  %all-gather-start = (bf16[128]{0}, bf16[1024]{0}) all-gather-start(bf16[128]{0} %slice), channel_id=1, replica_groups={}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[1024]{0} all-gather-done(%all-gather-start)
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) async-start(%param), calls=%async_computation
  %reduce-scatter-done = f32[256]{0} async-done(%reduce-scatter-start)
  %collective-permute-start = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(%reduce-scatter-done), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[256]{0} collective-permute-done(%collective-permute-start)
  %t0 = (s32[], f32[256]{0}) tuple(%i0, %collective-permute-done)
  %while = (s32[], f32[256]{0}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[256]{0} get-tuple-element(%while), index=1
}
"""  # noqa: E501 (HLO text prints one instruction per line)


def test_async_collectives_count_once_with_their_groups_and_places(mesh_2x4):
    module = _parse_module(GPU_STYLE)
    assert (module.name, module.devices) == ("jit_step", 8)
    got = [(c.kind, c.count, c.bytes, c.buffers, c.dtypes, c.axes, c.where) for c in _inventory(module, mesh_2x4)]
    assert got == [
        ("reduce-scatter", 1, 4096, 1, ("float32",), ("model",), "entry"),
        ("all-reduce", 1, 1024, 1, ("float32",), ("data",), "while"),
        ("all-gather", 1, 2048, 1, ("bfloat16",), ("data", "model"), "entry"),
        ("collective-permute", 1, 1024, 1, ("float32",), ("model",), "entry"),
    ]
    groups = [(c.replica_groups, c.source_target_pairs) for c in _inventory(module, mesh_2x4)]
    assert groups == [
        (((0, 1, 2, 3), (4, 5, 6, 7)), ()),  # iota groups [2,4]<=[8]
        (((0, 4), (1, 5), (2, 6), (3, 7)), ()),  # iota groups [4,2]<=[2,4]T(1,0)
        (((0, 1, 2, 3, 4, 5, 6, 7),), ()),  # replica_groups={}: every device
        ((), ((0, 1), (1, 0))),
    ]


@pytest.mark.parametrize(
    "attrs,groups",
    [
        ("mesh['data'=2,'model'=4] {'data'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['data'=2,'model'=4] {'model'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['data'=2,'model'=4] {'data','model'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['data'=2,'model'=4]<=[4,2]T(1,0) {'model'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_groups_named_by_mesh_axes(attrs, groups, mesh_2x4):
    # The form newer XLA versions print (seen with jax 0.11): replica_groups=mesh[...] {axes}.
    text = GPU_STYLE.replace("replica_groups=[2,4]<=[8]", f"replica_groups={attrs}")
    (first,) = [c for c in _inventory(_parse_module(text), mesh_2x4) if c.kind == "reduce-scatter"]
    assert first.replica_groups == groups


# --------------------------------------------------------------------------------------------------
# Bad input


def test_not_a_function_is_a_clear_error():
    with pytest.raises(sc.SpmdError, match=r"spmdcomm.explain: fn is a int, which is neither callable nor has"):
        sc.explain(42, np.ones(3))


def test_arguments_with_a_lowered_program_are_an_error():
    lowered = jax.jit(lambda x: x).lower(np.ones(3))
    with pytest.raises(sc.SpmdError, match="already a Lowered, for fixed arguments, but 1 argument"):
        sc.explain(lowered, np.ones(3))


def test_lower_that_returns_something_else_is_an_error():
    class Odd:
        def lower(self, x):
            return "HLO"

    with pytest.raises(sc.SpmdError, match=r"Odd.lower\(...\) returned a str, not a jax.stages.Lowered"):
        sc.explain(Odd(), np.ones(3))


def test_bad_mesh_is_an_error():
    f = jax.jit(lambda x: x)
    with pytest.raises(sc.SpmdError, match="mesh is a str, not a jax.sharding.Mesh"):
        sc.explain(f, np.ones(3), mesh="data")
    if N > 1:
        with pytest.raises(sc.SpmdError, match=f"mesh has {N} devices .* but the compiled program runs on 1"):
            sc.explain(f, np.ones(3), mesh=sc.data_mesh())


def test_unknown_kind_is_an_error():
    report = sc.explain(jax.jit(lambda x: x), np.ones(3))
    with pytest.raises(sc.SpmdError, match=r"kind='allreduce' is not a collective kind. Fix: pass one of"):
        report.count("allreduce")
