"""Bad input: each raises a documented error type whose message names function, leaf, axis, sizes and the fix."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm import P

DATA = P("data")


def call(fn, x=None, *, in_specs=DATA, out_specs=DATA, mesh=None, backend="shard_map"):
    x = np.zeros((8, 8), np.float32) if x is None else x
    return sc.spmd(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, backend=backend)(x)


@pytest.mark.parametrize(
    "fn_name, fn",
    [
        ("psum", lambda x: sc.psum(x, "dat")),
        ("all_gather", lambda x: sc.all_gather(x, "dat")),
        ("reduce_scatter", lambda x: sc.reduce_scatter(x, ("data", "dat"))),
        ("broadcast", lambda x: sc.broadcast(x, "dat")),
        ("axis_index", lambda x: x + sc.axis_index("dat")),
    ],
)
def test_unknown_axis_lists_the_bound_axes(fn_name, fn):
    with pytest.raises(sc.AxisError) as err:
        call(fn)
    msg = str(err.value)
    assert f"spmdcomm.{fn_name}" in msg and "'dat'" in msg and "('data',)" in msg and "Fix:" in msg


def test_unknown_axis_outside_any_mapped_context():
    with pytest.raises(sc.AxisError, match="no axis is bound here") as info:
        sc.psum(np.ones(3), "data")
    assert "Fix: call collectives only inside spmd, jax.shard_map or jax.pmap" in str(info.value)


def test_unknown_axis_inside_a_mapped_function_names_the_bound_axes_as_the_fix():
    with pytest.raises(sc.AxisError) as info:
        call(lambda x: sc.psum(x, "batch"))
    message = str(info.value)
    assert "Fix: pass one of the bound axis names ('data',), or run over a mesh with axis 'batch'" in message
    assert "only inside" not in message  # it already runs inside spmd


def test_unknown_axis_under_partial_manual_shard_map_lists_the_manual_axes_only():
    # The train step on a mesh with model axes is manual over its data axes only: "model" is not bound there.
    mesh = sc.make_mesh({"data": 4, "model": 2})
    f = jax.jit(
        jax.shard_map(lambda x: sc.psum(x, "model"), mesh=mesh, in_specs=DATA, out_specs=DATA, axis_names={"data"})
    )
    with pytest.raises(sc.AxisError, match=r"unknown axis name 'model': the axes bound here are \('data',\)\."):
        f(jax.device_put(np.zeros(8, np.float32), jax.sharding.NamedSharding(mesh, DATA)))


@pytest.mark.parametrize(
    "fn_name, fn",
    [
        ("reduce_scatter", lambda x: sc.reduce_scatter({"w": x[:, :3]}, "data", dim=1)),
        ("scatter", lambda x: sc.scatter({"w": x[:, :3]}, "data", dim=1)),
        ("all_to_all", lambda x: sc.all_to_all({"w": x[:, :3]}, "data", split_dim=1, concat_dim=0)),
    ],
)
def test_dimension_not_divisible_names_leaf_sizes_and_fix(fn_name, fn):
    with pytest.raises(sc.ShapeError) as err:
        call(fn)
    msg = str(err.value)
    assert f"spmdcomm.{fn_name}: leaf ['w']" in msg
    assert "size 3" in msg and "size 8 of axis 'data'" in msg and "pad dimension 1 to a multiple of 8" in msg


def test_untiled_reduce_scatter_needs_dim_equal_to_axis_size():
    with pytest.raises(sc.ShapeError, match="with tiled=False dimension 0 must equal the size 8"):
        call(lambda x: sc.reduce_scatter(x[:, :4].T, "data", tiled=False))


def test_dim_out_of_range():
    with pytest.raises(sc.ShapeError, match=r"dim=5 is out of range for a block of shape \(1, 8\)"):
        call(lambda x: sc.all_gather(x, "data", dim=5))


@pytest.mark.parametrize(
    "fn_name, fn",
    [
        ("broadcast", lambda x: sc.broadcast(x, "data", root=8)),
        ("reduce", lambda x: sc.reduce(x, "data", root=-1)),
        ("gather", lambda x: sc.gather(x, "data", root=99)),
        ("scatter", lambda x: sc.scatter(x, "data", root=8, dim=1)),
    ],
)
def test_root_out_of_range(fn_name, fn):
    with pytest.raises(
        sc.AxisError,
        match=rf"spmdcomm.{fn_name}: root=-?\d+ is out of range for axis 'data' "
        r"of size 8\. Fix: pass a device index in \[0, 8\)",
    ):
        call(fn)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: sc.all_reduce(x, "data", op="avg"),
        lambda x: sc.reduce_scatter(x, "data", op="avg", dim=1),
        lambda x: sc.reduce(x, "data", op="avg"),
    ],
)
def test_unknown_op(fn):
    with pytest.raises(sc.SpmdError, match=r"unknown op 'avg'.*use one of \('sum', 'mean', 'max', 'min', 'prod'\)"):
        call(fn)


def test_unknown_algorithm():
    with pytest.raises(sc.SpmdError, match=r"unknown algorithm 'ring'"):
        call(lambda x: sc.psum(x, "data", algorithm="ring"))


def test_non_array_leaf_names_its_path():
    with pytest.raises(sc.SpmdError, match=r"spmdcomm.psum: leaf \['cfg'\]\['name'\]: is a str, not an array"):
        call(lambda x: sc.psum({"x": x, "cfg": {"name": "adam"}}, "data")["x"])


def test_non_array_argument_to_spmd():
    f = sc.spmd(lambda x, s: x, in_specs=(P("data"), P()), out_specs=P("data"))
    with pytest.raises(sc.SpmdError, match=r"leaf args\[1\]: argument is a str"):
        f(np.zeros(8), "hello")


@pytest.mark.parametrize(
    "perm, match",
    [
        ([(0, 1), (2, 1)], r"destination device\(s\) \[1\] appear more than once"),
        ([(0, 1), (0, 2)], r"source device\(s\) \[0\] appear more than once"),
        ([(0, 8)], r"pairs \[\(0, 8\)\] name devices outside axis 'data' of size 8"),
        ([0, 1], r"is not a sequence of \(source, destination\) pairs"),
    ],
)
def test_bad_permutation(perm, match):
    with pytest.raises(sc.AxisError, match=match):
        call(lambda x: sc.permute(x, "data", perm=perm))


def test_spmd_spec_names_unknown_mesh_axis():
    with pytest.raises(sc.AxisError, match=r"axis 'batch' is not an axis of the mesh; its axes are \('data',\)"):
        call(lambda x: x, in_specs=P("batch"))


def test_spmd_input_not_divisible_says_how_to_pad():
    with pytest.raises(sc.ShapeError) as err:
        call(lambda x: x, np.zeros((15, 2)))
    msg = str(err.value)
    assert "leaf args[0]" in msg and "dimension 0 of size 15" in msg and "axis 'data' of size 8" in msg
    assert "spmdcomm.pad_batch" in msg


def test_spmd_wrong_number_of_specs():
    f = sc.spmd(lambda a, b: a, in_specs=(P("data"),), out_specs=P("data"))
    with pytest.raises(sc.SpmdError, match="in_specs has 1 entries but the function got 2 arguments"):
        f(np.zeros(8), np.zeros(8))


def test_pmap_backend_rejects_2d_mesh():
    mesh = sc.make_mesh({"a": 4, "b": 2})
    with pytest.raises(sc.BackendError, match=r"backend='pmap' needs a 1-D mesh.*use backend='shard_map'"):
        call(lambda x: x, in_specs=P("a", "b"), out_specs=P("a", "b"), mesh=mesh, backend="pmap")


def test_pmap_backend_rejects_two_split_dims():
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    with pytest.raises(sc.BackendError, match=r"can split one dimension per argument.*use backend='shard_map'"):
        call(lambda x: x, in_specs=P("data", "data"), mesh=mesh, backend="pmap")


def test_unknown_backend():
    with pytest.raises(sc.BackendError, match=r"unknown backend 'mpi'"):
        sc.spmd(lambda x: x, in_specs=P(), out_specs=P(), backend="mpi")


@pytest.mark.parametrize(
    "axes, match",
    [
        ({"data": 3}, r"multiply to 3, but there are 8 devices"),
        ({"data": -1, "model": 3}, r"8 devices do not divide by the fixed axis sizes"),
        ({"data": -1, "model": -1}, r"at most one -1"),
        ({}, r"`axes` is empty"),
    ],
)
def test_make_mesh_bad_sizes(axes, match):
    with pytest.raises(sc.SpmdError, match=match):
        sc.make_mesh(axes)


@pytest.mark.parametrize(
    "fn, error",
    [
        (lambda x: sc.psum(x, "dat"), sc.AxisError),
        (lambda x: sc.all_gather(x, "data", dim=5), sc.ShapeError),
        (lambda x: sc.reduce(x, "data", op="avg"), sc.SpmdError),
    ],
    ids=["axis", "shape", "op"],
)
def test_bad_input_is_caught_as_value_error(fn, error):
    # Code written before spmdcomm's classes (`except ValueError`) keeps catching bad input.
    try:
        call(fn)
    except ValueError as e:
        assert type(e) is error and isinstance(e, sc.SpmdError), repr(e)
    else:
        pytest.fail("no ValueError raised")


def test_diverged_replicas_are_a_run_time_error_not_bad_input():
    # Replicas drifting apart is a failure of the run, like a barrier timeout, not a bad argument.
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    copies = [jax.device_put(np.full(3, float(i), np.float32), d) for i, d in enumerate(mesh.devices.flat)]
    w = jax.make_array_from_single_device_arrays((3,), sc.replicated_sharding(mesh=mesh), copies)
    try:
        sc.assert_replicated({"w": w})
    except ValueError as e:
        pytest.fail(f"caught as bad input: {e!r}")
    except RuntimeError as e:
        assert type(e) is sc.ReplicaDivergenceError and isinstance(e, sc.DistributedError), repr(e)
        assert "leaf ['w']: the copy on device 1 (process 0) differs" in str(e)
    else:
        pytest.fail("no RuntimeError raised")


@pytest.mark.parametrize(
    "fn_name, fn, fix",
    [
        ("all_gather", lambda x: sc.all_gather({"s": x.sum()}, "data"), "pass tiled=False"),
        ("gather", lambda x: sc.gather({"s": x.sum()}, "data"), "x[None]"),
    ],
)
def test_gather_of_a_scalar_says_how_to_fix(fn_name, fn, fix):
    with pytest.raises(sc.ShapeError) as err:
        call(fn)
    msg = str(err.value)
    assert msg.startswith(f"spmdcomm.{fn_name}: leaf ['s']: the block is 0-d"), msg
    assert "8 blocks of axis 'data'" in msg and fix in msg and "to receive shape (8,)" in msg
    assert "[0, 0)" not in msg


def test_scatter_of_a_scalar_says_it_has_no_dimension():
    with pytest.raises(
        sc.ShapeError,
        match=r"spmdcomm.scatter: leaf <root>: the block is 0-d .* over axis 'data' "
        r"of size 8\. Fix: give the value at least one dimension",
    ):
        call(lambda x: sc.scatter(x.sum(), "data"))


@pytest.mark.parametrize(
    "fn, err, match",
    [
        (lambda x: sc.scan(x, "dat"), sc.AxisError, r"spmdcomm.scan: unknown axis name 'dat'"),
        (
            lambda x: sc.scan(x, "data", op="mean"),
            sc.SpmdError,
            r"spmdcomm.scan: unknown op 'mean'.*use one of \('sum', 'max', 'min', 'prod'\)",
        ),
        (
            lambda x: sc.scan(x, "data", inclusive="yes"),
            sc.SpmdError,
            r"spmdcomm.scan: inclusive must be True or False",
        ),
        (
            lambda x: sc.scan(x.astype("complex64"), "data", op="max"),
            sc.SpmdError,
            r"spmdcomm.scan: leaf <root>: op 'max'",
        ),
    ],
)
def test_scan_validates_its_input(fn, err, match):
    with pytest.raises(err, match=match):
        call(fn)
