"""Every collective x both backends x dtypes x pytrees, against NumPy references.

Each device ``i`` gets its own block ``xs[i]``; the reference computes what each device must hold afterwards
from those blocks alone. Outputs are collected with ``out_specs=P("data")`` so every device's result is seen.

Which cases run: every collective on the shard_map backend over 1, 2, 4 and 8 devices (roots, shifts, splits and
the reduce-scatter + all-gather algorithm all depend on the device count, and 1 device is the no-communication
edge), and on the pmap backend over 4 devices (tests/conftest.py's ``BACKEND_MESHES``). Since JAX 0.10 jax.pmap
is jit(shard_map), so the pmap backend runs the same collective programs; one device count checks its own part,
moving blocks to pmap's device axis and back on a sub-mesh. Bit-exactness per dtype likewise runs every dtype on
shard_map and bfloat16 (moved as bit patterns on CPU) on pmap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import spmdcomm as sc
from spmdcomm import P

BACKENDS = ["shard_map", "pmap"]


class Pair(NamedTuple):
    a: Any
    b: Any


def make_blocks(n: int, *, bools: bool = True, seed: int = 0) -> Any:
    """Per-device blocks (leading axis = device) in a nested dict/tuple/list/NamedTuple pytree."""
    rng = np.random.default_rng(seed)
    rows = 2 * n  # divisible by n, so split-based collectives apply
    tree = {
        "f32": Pair(
            a=rng.standard_normal((n, rows, 3)).astype(np.float32),
            b=(rng.standard_normal((n, rows)).astype(ml_dtypes.bfloat16),),
        ),
        "i32": [rng.integers(-2, 3, size=(n, rows, 2)).astype(np.int32)],
    }
    if bools:
        tree["bool"] = rng.random((n, rows, 2)) > 0.3
    return tree


def run(fn: Callable[[Any], Any], blocks: Any, mesh, backend: str, axis: str = "data") -> Any:
    """Runs ``fn`` on device i's block blocks[i]; returns the per-device outputs stacked on axis 0."""
    n = mesh.size
    glob = jax.tree.map(lambda b: b.reshape((n * b.shape[1],) + b.shape[2:]), blocks)
    out = sc.spmd(fn, mesh=mesh, in_specs=P(axis), out_specs=P(axis), backend=backend)(glob)
    return jax.tree.map(lambda o: np.asarray(o).reshape((n, -1) + o.shape[1:]), out)


def check(got: Any, want: Any, *, exact: bool = False) -> None:
    paths_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
    leaves_want, tree_want = jax.tree.flatten(want)
    assert tree_got == tree_want
    for (path, g), w in zip(paths_got, leaves_want):
        name = jax.tree_util.keystr(path)
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if exact or w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w, err_msg=name)
        elif w.dtype == ml_dtypes.bfloat16 or g.dtype == ml_dtypes.bfloat16:
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=3e-2, atol=6e-2, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def per_device(blocks: Any, ref: Callable[[list[np.ndarray], int], np.ndarray]) -> Any:
    """Applies ``ref(xs, i)`` (xs: the list of every device's block) for every device i; stacks results."""

    def leaf(b: np.ndarray) -> np.ndarray:
        xs = [b[i] for i in range(b.shape[0])]
        return np.stack([np.asarray(ref(xs, i)) for i in range(len(xs))])

    return jax.tree.map(leaf, blocks)


def f32_sum(xs: list[np.ndarray]) -> np.ndarray:
    acc = np.sum(
        [x.astype(np.float64) if x.dtype.kind == "f" or x.dtype == ml_dtypes.bfloat16 else x for x in xs], axis=0
    )
    if xs[0].dtype == np.bool_:
        return acc.astype(np.int32)
    return acc.astype(xs[0].dtype)


def np_reduce(op: str, xs: list[np.ndarray]) -> np.ndarray:
    n = len(xs)
    if op == "sum":
        return f32_sum(xs)
    if op == "mean":
        return f32_sum(xs).astype(np.float32 if xs[0].dtype.kind in "biu" else xs[0].dtype) / n
    stack = np.stack(xs)
    if op == "max":
        return stack.max(0)
    if op == "min":
        return stack.min(0)
    if stack.dtype == np.bool_:
        return stack.all(0)
    return np.prod(stack.astype(np.float64) if stack.dtype == ml_dtypes.bfloat16 else stack, axis=0).astype(stack.dtype)


