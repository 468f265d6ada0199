"""Pytree-aware SPMD collectives with torch.distributed names.

Call these inside :func:`spmdcomm.spmd`, raw ``jax.shard_map`` or raw ``jax.pmap``. Each takes a pytree of
arrays and an axis name, or a tuple of axis names (the axes then act as one axis whose device index is
row-major over them, as in ``jax.lax.axis_index``). Shapes below are per-device block shapes, and ``n`` is the
size of the axis (the product of the sizes for a tuple).

Every function validates its input before calling ``jax.lax``: an unknown axis, a dimension the axis size does
not divide, a ``root`` out of range, an unknown op, a non-array leaf or a bad permutation raise an
:class:`~spmdcomm.errors.SpmdError` subclass naming the function, the leaf path, the axis and the sizes.

The rooted collectives (``broadcast``, ``reduce``, ``gather``, ``scatter``) have no CPU kernels in ``jax.lax``
(``pbroadcast`` does not lower on CPU) or no ``lax`` counterpart at all; they are built from all-reduce,
reduce-scatter and all-gather so that they run on every backend, and they move bit patterns, not sums, so
the values they deliver are exact (NaN payloads and ``-0.0`` included).

>>> import jax, jax.numpy as jnp, numpy as np
>>> import spmdcomm as sc
>>> f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
>>> f(np.arange(8.0))
Array([28.], dtype=float32)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm.errors import AxisError, ReplicatedReductionWarning, ShapeError, SpmdError, describe

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
    "shift",
    "axis_index",
    "axis_size",
    "REDUCE_OPS",
    "RS_AG_MIN_BYTES",
]

AxisName = str | tuple[str, ...]
ReduceOp = Literal["sum", "mean", "max", "min", "prod"]
Algorithm = Literal["auto", "native", "rs_ag"]

REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")

# all_reduce(algorithm="auto") switches a leaf to reduce-scatter + all-gather from this many bytes per device
# on, on CPU only (benchmarks/collectives.py measured it faster than XLA:CPU's all-reduce there; on GPU and
# TPU the native all-reduce is already a ring/tree algorithm, so "auto" keeps it).
RS_AG_MIN_BYTES = 4 * 2**20


def psum(x: Any, axis: AxisName, *, algorithm: Algorithm = "auto") -> Any:
    """Sum of ``x`` over the devices of ``axis``; every device receives the sum.

    Output shape: the input shape. Booleans are counted as ``int32`` (as ``jax.lax.psum`` does); integers
    wrap on overflow. ``algorithm`` chooses how: ``"native"`` is ``jax.lax.psum``; ``"rs_ag"`` is a
    reduce-scatter followed by an all-gather; ``"auto"`` takes ``"rs_ag"`` for leaves of at least
    :data:`RS_AG_MIN_BYTES` on CPU and ``"native"`` otherwise.

    A value that is already identical on every device of ``axis`` is multiplied by ``n``. Inside
    ``shard_map`` with ``check_vma=True`` (the default), spmdcomm sees this and warns with
    :class:`~spmdcomm.errors.ReplicatedReductionWarning`; ``psum(1, axis)`` (counting devices) never warns.

    >>> f = sc.spmd(lambda x: sc.psum({"a": x, "b": 2 * x}, "data"),
    ...             in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.ones(8))["b"]
    Array([16.], dtype=float32)
    """
    return all_reduce(x, axis, "sum", algorithm=algorithm, _fn="psum")


def pmean(x: Any, axis: AxisName, *, algorithm: Algorithm = "auto") -> Any:
    """Mean of ``x`` over the devices of ``axis`` (the sum divided by ``n``); every device receives it.

    Output shape and dtype: those of ``jax.lax.pmean`` (integers give floats). Warns like :func:`psum` when
    the value is already replicated over ``axis``, where a mean is a no-op (see the gradient trap in
    :class:`~spmdcomm.errors.ReplicatedReductionWarning`).

    >>> sc.spmd(lambda x: sc.pmean(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
    Array([3.5], dtype=float32)
    """
    return all_reduce(x, axis, "mean", algorithm=algorithm, _fn="pmean")


def pmax(x: Any, axis: AxisName) -> Any:
    """Element-wise maximum of ``x`` over the devices of ``axis``; every device receives it.

    >>> sc.spmd(lambda x: sc.pmax(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
    Array([7.], dtype=float32)
    """
    return all_reduce(x, axis, "max", _fn="pmax")


def pmin(x: Any, axis: AxisName) -> Any:
    """Element-wise minimum of ``x`` over the devices of ``axis``; every device receives it.

    >>> sc.spmd(lambda x: sc.pmin(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
    Array([0.], dtype=float32)
    """
    return all_reduce(x, axis, "min", _fn="pmin")


def all_reduce(
    x: Any, axis: AxisName, op: ReduceOp = "sum", *, algorithm: Algorithm = "auto", _fn: str = "all_reduce"
) -> Any:
    """``torch.distributed.all_reduce``: the element-wise ``op`` over all devices of ``axis``, on every device.

    ``op`` is one of ``"sum"``, ``"mean"``, ``"max"``, ``"min"``, ``"prod"``. Output shape: the input shape.
    ``"prod"`` has no ``jax.lax`` primitive: each device gathers the ``n`` blocks and multiplies them in device
    order, which is exact for integers, zeros and negative numbers and bitwise identical on every device
    (booleans give their logical AND). ``algorithm`` applies to ``"sum"`` and ``"mean"`` (see :func:`psum`).

    >>> f = sc.spmd(lambda x: sc.all_reduce(x, "data", "prod"), in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.array([1, -2, 3, 1, 1, -1, 2, 1]))
    Array([12], dtype=int32)
    """
    if op not in REDUCE_OPS:
        raise SpmdError(describe(_fn, f"unknown op {op!r}.", fix=f"use one of {REDUCE_OPS}."))
    if algorithm not in ("auto", "native", "rs_ag"):
        raise SpmdError(describe(
            _fn, f"unknown algorithm {algorithm!r}.", fix='use "auto", "native" or "rs_ag".'))
    n = _axis_size(_fn, axis)
    leaves, treedef = _leaves(_fn, x)
    if op in ("sum", "mean"):
        _warn_if_replicated(_fn, leaves, axis, op)
    out = []
    for _, leaf in leaves:
        if op in ("sum", "mean") and _use_rs_ag(leaf, algorithm, n):
            total = _rs_ag_sum(leaf, axis, n)
            out.append(total if op == "sum" else _mean_from_sum(total, n))
        elif op == "sum":
            out.append(lax.psum(leaf, axis))
        elif op == "mean":
            out.append(lax.pmean(leaf, axis))
        elif op == "max":
            out.append(lax.pmax(leaf, axis))
        elif op == "min":
            out.append(lax.pmin(leaf, axis))
        else:
            out.append(_prod(lax.all_gather(jnp.asarray(leaf), axis, axis=0, tiled=False,
                                            to="invarying"), axis=0))
    return jax.tree.unflatten(treedef, out)


def all_gather(x: Any, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> Any:
    """Every device receives the blocks of all devices of ``axis``, in device order.

    With ``tiled=True`` the blocks are concatenated along ``dim`` (output dimension ``dim`` is ``n`` times
    larger, as ``torch.distributed.all_gather_into_tensor``); with ``tiled=False`` they are stacked along a new
    dimension ``dim`` of size ``n``.

    >>> f = sc.spmd(lambda x: sc.all_gather(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.arange(8)).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    _axis_size("all_gather", axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        d = _dim("all_gather", path, leaf, dim, extra=0 if tiled else 1)
        return lax.all_gather(leaf, axis, axis=d, tiled=tiled, to="invarying")

    return _map("all_gather", one, x)


def reduce_scatter(
    x: Any, axis: AxisName, *, dim: int = 0, op: ReduceOp = "sum", tiled: bool = True
) -> Any:
    """``torch.distributed.reduce_scatter``: reduce every device's input element-wise, then split it.

    The reduction over all devices of ``axis`` is split along ``dim`` into ``n`` equal chunks, and device ``i``
    receives chunk ``i``. With ``tiled=True`` output dimension ``dim`` is ``n`` times smaller; with
    ``tiled=False`` input dimension ``dim`` must equal ``n`` and is removed. Booleans are summed as ``int32``
    counts, as in :func:`psum`. ``"sum"`` and ``"mean"`` compile to
    one reduce-scatter; ``"max"``, ``"min"`` and ``"prod"`` to one all-to-all plus a local reduction.

    Four devices each holding ``[0, 1, 2, 3]`` give device ``r`` the value ``4 * r``:

    >>> mesh = sc.data_mesh(devices=jax.devices()[:4])
    >>> f = sc.spmd(lambda x: sc.reduce_scatter(x, "data"), mesh=mesh,
    ...             in_specs=sc.P(), out_specs=sc.P("data"))
    >>> f(np.arange(4)).tolist()
    [0, 4, 8, 12]
    """
    if op not in REDUCE_OPS:
        raise SpmdError(describe("reduce_scatter", f"unknown op {op!r}.", fix=f"use one of {REDUCE_OPS}."))
    n = _axis_size("reduce_scatter", axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        d = _dim("reduce_scatter", path, leaf, dim)
        _check_split("reduce_scatter", path, leaf, d, axis, n, exact=not tiled)
        if op in ("sum", "mean"):
            if leaf.dtype == jnp.bool_:
                leaf = leaf.astype(jnp.int32)  # count, as psum does
            out = lax.psum_scatter(leaf, axis, scatter_dimension=d, tiled=tiled)
            return out if op == "sum" else _mean_from_sum(out, n)
        # Chunk i of every device arrives at device i, stacked along d, then is reduced locally.
        mixed = lax.all_to_all(leaf, axis, d, d, tiled=True)
        chunk = leaf.shape[d] // n
        stacked = mixed.reshape(leaf.shape[:d] + (n, chunk) + leaf.shape[d + 1:])
        reduced = {"max": jnp.max, "min": jnp.min, "prod": _prod}[op](stacked, axis=d)
        return reduced if tiled else jnp.squeeze(reduced, d)

    return _map("reduce_scatter", one, x)


def all_to_all(x: Any, axis: AxisName, *, split_dim: int, concat_dim: int) -> Any:
    """Each device splits its block along ``split_dim`` into ``n`` chunks and sends chunk ``j`` to device ``j``.

    Device ``i`` concatenates the chunks it receives, in source-device order, along ``concat_dim``
    (``torch.distributed.all_to_all_single``). Output dimension ``split_dim`` is ``n`` times smaller and
    ``concat_dim`` ``n`` times larger (equal dims keep the shape).

    >>> f = sc.spmd(lambda x: sc.all_to_all(x, "data", split_dim=1, concat_dim=0),
    ...             in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> x = np.arange(64).reshape(8, 8)   # device i holds row i
    >>> f(x).reshape(8, 8)[1].tolist()    # device 1 now holds column 1: a distributed transpose
    [1, 9, 17, 25, 33, 41, 49, 57]
    """
    n = _axis_size("all_to_all", axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        s = _dim("all_to_all", path, leaf, split_dim, arg="split_dim")
        c = _dim("all_to_all", path, leaf, concat_dim, arg="concat_dim")
        _check_split("all_to_all", path, leaf, s, axis, n, arg="split_dim")
        return lax.all_to_all(leaf, axis, s, c, tiled=True)

    return _map("all_to_all", one, x)


def broadcast(x: Any, axis: AxisName, *, root: int = 0) -> Any:
    """``torch.distributed.broadcast``: every device of ``axis`` receives device ``root``'s block, bit for bit.

    Output shape: the input shape (every device must pass the same shape). Built as an all-reduce of the bit
    pattern with zeros from the other devices, because ``jax.lax.pbroadcast`` has no CPU lowering; leaves of
    at least :data:`RS_AG_MIN_BYTES` on CPU use reduce-scatter + all-gather, as ``psum(algorithm="auto")``.

    >>> f = sc.spmd(lambda x: sc.broadcast(x, "data", root=3), in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.arange(8.0))
    Array([3.], dtype=float32)
    """
    n = _axis_size("broadcast", axis)
    _check_root("broadcast", root, axis, n)
    is_root = lax.axis_index(axis) == root
    return _map("broadcast", lambda _, leaf: _exact_psum_from_root(jnp.asarray(leaf), axis, is_root, n), x)


def reduce(x: Any, axis: AxisName, *, root: int = 0, op: ReduceOp = "sum") -> Any:
    """``torch.distributed.reduce``: device ``root`` receives the element-wise ``op`` over all devices.

    Every other device receives its own input unchanged. Output shape: the input shape.

    >>> f = sc.spmd(lambda x: sc.reduce(x, "data", root=0), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(8.0)).tolist()
    [28.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    n = _axis_size("reduce", axis)
    _check_root("reduce", root, axis, n)
    total = all_reduce(x, axis, op, _fn="reduce")
    is_root = lax.axis_index(axis) == root
    return jax.tree.map(lambda t, leaf: jnp.where(is_root, t, jnp.asarray(leaf).astype(t.dtype)), total, x)


def gather(x: Any, axis: AxisName, *, root: int = 0, dim: int = 0) -> Any:
    """``torch.distributed.gather``: device ``root`` receives every device's block concatenated along ``dim``.

    Every other device receives zeros of the same shape (SPMD programs need one shape on all devices). Output
    dimension ``dim`` is ``n`` times larger.

    >>> f = sc.spmd(lambda x: sc.gather(x, "data", root=1), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(8)).reshape(8, 8)[:3].tolist()[1]
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    n = _axis_size("gather", axis)
    _check_root("gather", root, axis, n)
    is_root = lax.axis_index(axis) == root
    gathered = all_gather(x, axis, dim=dim, tiled=True)
    return jax.tree.map(lambda g: jnp.where(is_root, g, jnp.zeros_like(g)), gathered)


def scatter(x: Any, axis: AxisName, *, root: int = 0, dim: int = 0) -> Any:
    """``torch.distributed.scatter``: device ``root``'s block is split along ``dim``; device ``i`` gets chunk ``i``.

    The other devices' inputs are ignored (they must have the same shape). Output dimension ``dim`` is ``n``
    times smaller. Compiles to one reduce-scatter of the root's bit pattern, so values arrive exactly.

    >>> f = sc.spmd(lambda x: sc.scatter(x, "data", root=0), in_specs=sc.P(), out_specs=sc.P("data"))
    >>> f(np.arange(8.0)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    n = _axis_size("scatter", axis)
    _check_root("scatter", root, axis, n)
    is_root = lax.axis_index(axis) == root

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        d = _dim("scatter", path, leaf, dim)
        _check_split("scatter", path, leaf, d, axis, n)
        return _on_bits(leaf, lambda bits: lax.psum_scatter(
            jnp.where(is_root, bits, jnp.zeros_like(bits)), axis, scatter_dimension=d, tiled=True))

    return _map("scatter", one, x)


def permute(x: Any, axis: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Point-to-point send: for each ``(source, destination)`` pair, ``source``'s block goes to ``destination``.

    Sources must be distinct, and so must destinations (``jax.lax.ppermute``). A device that is no pair's
    destination receives zeros. Output shape: the input shape.

    >>> f = sc.spmd(lambda x: sc.permute(x, "data", [(0, 1), (1, 0)]),
    ...             in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(1, 9)).tolist()
    [2, 1, 0, 0, 0, 0, 0, 0]
    """
    n = _axis_size("permute", axis)
    pairs = _check_perm(perm, axis, n)
    return _map("permute", lambda _, leaf: lax.ppermute(jnp.asarray(leaf), axis, pairs), x)


def shift(x: Any, axis: AxisName, offset: int = 1) -> Any:
    """Ring shift: device ``i`` sends its block to device ``(i + offset) % n``, like ``jnp.roll`` over devices.

    >>> f = sc.spmd(lambda x: sc.shift(x, "data", 1), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(8)).tolist()
    [7, 0, 1, 2, 3, 4, 5, 6]
    """
    n = _axis_size("shift", axis)
    if not isinstance(offset, (int, np.integer)):
        raise SpmdError(describe("shift", f"offset must be an int, got {type(offset).__name__}.",
                                 fix="pass an integer offset."))
    if offset % n == 0:
        return _map("shift", lambda _, leaf: jnp.asarray(leaf), x)
    pairs = [(i, (i + int(offset)) % n) for i in range(n)]
    return _map("shift", lambda _, leaf: lax.ppermute(jnp.asarray(leaf), axis, pairs), x)


def axis_index(axis: AxisName) -> jax.Array:
    """This device's index along ``axis`` (row-major over a tuple of axes), as an int32 scalar."""
    _axis_size("axis_index", axis)
    return lax.axis_index(axis)


def axis_size(axis: AxisName) -> int:
    """The number of devices along ``axis`` (the product of the sizes for a tuple), as a Python int."""
    return _axis_size("axis_size", axis)


# ---------------------------------------------------------------------------------------------------------
# Validation


def _bound_axes() -> tuple[str, ...]:
    try:
        return tuple(jax.sharding.get_abstract_mesh().axis_names)
    except Exception:  # noqa: BLE001 - only used to word an error message
        return ()


def _axis_size(fn: str, axis: AxisName) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    if not names:
        raise AxisError(describe(fn, "axis is an empty tuple.", fix="name at least one mesh axis."))
    size = 1
    for name in names:
        try:
            size *= lax.axis_size(name)
        except NameError:
            bound = _bound_axes()
            where = (f"the axes bound here are {bound}" if bound else
                     "no axis is bound here (not inside spmd, jax.shard_map or jax.pmap)")
            raise AxisError(describe(
                fn, f"unknown axis name {name!r}: {where}.",
                fix="pass one of the bound axis names, and call collectives only inside spmd/shard_map/pmap."),
            ) from None
    return size


def _leaves(fn: str, tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path) or "<root>"
        if not _is_array_like(leaf):
            raise SpmdError(describe(
                fn, f"is a {type(leaf).__name__}, not an array.", leaf=name,
                fix="pass arrays or numbers; keep other values out of the pytree (e.g. close over them)."))
        out.append((name, leaf))
    return out, treedef


def _map(fn: str, one: Callable[[str, Any], Any], tree: Any) -> Any:
    leaves, treedef = _leaves(fn, tree)
    return jax.tree.unflatten(treedef, [one(path, leaf) for path, leaf in leaves])


def _is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) or (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def _dim(fn: str, path: str, leaf: jax.Array, dim: int, *, extra: int = 0, arg: str = "dim") -> int:
    rank = leaf.ndim + extra
    if not isinstance(dim, (int, np.integer)) or not -rank <= dim < rank:
        raise ShapeError(describe(
            fn, f"{arg}={dim!r} is out of range for a block of shape {tuple(leaf.shape)} (rank {leaf.ndim}).",
            leaf=path, fix=f"use a {arg} in [{-rank}, {rank})."))
    return int(dim) % rank


def _check_split(fn: str, path: str, leaf: jax.Array, d: int, axis: AxisName, n: int, *,
                 exact: bool = False, arg: str = "dim") -> None:
    size = leaf.shape[d]
    if exact and size != n:
        raise ShapeError(describe(
            fn, f"with tiled=False dimension {d} must equal the size {n} of axis {axis!r}, but the block "
            f"shape is {tuple(leaf.shape)}.", leaf=path, fix=f"give dimension {d} size {n}, or use tiled=True."))
    if size % n:
        raise ShapeError(describe(
            fn, f"{arg} {d} of size {size} (block shape {tuple(leaf.shape)}) does not divide by the size {n} "
            f"of axis {axis!r}.", leaf=path,
            fix=f"pad dimension {d} to a multiple of {n} (e.g. spmdcomm.pad_batch), or split another dimension."))


def _check_root(fn: str, root: int, axis: AxisName, n: int) -> None:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < n:
        raise AxisError(describe(
            fn, f"root={root!r} is out of range for axis {axis!r} of size {n}.",
            fix=f"pass a device index in [0, {n})."))


def _check_perm(perm: Sequence[tuple[int, int]], axis: AxisName, n: int) -> list[tuple[int, int]]:
    try:
        pairs = [(int(s), int(d)) for s, d in perm]
    except (TypeError, ValueError):
        raise AxisError(describe(
            "permute", f"perm={perm!r} is not a sequence of (source, destination) pairs.",
            fix="pass e.g. [(0, 1), (1, 0)].")) from None
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    if bad:
        raise AxisError(describe(
            "permute", f"pairs {bad} name devices outside axis {axis!r} of size {n}.",
            fix=f"use device indices in [0, {n})."))
    for role, idx in (("source", 0), ("destination", 1)):
        seen = [p[idx] for p in pairs]
        dups = sorted({v for v in seen if seen.count(v) > 1})
        if dups:
            raise AxisError(describe(
                "permute", f"perm is not a permutation: {role} device(s) {dups} appear more than once in {pairs}.",
                fix=f"give each device at most one pair as {role}."))
    return pairs


def _warn_if_replicated(fn: str, leaves: list[tuple[str, Any]], axis: AxisName, op: str) -> None:
    from jax._src import config as jax_config  # the only place check_vma is visible from inside a trace

    if not jax_config._check_vma.value:
        return
    names = set(axis if isinstance(axis, tuple) else (axis,))
    for path, leaf in leaves:
        if not isinstance(leaf, jax.core.Tracer):
            continue  # Python numbers and constants: psum(1, axis) counts devices on purpose
        varying = getattr(getattr(jax.typeof(leaf), "mat", None), "varying", None)
        if varying is not None and not names & set(varying):
            effect = "multiplies it by the axis size" if op == "sum" else "is a no-op"
            warnings.warn(describe(
                fn, f"the value is already identical on every device of axis {axis!r}, so a {op} {effect}. "
                "Gradients of replicated parameters taken inside shard_map (check_vma=True) are already "
                "summed over the axis.", leaf=path,
                fix="reduce the per-device value before it became replicated, or drop this reduction."),
                ReplicatedReductionWarning, stacklevel=4)
            return


# ---------------------------------------------------------------------------------------------------------
# Algorithms


def _use_rs_ag(leaf: Any, algorithm: str, n: int) -> bool:
    if algorithm == "native" or n == 1 or not hasattr(leaf, "dtype"):
        return False
    if algorithm == "rs_ag":
        return True
    nbytes = math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize
    return nbytes >= RS_AG_MIN_BYTES and jax.default_backend() == "cpu"


def _rs_ag_sum(leaf: Any, axis: AxisName, n: int) -> jax.Array:
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
        leaf = leaf.astype(jnp.int32)  # the same promotion as lax.psum
    flat = leaf.reshape(-1)
    pad = (-flat.size) % n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    part = lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)
    full = lax.all_gather(part, axis, axis=0, tiled=True, to="invarying")
    return full[: leaf.size].reshape(leaf.shape)


def _mean_from_sum(total: jax.Array, n: int) -> jax.Array:
    return total / n  # true division, as lax.pmean: integer inputs give floating outputs


def _prod(x: jax.Array, axis: int) -> jax.Array:
    if x.dtype == jnp.bool_:
        return jnp.all(x, axis=axis)
    return jnp.prod(x, axis=axis, dtype=x.dtype)


_BIT_TYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _on_bits(x: jax.Array, move: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Applies a sum-based data movement to ``x``'s bit pattern, so that the values arrive exactly."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.complex(_on_bits(jnp.real(x), move), _on_bits(jnp.imag(x), move))
    if x.dtype == jnp.bool_:
        return move(x.astype(jnp.uint8)).astype(jnp.bool_)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return move(x)
    bits = lax.bitcast_convert_type(x, _BIT_TYPES[x.dtype.itemsize])
    return lax.bitcast_convert_type(move(bits), x.dtype)


def _exact_psum_from_root(x: jax.Array, axis: AxisName, is_root: jax.Array, n: int) -> jax.Array:
    # Integer all-reduces are about 2x slower than float ones on XLA:CPU, but a float sum is not exact (-0.0
    # and denormals are lost); large messages therefore take the reduce-scatter + all-gather route.
    def move(bits: jax.Array) -> jax.Array:
        masked = jnp.where(is_root, bits, jnp.zeros_like(bits))
        return _rs_ag_sum(masked, axis, n) if _use_rs_ag(masked, "auto", n) else lax.psum(masked, axis)

    return _on_bits(x, move)
