"""Pytree-aware SPMD collectives with torch.distributed names.

Call these inside :func:`spmdcomm.spmd`, raw ``jax.shard_map`` or raw ``jax.pmap``. Each takes a pytree of
arrays and an axis name, or a tuple of axis names (the axes then act as one axis whose device index is
row-major over them, as in ``jax.lax.axis_index``). Shapes below are per-device block shapes, and ``n`` is the
size of the axis (the product of the sizes for a tuple).

Every function validates its input before calling ``jax.lax``: an unknown axis, a dimension the axis size does
not divide, a ``root`` out of range, an unknown op, a non-array leaf or a bad permutation raise an
:class:`~spmdcomm.errors.SpmdError` subclass naming the function, the leaf path, the axis and the sizes.

The rooted collectives (``broadcast``, ``reduce``, ``gather``, ``scatter``) have no CPU kernels in ``jax.lax``
(``pbroadcast`` does not lower on CPU) or no ``lax`` counterpart at all; they are built from all-gather,
all-to-all and all-reduce so that they run on every backend. They move values, never add them, so what
they deliver is exact (``-0.0``, denormals, infinities and NaN payloads included, for every dtype).

Derivatives: every collective differentiates (``jax.grad``, ``jax.jvp``, ``jax.vjp``, and
``jax.linear_transpose`` where it is linear) like the ``jax.lax`` program it replaces, under ``jax.jit``,
``jax.vmap``, ``jax.checkpoint`` and to any order; each docstring states its derivative. As in ``jax.lax``, a
derivative taken *inside* the mapped function follows the backend's rules: under ``shard_map`` with
``check_vma=True`` the cotangent of an output that is identical on every device is not summed over devices,
under ``pmap`` (and ``check_vma=False``) it is. One exception: on CPU, bfloat16/float16 leaves of the rooted
collectives and ``all_gather`` move as bit patterns (XLA:CPU changes their NaN payloads otherwise) with a
custom JVP, so ``jax.linear_transpose`` raises ``NotImplementedError`` for them (``grad``/``vjp`` work).

>>> import jax, jax.numpy as jnp, numpy as np
>>> import spmdcomm as sc
>>> f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
>>> f(np.arange(8.0))
Array([28.], dtype=float32)
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._jax_compat import check_vma_enabled, varying_axes
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
    "scan",
    "axis_index",
    "axis_size",
    "REDUCE_OPS",
    "SCAN_OPS",
    "RS_AG_MIN_BYTES",
    "BROADCAST_SPLIT_MIN_BYTES",
]

AxisName = str | tuple[str, ...]
ReduceOp = Literal["sum", "mean", "max", "min", "prod"]
Algorithm = Literal["auto", "native", "rs_ag"]

REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
SCAN_OPS: tuple[str, ...] = ("sum", "max", "min", "prod")

# all_reduce(algorithm="auto") switches a leaf to reduce-scatter + all-gather from this many bytes per device
# on, on CPU only (benchmarks/collectives.py measured it faster than XLA:CPU's all-reduce there; on GPU and
# TPU the native all-reduce is already a ring/tree algorithm, so "auto" keeps it).
RS_AG_MIN_BYTES = 4 * 2**20

# broadcast switches a leaf from one all-gather (every device receives all n blocks and keeps the root's) to
# all-to-all + all-gather (2(n-1)/n of the leaf per device, like an all-reduce) from this many bytes per device
# on, per platform, when the axis has more than 2 devices (with 2 both move the same bytes). CPU: measured by
# benchmarks/collectives.py on 8 devices (equal at 64 KiB, the split 3x faster at 256 KiB). GPU/TPU (not
# measured): the size where one more collective's latency (~10-20 us) equals the bandwidth saved at 8 devices.
BROADCAST_SPLIT_MIN_BYTES: dict[str, int] = {"cpu": 2**16, "gpu": 2**20, "tpu": 2**20}


def psum(x: Any, axis: AxisName, *, algorithm: Algorithm = "auto") -> Any:
    """Sum of ``x`` over the devices of ``axis``; every device receives the sum.

    Output shape: the input shape. Booleans are counted as ``int32`` (as ``jax.lax.psum`` does); integers
    wrap on overflow. ``algorithm`` chooses how: ``"native"`` is ``jax.lax.psum``; ``"rs_ag"`` is a
    reduce-scatter followed by an all-gather; ``"auto"`` takes ``"rs_ag"`` for leaves of at least
    :data:`RS_AG_MIN_BYTES` on CPU and ``"native"`` otherwise.

    A value that is already identical on every device of ``axis`` is multiplied by ``n``. Inside
    ``shard_map`` with ``check_vma=True`` (the default), spmdcomm sees this and warns with
    :class:`~spmdcomm.errors.ReplicatedReductionWarning`; ``psum(1, axis)`` (counting devices) never warns.

    Derivative: that of ``jax.lax.psum`` (linear; its transpose is ``psum`` under ``pmap`` and a
    no-communication ``pvary`` of an invariant cotangent under ``shard_map``), for every ``algorithm``.

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

    Derivative: that of ``jax.lax.pmean`` (linear: :func:`psum`'s, divided by ``n``).

    >>> sc.spmd(lambda x: sc.pmean(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
    Array([3.5], dtype=float32)
    """
    return all_reduce(x, axis, "mean", algorithm=algorithm, _fn="pmean")


def pmax(x: Any, axis: AxisName) -> Any:
    """Element-wise maximum of ``x`` over the devices of ``axis``; every device receives it.

    Compiles to ``jax.lax.pmax`` (NaNs follow XLA's all-reduce: ignored on CPU). Derivative (``jax.lax.pmax``
    has none): ``jnp.max``'s convention, the tangent of the device holding the maximum, split evenly between
    devices that tie: ``psum(where(x == out, t, 0)) / psum(x == out)``.

    >>> sc.spmd(lambda x: sc.pmax(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
    Array([7.], dtype=float32)
    """
    return all_reduce(x, axis, "max", _fn="pmax")


def pmin(x: Any, axis: AxisName) -> Any:
    """Element-wise minimum of ``x`` over the devices of ``axis``; every device receives it.

    Compiles to ``jax.lax.pmin``. Derivative: as :func:`pmax`, the tangent of the device holding the minimum,
    split evenly between ties.

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

    Derivative: that of :func:`psum`, :func:`pmean`, :func:`pmax` or :func:`pmin` for those ops; for
    ``"prod"`` that of ``jnp.prod`` over the gathered blocks (correct with zeros).

    >>> f = sc.spmd(lambda x: sc.all_reduce(x, "data", "prod"), in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.array([1, -2, 3, 1, 1, -1, 2, 1]))
    Array([12], dtype=int32)
    """
    if op not in REDUCE_OPS:
        raise SpmdError(describe(_fn, f"unknown op {op!r}.", fix=f"use one of {REDUCE_OPS}."))
    if algorithm not in ("auto", "native", "rs_ag"):
        raise SpmdError(describe(_fn, f"unknown algorithm {algorithm!r}.", fix='use "auto", "native" or "rs_ag".'))
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
        elif op in ("max", "min"):
            out.append(_pextreme(jnp.asarray(leaf), axis, op))
        else:
            out.append(_prod(_gather_blocks(jnp.asarray(leaf), axis, 0, tiled=False), axis=0))
    return jax.tree.unflatten(treedef, out)


def all_gather(x: Any, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> Any:
    """Every device receives the blocks of all devices of ``axis``, in device order.

    With ``tiled=True`` the blocks are concatenated along ``dim`` (output dimension ``dim`` is ``n`` times
    larger, as ``torch.distributed.all_gather_into_tensor``); with ``tiled=False`` they are stacked along a new
    dimension ``dim`` of size ``n``. The output is identical on every device (``out_specs=P()`` type-checks),
    and values arrive exactly.

    Derivative: linear; the cotangent of block ``i`` goes back to device ``i``. Under ``pmap`` (and
    ``check_vma=False``) the cotangents of all devices are summed first (a reduce-scatter, like the transpose
    of ``jax.lax.all_gather``); under ``shard_map`` with ``check_vma=True`` an identical cotangent is sliced
    without communication (like ``all_gather(..., to="invarying")``).

    >>> f = sc.spmd(lambda x: sc.all_gather(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.arange(8)).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return _all_gather("all_gather", x, axis, dim, tiled)


def reduce_scatter(x: Any, axis: AxisName, *, dim: int = 0, op: ReduceOp = "sum", tiled: bool = True) -> Any:
    """``torch.distributed.reduce_scatter``: reduce every device's input element-wise, then split it.

    The reduction over all devices of ``axis`` is split along ``dim`` into ``n`` equal chunks, and device ``i``
    receives chunk ``i``. With ``tiled=True`` output dimension ``dim`` is ``n`` times smaller; with
    ``tiled=False`` input dimension ``dim`` must equal ``n`` and is removed. Booleans are summed as ``int32``
    counts, as in :func:`psum`. ``"sum"`` and ``"mean"`` compile to
    one reduce-scatter; ``"max"``, ``"min"`` and ``"prod"`` to one all-to-all plus a local reduction.

    Derivative: that of ``jax.lax.psum_scatter`` for ``"sum"``/``"mean"`` (linear, transpose an all-gather);
    for the others that of the all-to-all followed by ``jnp.max``/``jnp.min``/``jnp.prod`` (ties split evenly).

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
        d = _dim("reduce_scatter", path, leaf, dim, axis=axis, n=n)
        _check_split("reduce_scatter", path, leaf, d, axis, n, exact=not tiled)
        if op in ("sum", "mean"):
            if leaf.dtype == jnp.bool_:
                leaf = leaf.astype(jnp.int32)  # count, as psum does
            out = lax.psum_scatter(leaf, axis, scatter_dimension=d, tiled=tiled)
            return out if op == "sum" else _mean_from_sum(out, n)
        # Chunk i of every device arrives at device i, stacked along d, then is reduced locally.
        mixed = lax.all_to_all(leaf, axis, d, d, tiled=True)
        chunk = leaf.shape[d] // n
        stacked = mixed.reshape(leaf.shape[:d] + (n, chunk) + leaf.shape[d + 1 :])
        reduced = {"max": jnp.max, "min": jnp.min, "prod": _prod}[op](stacked, axis=d)
        return reduced if tiled else jnp.squeeze(reduced, d)

    return _map("reduce_scatter", one, x)


def all_to_all(x: Any, axis: AxisName, *, split_dim: int, concat_dim: int) -> Any:
    """Each device splits its block along ``split_dim`` into ``n`` chunks and sends chunk ``j`` to device ``j``.

    Device ``i`` concatenates the chunks it receives, in source-device order, along ``concat_dim``
    (``torch.distributed.all_to_all_single``). Output dimension ``split_dim`` is ``n`` times smaller and
    ``concat_dim`` ``n`` times larger (equal dims keep the shape). Derivative: that of ``jax.lax.all_to_all``
    (linear; the transpose is the inverse all-to-all).

    >>> f = sc.spmd(lambda x: sc.all_to_all(x, "data", split_dim=1, concat_dim=0),
    ...             in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> x = np.arange(64).reshape(8, 8)   # device i holds row i
    >>> f(x).reshape(8, 8)[1].tolist()    # device 1 now holds column 1: a distributed transpose
    [1, 9, 17, 25, 33, 41, 49, 57]
    """
    n = _axis_size("all_to_all", axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        s = _dim("all_to_all", path, leaf, split_dim, arg="split_dim", axis=axis, n=n)
        c = _dim("all_to_all", path, leaf, concat_dim, arg="concat_dim", axis=axis, n=n)
        _check_split("all_to_all", path, leaf, s, axis, n, arg="split_dim")
        return lax.all_to_all(leaf, axis, s, c, tiled=True)

    return _map("all_to_all", one, x)


def broadcast(x: Any, axis: AxisName, *, root: int = 0) -> Any:
    """``torch.distributed.broadcast``: every device of ``axis`` receives device ``root``'s block, bit for bit.

    Output shape: the input shape (every device must pass the same shape); the output is identical on every
    device. ``jax.lax.pbroadcast`` has no CPU lowering, so this is built from data movement only: small leaves
    take one all-gather (every device keeps the root's block); leaves of at least
    :data:`BROADCAST_SPLIT_MIN_BYTES` on an axis of more than 2 devices take an all-to-all (device ``j``
    receives chunk ``j`` of every block and keeps the root's) and an all-gather of those chunks, moving
    ``2(n-1)/n`` of the leaf per device like an all-reduce.

    Derivative: that of ``psum(where(axis_index(axis) == root, x, 0), axis)``: linear, the root receives
    the cotangent (summed over devices under ``pmap``), the other devices zero.

    >>> f = sc.spmd(lambda x: sc.broadcast(x, "data", root=3), in_specs=sc.P("data"), out_specs=sc.P())
    >>> f(np.arange(8.0))
    Array([3.], dtype=float32)
    """
    n = _axis_size("broadcast", axis)
    _check_root("broadcast", root, axis, n)
    return _map("broadcast", lambda _, leaf: _broadcast_leaf(jnp.asarray(leaf), axis, int(root), n), x)


def reduce(x: Any, axis: AxisName, *, root: int = 0, op: ReduceOp = "sum") -> Any:
    """``torch.distributed.reduce``: device ``root`` receives the element-wise ``op`` over all devices.

    Every other device receives its own input unchanged (bit for bit; cast to the result dtype where ``op``
    changes it, as ``"mean"`` of integers). Output shape: the input shape.

    Derivative: that of ``where(axis_index(axis) == root, all_reduce(x, axis, op), x)``, with
    :func:`all_reduce`'s derivative for ``op``.

    >>> f = sc.spmd(lambda x: sc.reduce(x, "data", root=0), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(8.0)).tolist()
    [28.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    n = _axis_size("reduce", axis)
    _check_root("reduce", root, axis, n)
    total = all_reduce(x, axis, op, _fn="reduce")
    is_root = lax.axis_index(axis) == root

    def pick(t: Any, leaf: Any) -> jax.Array:
        t, leaf = jnp.asarray(t), jnp.asarray(leaf)  # Python numbers stay numbers through lax.psum
        return _select_exact(is_root, t, leaf.astype(t.dtype))

    return jax.tree.map(pick, total, x)


def gather(x: Any, axis: AxisName, *, root: int = 0, dim: int = 0) -> Any:
    """``torch.distributed.gather``: device ``root`` receives every device's block concatenated along ``dim``.

    Every other device receives zeros of the same shape (SPMD programs need one shape on all devices). Output
    dimension ``dim`` is ``n`` times larger. Compiles to one all-gather; values arrive exactly.

    Derivative: linear, that of ``where(axis_index(axis) == root, all_gather(x, axis, dim=dim), 0)``: block
    ``i`` of the root's cotangent goes back to device ``i``.

    >>> f = sc.spmd(lambda x: sc.gather(x, "data", root=1), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(8)).reshape(8, 8)[:3].tolist()[1]
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    n = _axis_size("gather", axis)
    _check_root("gather", root, axis, n)
    return _all_gather("gather", x, axis, dim, True, root=int(root))


def scatter(x: Any, axis: AxisName, *, root: int = 0, dim: int = 0) -> Any:
    """``torch.distributed.scatter``: device ``root``'s block is split along ``dim``; device ``i`` gets chunk ``i``.

    The other devices' inputs are ignored (they must have the same shape). Output dimension ``dim`` is ``n``
    times smaller. Compiles to one all-to-all (device ``i`` receives chunk ``i`` of every block and keeps the
    root's: the bytes of a reduce-scatter), so values arrive exactly.

    Derivative: linear, that of slicing chunk ``i`` out of :func:`broadcast`: device ``i``'s cotangent becomes
    chunk ``i`` of the root's, the other devices get zero.

    >>> f = sc.spmd(lambda x: sc.scatter(x, "data", root=0), in_specs=sc.P(), out_specs=sc.P("data"))
    >>> f(np.arange(8.0)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    n = _axis_size("scatter", axis)
    _check_root("scatter", root, axis, n)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        d = _dim("scatter", path, leaf, dim, axis=axis, n=n)
        _check_split("scatter", path, leaf, d, axis, n)
        chunk = leaf.shape[d] // n

        def move(v: jax.Array) -> jax.Array:
            mixed = lax.all_to_all(v, axis, d, d, tiled=True)  # [chunk i of device 0, of device 1, ...]
            return lax.slice_in_dim(mixed, int(root) * chunk, (int(root) + 1) * chunk, axis=d)

        return _exact(move, leaf)

    return _map("scatter", one, x)


def permute(x: Any, axis: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Point-to-point send: for each ``(source, destination)`` pair, ``source``'s block goes to ``destination``.

    Sources must be distinct, and so must destinations (``jax.lax.ppermute``). A device that is no pair's
    destination receives zeros. Output shape: the input shape. Derivative: that of ``jax.lax.ppermute``
    (linear; the transpose sends cotangents back along the inverted pairs).

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

    Derivative: that of ``jax.lax.ppermute`` (linear; the transpose shifts by ``-offset``).

    >>> f = sc.spmd(lambda x: sc.shift(x, "data", 1), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(8)).tolist()
    [7, 0, 1, 2, 3, 4, 5, 6]
    """
    n = _axis_size("shift", axis)
    if not isinstance(offset, (int, np.integer)):
        raise SpmdError(
            describe("shift", f"offset must be an int, got {type(offset).__name__}.", fix="pass an integer offset.")
        )
    if offset % n == 0:
        return _map("shift", lambda _, leaf: jnp.asarray(leaf), x)
    pairs = [(i, (i + int(offset)) % n) for i in range(n)]
    return _map("shift", lambda _, leaf: lax.ppermute(jnp.asarray(leaf), axis, pairs), x)


def scan(x: Any, axis: AxisName, op: str = "sum", *, inclusive: bool = True) -> Any:
    """Prefix reduction over the devices of ``axis`` (``MPI_Scan``): device ``i`` receives ``op`` over devices 0..i.

    ``op`` is one of ``"sum"``, ``"max"``, ``"min"``, ``"prod"``. With ``inclusive=False`` (``MPI_Exscan``)
    device ``i`` receives ``op`` over devices ``0..i-1``, and device 0 the identity of ``op``: 0 for sum, 1 for
    prod, ``-inf`` (or the dtype's minimum, ``False`` for booleans) for max, ``+inf`` (the maximum, ``True``)
    for min. Output shape: the input shape. Booleans are summed as ``int32`` counts, as in :func:`psum`; their
    max/min/prod are any/all/all. Runs in ``ceil(log2(n))`` rounds of ``jax.lax.ppermute`` (Hillis-Steele:
    round ``k`` combines the value from ``2**k`` devices back; one more round shifts for the exclusive scan).

    Derivative: that of the same ``ppermute``/``where`` program (for max/min the ties of each pairwise
    ``jnp.maximum``/``jnp.minimum`` split evenly).

    >>> f = sc.spmd(lambda x: sc.scan(x, "data"), in_specs=sc.P("data"), out_specs=sc.P("data"))
    >>> f(np.arange(1, 9)).tolist()
    [1, 3, 6, 10, 15, 21, 28, 36]
    >>> g = sc.spmd(lambda x: sc.scan(x, "data", "max", inclusive=False), in_specs=sc.P("data"),
    ...             out_specs=sc.P("data"))
    >>> g(np.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])).tolist()
    [-inf, 3.0, 3.0, 4.0, 4.0, 5.0, 9.0, 9.0]
    """
    if op not in SCAN_OPS:
        raise SpmdError(describe("scan", f"unknown op {op!r}.", fix=f"use one of {SCAN_OPS}."))
    if not isinstance(inclusive, (bool, np.bool_)):
        raise SpmdError(
            describe(
                "scan",
                f"inclusive must be True or False, got {inclusive!r}.",
                fix="pass inclusive=True (MPI_Scan) or inclusive=False (MPI_Exscan).",
            )
        )
    n = _axis_size("scan", axis)
    idx = lax.axis_index(axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if op == "sum" and leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.int32)  # count, as psum does
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating) and op in ("max", "min"):
            raise SpmdError(
                describe(
                    "scan",
                    f"op {op!r} has no order on complex dtype {leaf.dtype}.",
                    leaf=path,
                    fix='use op="sum" or "prod", or scan the real and imaginary parts.',
                )
            )
        combine = _SCAN_COMBINE[op]
        # Each round is a full ring shift (the wrapped-around values are masked out): jax.vmap's rule for
        # ppermute accepts only full permutations, and the collective-permute costs the same.
        y = leaf
        if not inclusive:
            moved = lax.ppermute(y, axis, _ring(n, 1)) if n > 1 else y
            y = jnp.where(idx >= 1, moved, _identity(op, leaf.dtype))
        step = 1
        while step < n:
            moved = lax.ppermute(y, axis, _ring(n, step))
            y = jnp.where(idx >= step, combine(moved, y), y)  # devices < step already hold their prefix
            step *= 2
        return y

    return _map("scan", one, x)


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
            where = (
                f"the axes bound here are {bound}"
                if bound
                else "no axis is bound here (not inside spmd, jax.shard_map or jax.pmap)"
            )
            raise AxisError(
                describe(
                    fn,
                    f"unknown axis name {name!r}: {where}.",
                    fix="pass one of the bound axis names, and call collectives only inside spmd/shard_map/pmap.",
                ),
            ) from None
    return size


def _leaves(fn: str, tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path) or "<root>"
        if not _is_array_like(leaf):
            raise SpmdError(
                describe(
                    fn,
                    f"is a {type(leaf).__name__}, not an array.",
                    leaf=name,
                    fix="pass arrays or numbers; keep other values out of the pytree (e.g. close over them).",
                )
            )
        out.append((name, leaf))
    return out, treedef


def _map(fn: str, one: Callable[[str, Any], Any], tree: Any) -> Any:
    leaves, treedef = _leaves(fn, tree)
    return jax.tree.unflatten(treedef, [one(path, leaf) for path, leaf in leaves])


def _is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) or (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    )


def _dim(
    fn: str,
    path: str,
    leaf: jax.Array,
    dim: int,
    *,
    extra: int = 0,
    arg: str = "dim",
    axis: AxisName | None = None,
    n: int | None = None,
) -> int:
    rank = leaf.ndim + extra
    if rank == 0:
        over = f" over axis {axis!r} of size {n}" if axis is not None else ""
        raise ShapeError(
            describe(
                fn,
                f"the block is 0-d (shape ()), so it has no dimension to split or concatenate{over}.",
                leaf=path,
                fix="give the value at least one dimension, e.g. x[None] (shape (1,)).",
            )
        )
    if not isinstance(dim, (int, np.integer)) or not -rank <= dim < rank:
        raise ShapeError(
            describe(
                fn,
                f"{arg}={dim!r} is out of range for a block of shape {tuple(leaf.shape)} (rank {leaf.ndim}).",
                leaf=path,
                fix=f"use a {arg} in [{-rank}, {rank}).",
            )
        )
    return int(dim) % rank


def _check_split(
    fn: str, path: str, leaf: jax.Array, d: int, axis: AxisName, n: int, *, exact: bool = False, arg: str = "dim"
) -> None:
    size = leaf.shape[d]
    if exact and size != n:
        raise ShapeError(
            describe(
                fn,
                f"with tiled=False dimension {d} must equal the size {n} of axis {axis!r}, but the block "
                f"shape is {tuple(leaf.shape)}.",
                leaf=path,
                fix=f"give dimension {d} size {n}, or use tiled=True.",
            )
        )
    if size % n:
        raise ShapeError(
            describe(
                fn,
                f"{arg} {d} of size {size} (block shape {tuple(leaf.shape)}) does not divide by the size {n} "
                f"of axis {axis!r}.",
                leaf=path,
                fix=f"pad dimension {d} to a multiple of {n} (e.g. spmdcomm.pad_batch), or split another dimension.",
            )
        )


def _check_root(fn: str, root: int, axis: AxisName, n: int) -> None:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < n:
        raise AxisError(
            describe(
                fn,
                f"root={root!r} is out of range for axis {axis!r} of size {n}.",
                fix=f"pass a device index in [0, {n}).",
            )
        )


def _check_perm(perm: Sequence[tuple[int, int]], axis: AxisName, n: int) -> list[tuple[int, int]]:
    try:
        pairs = [(int(s), int(d)) for s, d in perm]
    except (TypeError, ValueError):
        raise AxisError(
            describe(
                "permute",
                f"perm={perm!r} is not a sequence of (source, destination) pairs.",
                fix="pass e.g. [(0, 1), (1, 0)].",
            )
        ) from None
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    if bad:
        raise AxisError(
            describe(
                "permute",
                f"pairs {bad} name devices outside axis {axis!r} of size {n}.",
                fix=f"use device indices in [0, {n}).",
            )
        )
    for role, idx in (("source", 0), ("destination", 1)):
        seen = [p[idx] for p in pairs]
        dups = sorted({v for v in seen if seen.count(v) > 1})
        if dups:
            raise AxisError(
                describe(
                    "permute",
                    f"perm is not a permutation: {role} device(s) {dups} appear more than once in {pairs}.",
                    fix=f"give each device at most one pair as {role}.",
                )
            )
    return pairs


def _warn_if_replicated(fn: str, leaves: list[tuple[str, Any]], axis: AxisName, op: str) -> None:
    if not check_vma_enabled():
        return
    names = set(axis if isinstance(axis, tuple) else (axis,))
    for path, leaf in leaves:
        if not isinstance(leaf, jax.core.Tracer):
            continue  # Python numbers and constants: psum(1, axis) counts devices on purpose
        if not names & varying_axes(leaf):
            effect = "multiplies it by the axis size" if op == "sum" else "is a no-op"
            warnings.warn(
                describe(
                    fn,
                    f"the value is already identical on every device of axis {axis!r}, so a {op} {effect}. "
                    "Gradients of replicated parameters taken inside shard_map (check_vma=True) are already "
                    "summed over the axis.",
                    leaf=path,
                    fix="reduce the per-device value before it became replicated, or drop this reduction.",
                ),
                ReplicatedReductionWarning,
                stacklevel=4,
            )
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
    full = _gather_blocks(part, axis, 0, tiled=True)
    return full[: leaf.size].reshape(leaf.shape)


def _mean_from_sum(total: jax.Array, n: int) -> jax.Array:
    return total / n  # true division, as lax.pmean: integer inputs give floating outputs


def _prod(x: jax.Array, axis: int) -> jax.Array:
    if x.dtype == jnp.bool_:
        return jnp.all(x, axis=axis)
    return jnp.prod(x, axis=axis, dtype=x.dtype)


_SCAN_COMBINE: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "sum": jnp.add,
    "prod": lambda a, b: jnp.logical_and(a, b) if a.dtype == jnp.bool_ else a * b,
    "max": jnp.maximum,  # on booleans: logical or
    "min": jnp.minimum,  # on booleans: logical and
}


def _ring(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, (i + step) % n) for i in range(n)]


def _identity(op: str, dtype: Any) -> Any:
    """The identity element of ``op`` in ``dtype`` (what device 0 receives from an exclusive scan)."""
    dtype = np.dtype(dtype)
    if op == "sum":
        return np.zeros((), dtype)
    if op == "prod":
        return np.ones((), dtype)
    if dtype == np.bool_:
        return np.bool_(op == "min")
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.array(-np.inf if op == "max" else np.inf, dtype)
    info = jnp.iinfo(dtype)
    return np.array(info.min if op == "max" else info.max, dtype)


def _vma_checked() -> bool:
    """True inside ``shard_map(check_vma=True)``, False under ``pmap``, ``check_vma=False`` and ``vmap``."""
    return check_vma_enabled()


def _platform() -> str:
    """The platform of the devices this trace is mapped over (the default backend outside a mesh)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def _gather_blocks(x: jax.Array, axis: AxisName, d: int, *, tiled: bool) -> jax.Array:
    """All-gather whose output is identical on every device and whose transpose is right on every backend.

    ``all_gather(to="invarying")`` transposes to a local slice of the cotangent, which is right only when the
    cotangent is identical on every device, as the type system guarantees under ``check_vma=True``. Under
    ``pmap`` and ``check_vma=False`` nothing guarantees it (each device may have its own cotangent), and that
    transpose silently drops the other devices' contributions; the plain all-gather, whose transpose sums them
    (a reduce-scatter), is the right one there. Both compile to the same all-gather.
    """
    return lax.all_gather(x, axis, axis=d, tiled=tiled, to="invarying" if _vma_checked() else "varying")


def _exact(move: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``move(x)`` for a dtype-agnostic data movement ``move``, delivering the bits of ``x`` unchanged."""
    if x.dtype in _HALF_FLOATS and _platform() == "cpu":
        return _move_bits(move, x)
    return move(x)


# XLA:CPU computes on 2-byte floats through float32 (its float-normalisation pass): their all-gather,
# all-to-all, permute and select canonicalise NaN payloads (bf16 0x7FC1 -> 0x7FC0), and so does the f32 ->
# bf16 convert, so neither the values nor a float32 detour arrive exactly. Their bit patterns move instead
# (uint16: exact), with a custom_jvp that moves the tangent the same way. The one cost: jax.linear_transpose
# (which ignores custom_jvp rules) is not available for bf16/f16 leaves of the rooted collectives on CPU.
_HALF_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _move_bits(move: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(move(lax.bitcast_convert_type(x, jnp.uint16)), x.dtype)


@_move_bits.defjvp
def _move_bits_jvp(move: Callable[[jax.Array], jax.Array], primals: tuple[jax.Array], tangents: tuple[jax.Array]):
    (x,), (t,) = primals, tangents
    return _move_bits(move, x), move(t)  # the movement is linear: the tangent moves like the value


def _select_exact(pred: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``where(pred, a, b)`` that keeps the bits of 2-byte floats on CPU (see :func:`_exact`)."""
    if a.dtype in _HALF_FLOATS and _platform() == "cpu":
        return _select_bits(pred, a, b)
    return jnp.where(pred, a, b)


@jax.custom_jvp
def _select_bits(pred: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    bits = jnp.where(pred, lax.bitcast_convert_type(a, jnp.uint16), lax.bitcast_convert_type(b, jnp.uint16))
    return lax.bitcast_convert_type(bits, a.dtype)


@_select_bits.defjvp
def _select_bits_jvp(primals: tuple[jax.Array, ...], tangents: tuple[Any, ...]):
    (pred, a, b), (_, ta, tb) = primals, tangents
    return _select_bits(pred, a, b), jnp.where(pred, ta, tb)


def _all_gather(fn: str, x: Any, axis: AxisName, dim: int, tiled: bool, root: int | None = None) -> Any:
    """all_gather (``root=None``) or gather: zeros on the devices other than ``root``."""
    n = _axis_size(fn, axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if tiled and leaf.ndim == 0:
            also = (
                f"pass tiled=False to stack the blocks into a new dimension of size {n}, or "
                if fn == "all_gather"
                else ""
            )
            raise ShapeError(
                describe(
                    fn,
                    f"the block is 0-d (shape ()), so the {n} blocks of axis {axis!r} cannot be concatenated "
                    f"along dim={dim!r}.",
                    leaf=path,
                    fix=f"{also}give the value a dimension, e.g. x[None] (shape (1,)), to receive shape ({n},).",
                )
            )
        d = _dim(fn, path, leaf, dim, extra=0 if tiled else 1, axis=axis, n=n)
        if root is None:
            return _exact(lambda v: _gather_blocks(v, axis, d, tiled=tiled), leaf)
        is_root = lax.axis_index(axis) == root
        return _exact(
            lambda v: jnp.where(is_root, _gather_blocks(v, axis, d, tiled=tiled), jnp.zeros((), v.dtype)), leaf
        )

    return _map(fn, one, x)


def _broadcast_leaf(x: jax.Array, axis: AxisName, root: int, n: int, *, split: bool | None = None) -> jax.Array:
    """Device ``root``'s ``x`` on every device, by data movement only (exact, differentiable, transposable)."""
    if split is None:
        nbytes = x.size * x.dtype.itemsize
        split = n > 2 and nbytes >= BROADCAST_SPLIT_MIN_BYTES.get(_platform(), 2**20)
    if not split or n == 1:
        return _exact(lambda v: _gather_blocks(v, axis, 0, tiled=False)[root], x)

    def move(v: jax.Array) -> jax.Array:
        flat = v.reshape(-1)
        pad = (-flat.size) % n
        if pad:
            flat = jnp.pad(flat, (0, pad))
        # Device j receives chunk j of every device's leaf (row i from device i) and keeps the root's row;
        # the all-gather then assembles the root's chunks everywhere.
        mixed = lax.all_to_all(flat.reshape(n, -1), axis, 0, 0, tiled=True)
        full = _gather_blocks(mixed[root], axis, 0, tiled=True)
        return full[: v.size].reshape(v.shape)

    return _exact(move, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _pextreme_diff(x: jax.Array, axis: AxisName, op: str) -> jax.Array:
    return lax.pmax(x, axis) if op == "max" else lax.pmin(x, axis)


@_pextreme_diff.defjvp
def _pextreme_jvp(axis: AxisName, op: str, primals: tuple[jax.Array], tangents: tuple[jax.Array]):
    # jnp.max's rule: the tangent of the device(s) holding the extreme value, ties split evenly. The primal is
    # computed through the custom_jvp function itself so that derivatives of this rule (jacfwd of grad) use it
    # again instead of reaching lax.pmax, which has no derivative. The tangent is linear in t: transposable.
    (x,), (t,) = primals, tangents
    out = _pextreme_diff(x, axis, op)
    hit = x == out
    count = lax.psum(hit.astype(t.dtype), axis)
    share = lax.psum(jnp.where(hit, t, jnp.zeros_like(t)), axis)
    return out, share / jnp.maximum(count, jnp.ones_like(count))


def _pextreme(x: jax.Array, axis: AxisName, op: str) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return _pextreme_diff(x, axis, op)
    return lax.pmax(x, axis) if op == "max" else lax.pmin(x, axis)  # integers and booleans have no tangent