def zeros_like(x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)


def split(x: np.ndarray, n: int, dim: int) -> list[np.ndarray]:
    return np.split(x, n, axis=dim)


# (name, spmdcomm call, reference, exact?) — the table every backend and device count runs through.
CASES: list[tuple[str, Callable[[Any], Any], Callable[[list[np.ndarray], int], np.ndarray], bool]] = [
    ("psum", lambda x: sc.psum(x, "data"), lambda xs, i: np_reduce("sum", xs), False),
    ("psum_rs_ag", lambda x: sc.psum(x, "data", algorithm="rs_ag"), lambda xs, i: np_reduce("sum", xs), False),
    ("pmean", lambda x: sc.pmean(x, "data"), lambda xs, i: np_reduce("mean", xs), False),
    ("pmax", lambda x: sc.pmax(x, "data"), lambda xs, i: np_reduce("max", xs), True),
    ("pmin", lambda x: sc.pmin(x, "data"), lambda xs, i: np_reduce("min", xs), True),
    ("all_reduce_prod", lambda x: sc.all_reduce(x, "data", op="prod"), lambda xs, i: np_reduce("prod", xs), False),
    (
        "all_reduce_mean_rs_ag",
        lambda x: sc.all_reduce(x, "data", op="mean", algorithm="rs_ag"),
        lambda xs, i: np_reduce("mean", xs),
        False,
    ),
    ("all_gather", lambda x: sc.all_gather(x, "data"), lambda xs, i: np.concatenate(xs, 0), True),
    ("all_gather_dim1", lambda x: sc.all_gather(x, "data", dim=-1), lambda xs, i: np.concatenate(xs, -1), True),
    ("all_gather_untiled", lambda x: sc.all_gather(x, "data", dim=1, tiled=False), lambda xs, i: np.stack(xs, 1), True),
    (
        "reduce_scatter",
        lambda x: sc.reduce_scatter(x, "data"),
        lambda xs, i: split(np_reduce("sum", xs), len(xs), 0)[i],
        False,
    ),
    (
        "reduce_scatter_mean",
        lambda x: sc.reduce_scatter(x, "data", op="mean"),
        lambda xs, i: split(np_reduce("mean", xs), len(xs), 0)[i],
        False,
    ),
    (
        "reduce_scatter_max",
        lambda x: sc.reduce_scatter(x, "data", op="max"),
        lambda xs, i: split(np_reduce("max", xs), len(xs), 0)[i],
        True,
    ),
    (
        "reduce_scatter_min",
        lambda x: sc.reduce_scatter(x, "data", op="min"),
        lambda xs, i: split(np_reduce("min", xs), len(xs), 0)[i],
        True,
    ),
    (
        "reduce_scatter_prod",
        lambda x: sc.reduce_scatter(x, "data", op="prod"),
        lambda xs, i: split(np_reduce("prod", xs), len(xs), 0)[i],
        False,
    ),
    (
        "all_to_all",
        lambda x: sc.all_to_all(x, "data", split_dim=0, concat_dim=0),
        lambda xs, i: np.concatenate([split(x, len(xs), 0)[i] for x in xs], 0),
        True,
    ),
    (
        "all_to_all_1_0",
        lambda x: sc.all_to_all(
            jax.tree.map(lambda v: v.reshape(v.shape[0] // axis_n(), axis_n(), *v.shape[1:]), x),
            "data",
            split_dim=1,
            concat_dim=0,
        ),
        lambda xs, i: np.concatenate(
            [split(x.reshape(x.shape[0] // len(xs), len(xs), *x.shape[1:]), len(xs), 1)[i] for x in xs], 0
        ),
        True,
    ),
    ("broadcast_root0", lambda x: sc.broadcast(x, "data"), lambda xs, i: xs[0], True),
    ("broadcast_rootlast", lambda x: sc.broadcast(x, "data", root=axis_n() - 1), lambda xs, i: xs[-1], True),
    (
        "reduce",
        lambda x: sc.reduce(x, "data", root=axis_n() // 2),
        lambda xs, i: np_reduce("sum", xs) if i == len(xs) // 2 else xs[i].astype(np_reduce("sum", xs).dtype),
        False,
    ),
    (
        "reduce_max",
        lambda x: sc.reduce(x, "data", op="max"),
        lambda xs, i: np_reduce("max", xs) if i == 0 else xs[i],
        True,
    ),
    (
        "gather",
        lambda x: sc.gather(x, "data", root=axis_n() - 1),
        lambda xs, i: np.concatenate(xs, 0) if i == len(xs) - 1 else zeros_like(np.concatenate(xs, 0)),
        True,
    ),
    ("scatter", lambda x: sc.scatter(x, "data", root=axis_n() - 1), lambda xs, i: split(xs[-1], len(xs), 0)[i], True),
    (
        "scatter_dim1",
        lambda x: sc.scatter(
            jax.tree.map(lambda v: v.reshape(v.shape[0] // axis_n(), axis_n(), *v.shape[1:]), x), "data", dim=1
        ),
        lambda xs, i: split(xs[0].reshape(xs[0].shape[0] // len(xs), len(xs), *xs[0].shape[1:]), len(xs), 1)[i],
        True,
    ),
    ("shift", lambda x: sc.shift(x, "data", offset=1), lambda xs, i: xs[(i - 1) % len(xs)], True),
    ("shift_back2", lambda x: sc.shift(x, "data", offset=-2), lambda xs, i: xs[(i + 2) % len(xs)], True),
    (
        "permute_swap01",
        lambda x: sc.permute(x, "data", perm=[(0, 1), (1, 0)] if axis_n() > 1 else [(0, 0)]),
        lambda xs, i: xs[1 - i] if (len(xs) > 1 and i < 2) else (xs[0] if len(xs) == 1 else zeros_like(xs[i])),
        True,
    ),
    (
        "axis_index",
        lambda x: jax.tree.map(lambda v: jnp.full(v.shape, sc.axis_index("data"), jnp.int32), x),
        lambda xs, i: np.full(xs[i].shape, i, np.int32),
        True,
    ),
    (
        "axis_size",
        lambda x: jax.tree.map(lambda v: jnp.full(v.shape, sc.axis_size("data"), jnp.int32), x),
        lambda xs, i: np.full(xs[i].shape, len(xs), np.int32),
        True,
    ),
]


def axis_n() -> int:
    return lax.axis_size("data")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_collective_matches_numpy(case, backend_mesh):
    name, fn, ref, exact = case
    backend, mesh = backend_mesh
    blocks = make_blocks(mesh.size)
    got = run(fn, blocks, mesh, backend)
    check(got, per_device(blocks, ref), exact=exact)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prod_is_exact_with_zeros_and_negatives(backend):
    mesh = sc.data_mesh()
    x = np.array(
        [
            [-1.5, 0.0, 2.0],
            [-2.0, 3.0, -0.5],
            [1.0, 1.0, 1.0],
            [2.0, -1.0, 4.0],
            [-1.0, 2.0, 0.5],
            [0.5, 1.0, -2.0],
            [1.0, -3.0, 1.0],
            [-4.0, 1.0, 2.0],
        ],
        np.float32,
    )
    got = sc.spmd(
        lambda v: sc.all_reduce(v, "data", op="prod"), mesh=mesh, in_specs=P("data"), out_specs=P(), backend=backend
    )(x)
    np.testing.assert_array_equal(np.asarray(got)[0], np.prod(x, axis=0))
    assert np.asarray(got)[0, 1] == 0.0


def test_bool_reductions_follow_lax():
    mesh = sc.data_mesh()
    x = np.array([True, False, True, True, False, True, True, True])
    f = sc.spmd(
        lambda v: (sc.psum(v, "data"), sc.pmax(v, "data"), sc.pmin(v, "data"), sc.all_reduce(v, "data", op="prod")),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    total, anyv, allv, prod = f(x)
    assert total.dtype == jnp.int32 and int(total[0]) == 6
    assert anyv.dtype == jnp.bool_ and bool(anyv[0]) and not bool(allv[0]) and not bool(prod[0])


def test_reduce_scatter_textbook_case():
    """torch.distributed.reduce_scatter: 4 devices each holding [0, 1, 2, 3] give device r the value 4*r."""
    mesh = sc.data_mesh(devices=jax.devices()[:4])
    for backend in BACKENDS:
        out = sc.spmd(
            lambda x: sc.reduce_scatter(x, "data"), mesh=mesh, in_specs=P(), out_specs=P("data"), backend=backend
        )(np.arange(4, dtype=np.int32))
        assert np.asarray(out).tolist() == [0, 4, 8, 12]
        assert [s.data.tolist() for s in sorted(out.addressable_shards, key=lambda s: s.index)] == [[0], [4], [8], [12]]


def test_rooted_collectives_move_exact_bits():
    """broadcast/scatter deliver NaN payloads, infinities and -0.0 bit for bit (no arithmetic on values)."""
    mesh = sc.data_mesh()
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.0, -7.5, 0.0], np.float32)
    special[0] = np.frombuffer(np.uint32(0x7FC01234).tobytes(), np.float32)[0]  # NaN with a payload
    x = np.tile(special, (mesh.size, 1))
    x[1:] = 123.0  # non-root blocks must not leak in
    out = sc.spmd(
        lambda v: (sc.broadcast(v, "data"), sc.scatter(v, "data", dim=1)),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )(x)
    bits = lambda a: np.asarray(a).view(np.uint32)  # noqa: E731
    np.testing.assert_array_equal(bits(out[0]), np.tile(bits(special), (mesh.size, 1)))
    np.testing.assert_array_equal(bits(out[1]).reshape(-1), bits(special))


def test_complex_broadcast_is_exact():
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    x = np.array([[1 + 2j, -0.0 - 3j], [5 + 5j, 6 + 6j]], np.complex64)
    out = sc.spmd(lambda v: sc.broadcast(v, "data", root=1), mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)
    np.testing.assert_array_equal(np.asarray(out), np.stack([x[1], x[1]]))


# ---------------------------------------------------------------------------------------------------------
# Multi-axis meshes


MULTI_CASES = [
    ("psum", lambda x, ax: sc.psum(x, ax), lambda g: np.broadcast_to(g.sum(1, keepdims=True), g.shape)),
    ("pmax", lambda x, ax: sc.pmax(x, ax), lambda g: np.broadcast_to(g.max(1, keepdims=True), g.shape)),
    (
        "prod",
        lambda x, ax: sc.all_reduce(x, ax, op="prod"),
        lambda g: np.broadcast_to(g.prod(1, keepdims=True), g.shape),
    ),
    ("broadcast", lambda x, ax: sc.broadcast(x, ax, root=1), lambda g: np.broadcast_to(g[:, 1:2], g.shape)),
    ("shift", lambda x, ax: sc.shift(x, ax, offset=1), lambda g: np.roll(g, 1, axis=1)),
]


@pytest.mark.parametrize("axes", [("a", "b"), "b", "a"], ids=["ab", "b", "a"])
@pytest.mark.parametrize("case", MULTI_CASES, ids=[c[0] for c in MULTI_CASES])
def test_multi_axis_mesh(case, axes):
    """On a 4x2 mesh, a collective over one axis acts within groups; over ("a", "b") over all 8 devices."""
    name, fn, ref = case
    mesh = sc.make_mesh({"a": 4, "b": 2})
    rng = np.random.default_rng(1)
    blocks = rng.integers(-3, 4, size=(4, 2, 3)).astype(np.int32)  # block of device (a, b)
    out = sc.spmd(lambda x: fn(x, axes), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))(
        blocks.reshape(4, 2 * 3)
    )
    got = np.asarray(out).reshape(4, 2, 3)
    # Rearrange so the reduced axes form axis 1 of a (groups, members, 3) array, in row-major member order.
    if axes == ("a", "b"):
        g = blocks.reshape(1, 8, 3)
        want = ref(g).reshape(4, 2, 3)
    elif axes == "b":
        want = ref(blocks)
    else:
        want = ref(blocks.transpose(1, 0, 2)).transpose(1, 0, 2)
    np.testing.assert_array_equal(got, want)


def test_multi_axis_reduce_scatter_and_all_gather_roundtrip():
    mesh = sc.make_mesh({"a": 4, "b": 2})
    x = np.arange(8 * 16, dtype=np.float32).reshape(8 * 16)

    def f(v):
        part = sc.reduce_scatter(v, ("a", "b"))
        return sc.all_gather(part, ("a", "b"))

    out = sc.spmd(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")))(x)
    blocks = x.reshape(8, 16)
    np.testing.assert_allclose(np.asarray(out).reshape(8, 16), np.tile(blocks.sum(0), (8, 1)))


# ---------------------------------------------------------------------------------------------------------
# Raw jax.shard_map and raw jax.pmap


def test_usable_in_raw_shard_map():
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(np.arange(16.0, dtype=np.float32), jax.sharding.NamedSharding(mesh, P("i")))
    f = jax.jit(
        jax.shard_map(
            lambda v: (sc.psum(v, "i"), sc.all_gather(v, "i"), sc.broadcast(v, "i", root=2)),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=(P(), P(), P()),
        )
    )
    total, gathered, bcast = f(x)
    np.testing.assert_allclose(total, np.arange(16.0).reshape(8, 2).sum(0))
    np.testing.assert_array_equal(gathered, np.arange(16.0))
    np.testing.assert_array_equal(bcast, [4.0, 5.0])


def test_usable_in_raw_pmap():
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    out = jax.pmap(
        lambda v: (
            sc.pmean(v, "i"),
            sc.shift(v, "i", offset=1),
            sc.all_gather(v, "i"),
        ),
        axis_name="i",
    )(x)
    np.testing.assert_allclose(out[0][3], x.mean(0))
    np.testing.assert_array_equal(out[1], np.roll(x, 1, axis=0))
    np.testing.assert_array_equal(out[2][5], x.reshape(-1))


def test_pmap_backend_matches_shard_map_on_2d_blocks():
    mesh = sc.data_mesh(devices=jax.devices()[:4])
    x = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)  # split along dimension 1

    def f(v):
        return sc.all_to_all(v, "data", split_dim=0, concat_dim=1), sc.psum(v, "data")

    outs = [
        sc.spmd(f, mesh=mesh, in_specs=P(None, "data"), out_specs=(P(None, "data"), P()), backend=b)(x)
        for b in BACKENDS
    ]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_large_broadcast_is_exact():
    """At 4 MiB per device broadcast switches algorithm; the root's bits still arrive unchanged."""
    rows = 2**20
    x = np.full((8, rows), 7.0, np.float32)
    x[2] = np.random.default_rng(0).standard_normal(rows).astype(np.float32)
    x[2, :3] = [-0.0, 1e-45, np.nan]
    out = sc.spmd(lambda v: sc.broadcast(v, "data", root=2), in_specs=P("data"), out_specs=P("data"))(x)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.tile(x[2].view(np.uint32), (8, 1)))


# ---------------------------------------------------------------------------------------------------------
# Rooted collectives deliver every dtype bit for bit


def special_bits(dtype, n: int, width: int = 8) -> np.ndarray:
    """(n, width) blocks: row 0 holds -0.0, denormals, infinities and NaNs with payloads; others random bits."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(7)
    if dt.kind == "b":
        return rng.random((n, width)) > 0.5
    if dt.kind in "iu":
        return rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, size=(n, width), dtype=dt, endpoint=True)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize]
    raw = rng.integers(0, np.iinfo(bits).max, size=(n, width), dtype=bits, endpoint=True)
    exp_bits = {"bfloat16": 8, "float16": 5, "float32": 8, "float64": 11}[dt.name]
    mant = 8 * dt.itemsize - 1 - exp_bits
    sign, exp_all = bits(1) << bits(8 * dt.itemsize - 1), ((bits(1) << bits(exp_bits)) - bits(1)) << bits(mant)
    quiet = bits(1) << bits(mant - 1)
    row = [
        sign,  # -0.0
        bits(1),
        bits(3) | sign,  # denormals
        exp_all,
        exp_all | sign,  # +-inf
        exp_all | quiet | bits(1),  # quiet NaN with payload 1
        exp_all | quiet | bits(5) | sign,  # negative NaN with a payload
        bits(0),
    ]
    raw[0, : len(row)] = row
    return raw.view(dt)


EXACT_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.int8, np.uint8, np.bool_]
ROOTED = [
    ("broadcast", lambda v, r: sc.broadcast(v, "data", root=r), lambda xs, r, i: xs[r]),
    (
        "broadcast_split",
        lambda v, r: sc.collectives.rooted._broadcast_leaf(v, "data", r, sc.axis_size("data"), split=True),
        lambda xs, r, i: xs[r],
    ),
    (
        "scatter",
        lambda v, r: sc.scatter(v, "data", root=r, dim=1),
        lambda xs, r, i: np.split(xs[r], len(xs), axis=1)[i],
    ),
    (
        "gather",
        lambda v, r: sc.gather(v, "data", root=r, dim=1),
        lambda xs, r, i: np.concatenate(xs, 1) if i == r else np.zeros_like(np.concatenate(xs, 1)),
    ),
    ("all_gather", lambda v, r: sc.all_gather(v, "data", dim=1), lambda xs, r, i: np.concatenate(xs, 1)),
    (
        "reduce_max_nonroot",
        lambda v, r: sc.reduce(v, "data", root=r, op="max"),
        lambda xs, r, i: np.max(np.stack(xs), 0) if i == r else xs[i],
    ),
]


@pytest.mark.parametrize(
    "dtype, backend",
    [(dtype, "shard_map") for dtype in EXACT_DTYPES] + [(ml_dtypes.bfloat16, "pmap")],
    ids=lambda p: p if isinstance(p, str) else np.dtype(p).name,
)
def test_rooted_collectives_are_bitwise_exact(dtype, backend):
    mesh = sc.data_mesh(devices=jax.devices()[:4])
    blocks = np.stack([special_bits(dtype, 4)[(i + 2) % 4] for i in range(4)])  # the specials live on device 2
    # The float max over random bit patterns (NaNs included) is not the point: reduce is checked on integers.
    floating = jnp.issubdtype(dtype, jnp.floating)
    ids = [name for name, *_ in ROOTED if not (name == "reduce_max_nonroot" and floating)]
    fns = {name: fn for name, fn, _ in ROOTED if name in ids}
    out = sc.spmd(
        lambda v: {k: f(v, 2) for k, f in fns.items()},
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        backend=backend,
    )(blocks)
    raw = (lambda a: np.asarray(a).view(np.uint8)) if np.dtype(dtype).kind != "b" else np.asarray  # noqa: E731
    xs = [b[None] for b in blocks]  # device i's block, shape (1, 8)
    for name, _, ref in ROOTED:
        if name not in fns:
            continue
        want = np.concatenate([ref(xs, 2, i) for i in range(4)])
        assert np.asarray(out[name]).dtype == want.dtype, name
        np.testing.assert_array_equal(raw(out[name]), raw(want), err_msg=f"{name} {np.dtype(dtype).name}")


def test_float64_rooted_collectives_are_bitwise_exact():
    with jax.enable_x64(True):
        mesh = sc.data_mesh(devices=jax.devices()[:2])
        blocks = special_bits(np.float64, 2)[::-1].copy()  # specials on device 1
        out = sc.spmd(
            lambda v: (sc.broadcast(v, "data", root=1), sc.gather(v, "data", root=1)),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )(blocks)
        assert out[0].dtype == np.float64
        np.testing.assert_array_equal(np.asarray(out[0]).view(np.uint64), np.tile(blocks[1:].view(np.uint64), (2, 1)))
        np.testing.assert_array_equal(np.asarray(out[1])[2:].view(np.uint64), blocks.view(np.uint64))  # root: 1


# ---------------------------------------------------------------------------------------------------------
# Python scalars


SCALAR_CASES = [
    ("psum", lambda: sc.psum(3, "data"), lambda n, i: 3 * n),
    ("pmean", lambda: sc.pmean(2.5, "data"), lambda n, i: 2.5),
    ("pmax", lambda: sc.pmax(3.5, "data"), lambda n, i: 3.5),
    ("pmin", lambda: sc.pmin(-1, "data"), lambda n, i: -1),
    ("all_reduce_prod", lambda: sc.all_reduce(2, "data", op="prod"), lambda n, i: 2**n),
    ("all_gather_untiled", lambda: sc.all_gather(1.5, "data", tiled=False), lambda n, i: [1.5] * n),
    ("broadcast", lambda: sc.broadcast(3, "data", root=1), lambda n, i: 3),
    ("reduce", lambda: sc.reduce(3, "data", root=0), lambda n, i: 3 * n if i == 0 else 3),
    ("reduce_max", lambda: sc.reduce(True, "data", root=1, op="max"), lambda n, i: True),
    ("permute", lambda: sc.permute(3.0, "data", perm=[(0, 1)]), lambda n, i: 3.0 if i == 1 else 0.0),
    ("shift", lambda: sc.shift(7, "data", offset=1), lambda n, i: 7),
    ("scan", lambda: sc.scan(2, "data"), lambda n, i: 2 * (i + 1)),
]


@pytest.mark.parametrize("name, fn, want", SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
def test_python_scalars(name, fn, want):
    mesh = sc.data_mesh(devices=jax.devices()[:4])
    out = sc.spmd(lambda _: jnp.asarray(fn())[None], mesh=mesh, in_specs=P("data"), out_specs=P("data"))(np.zeros(4))
    np.testing.assert_allclose(np.asarray(out).tolist(), [want(4, i) for i in range(4)])


# ---------------------------------------------------------------------------------------------------------
# One rule for op, root and device indices; options are keyword-only

ROOT_CASES = [  # name, call with root r, what device i holds afterwards (NumPy, from the blocks xs)
    ("broadcast", lambda x, r: sc.broadcast(x, "data", root=r), lambda xs, i, r: xs[r]),
    ("reduce", lambda x, r: sc.reduce(x, "data", root=r), lambda xs, i, r: xs.sum(0) if i == r else xs[i]),
    (
        "gather",
        lambda x, r: sc.gather(x, "data", root=r),
        lambda xs, i, r: np.concatenate(xs) if i == r else np.zeros((len(xs) * xs.shape[1],), xs.dtype),
    ),
    ("scatter", lambda x, r: sc.scatter(x, "data", root=r), lambda xs, i, r: np.split(xs[r], len(xs))[i]),
]
OP_CASES = [  # name, call with op, the ops it accepts
    ("all_reduce", lambda x, op: sc.all_reduce(x, "data", op=op), sc.collectives.REDUCE_OPS),
    ("reduce_scatter", lambda x, op: sc.reduce_scatter(x, "data", op=op), sc.collectives.REDUCE_OPS),
    ("reduce", lambda x, op: sc.reduce(x, "data", op=op), sc.collectives.REDUCE_OPS),
    ("scan", lambda x, op: sc.scan(x, "data", op=op), sc.collectives.SCAN_OPS),
]


def _on_all_devices(fn: Callable[[Any], Any], xs: np.ndarray) -> np.ndarray:
    mesh = sc.data_mesh()
    return run(fn, xs, mesh, "shard_map")


@pytest.mark.parametrize("name, fn, ref", ROOT_CASES, ids=[c[0] for c in ROOT_CASES])
def test_numpy_integer_root_is_accepted(name, fn, ref):
    n = jax.device_count()
    xs = np.arange(n * n, dtype=np.float32).reshape(n, n)
    root = np.int64(n - 1)  # e.g. from np.argmax
    got = _on_all_devices(lambda x: fn(x, root), xs)
    np.testing.assert_array_equal(got, np.stack([ref(xs, i, n - 1) for i in range(n)]))


@pytest.mark.parametrize("name, fn, ref", ROOT_CASES, ids=[c[0] for c in ROOT_CASES])
@pytest.mark.parametrize(
    "root, why",
    [(True, "is a bool, not a device index"), (np.True_, "is a bool"), (1.0, "is a float"), ("0", "is a str")]
    + [("n", "is out of range for axis 'data'"), (-1, "is out of range for axis 'data'")],
    ids=["True", "np.True_", "float", "str", "n", "-1"],
)
def test_bad_root_is_named_with_the_range(name, fn, ref, root, why):
    n = jax.device_count()
    root = n if root == "n" else root
    with pytest.raises(sc.AxisError) as err:
        _on_all_devices(lambda x: fn(x, root), np.zeros((n, n), np.float32))
    msg = str(err.value)
    assert msg.startswith(f"spmdcomm.{name}: root={root!r} {why}"), msg
    assert f"of size {n}" in msg and f"Fix: pass a device index in [0, {n})." in msg


@pytest.mark.parametrize("name, fn, allowed", OP_CASES, ids=[c[0] for c in OP_CASES])
@pytest.mark.parametrize("op", ["avg", "SUM", None, ("sum",)], ids=["avg", "SUM", "None", "tuple"])
def test_unknown_op_lists_the_allowed_ops(name, fn, allowed, op):
    n = jax.device_count()
    with pytest.raises(sc.SpmdError) as err:
        _on_all_devices(lambda x: fn(x, op), np.zeros((n, n), np.float32))
    assert str(err.value) == f"spmdcomm.{name}: unknown op {op!r}. Fix: use one of {allowed}."


def test_scan_refuses_mean_which_all_reduce_accepts():
    assert "mean" in sc.collectives.REDUCE_OPS and "mean" not in sc.collectives.SCAN_OPS
    n = jax.device_count()
    with pytest.raises(sc.SpmdError, match=r"spmdcomm.scan: unknown op 'mean'"):
        _on_all_devices(lambda x: sc.scan(x, "data", op="mean"), np.zeros((n, 1), np.float32))


def test_device_indices_of_shift_and_permute_follow_the_root_rule():
    n = jax.device_count()
    xs = np.arange(1, n + 1, dtype=np.float32).reshape(n, 1)
    got = _on_all_devices(lambda x: sc.shift(x, "data", offset=np.int64(-2)), xs)
    np.testing.assert_array_equal(got, np.roll(xs, -2, axis=0))
    got = _on_all_devices(lambda x: sc.permute(x, "data", perm=[(np.int64(0), np.int32(n - 1))]), xs)
    np.testing.assert_array_equal(got[:, 0], [0.0] * (n - 1) + [1.0])
    for offset, kind in ((True, "bool"), (1.0, "float")):
        with pytest.raises(sc.SpmdError, match=rf"spmdcomm.shift: offset={offset!r} is a {kind}, not an int"):
            _on_all_devices(lambda x, o=offset: sc.shift(x, "data", offset=o), xs)
    for perm in ([(0, 1.5)], [(True, 0)], [(0,)], 3):
        with pytest.raises(sc.AxisError, match=r"spmdcomm.permute: perm=.* integer device indices"):
            _on_all_devices(lambda x, p=perm: sc.permute(x, "data", perm=p), xs)
    with pytest.raises(sc.ShapeError, match=r"spmdcomm.all_gather: leaf <root>: dim=True is out of range"):
        _on_all_devices(lambda x: sc.all_gather(x, "data", dim=True), xs)


def test_process_root_raises_spmd_error_not_axis_error():
    from spmdcomm._ops import check_root

    assert check_root("host_broadcast", np.int64(1), 2, what="process") == 1
    with pytest.raises(sc.SpmdError) as err:
        check_root("host_broadcast", 2, 2, what="process")
    assert not isinstance(err.value, sc.AxisError)
    assert str(err.value) == (
        "spmdcomm.host_broadcast: root=2 is out of range for a job of 2 process(es). "
        "Fix: pass a process index in [0, 2)."
    )


X = np.zeros(8, np.float32)


@pytest.mark.parametrize(
    "call",
    [
        lambda: sc.all_reduce(X, "data", "max"),
        lambda: sc.psum(X, "data", "native"),
        lambda: sc.reduce_scatter(X, "data", 0),
        lambda: sc.all_gather(X, "data", 0),
        lambda: sc.all_to_all(X, "data", 0, 0),
        lambda: sc.broadcast(X, "data", 0),
        lambda: sc.reduce(X, "data", 0),
        lambda: sc.gather(X, "data", 0),
        lambda: sc.scatter(X, "data", 0),
        lambda: sc.scan(X, "data", "max"),
        lambda: sc.shift(X, "data", 1),
        lambda: sc.permute(X, "data", [(0, 1)]),
        lambda: sc.data_mesh("data"),
        lambda: sc.make_mesh({"data": -1}, jax.devices()),
        lambda: sc.data_sharding(sc.data_mesh()),
        lambda: sc.replicated_sharding(sc.data_mesh()),
    ],
    ids=lambda c: c.__code__.co_names[1],
)
def test_options_are_keyword_only(call):
    with pytest.raises(TypeError, match=r"positional argument"):
        call()


def test_mesh_options_by_name():
    mesh = sc.data_mesh(axis="batch", devices=jax.devices()[:2])
    assert dict(mesh.shape) == {"batch": 2}
    assert sc.make_mesh({"batch": -1}, devices=jax.devices()[:2]).devices.tolist() == mesh.devices.tolist()
    assert sc.data_sharding(mesh=mesh, axis="batch").spec == P("batch")
    assert sc.replicated_sharding(mesh=mesh).spec == P() and sc.replicated_sharding(mesh=mesh).mesh == mesh
    with pytest.raises(sc.AxisError, match=r"spmdcomm.data_sharding: axis 'data' is not an axis of the mesh"):
        sc.data_sharding(mesh=mesh)
