"""Collectives in which every device plays the same part: reductions, gathers, all-to-all and axis queries.

``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``axis_index`` and ``axis_size``. See :mod:`spmdcomm.collectives` for what they share (axes, validation,
derivatives).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._ops import REDUCE_OPS, ReduceOp, check_op
from spmdcomm.collectives._common import (
    AxisName,
    bound_size,
    check_dim,
    check_split,
    leaves,
    map_leaves,
    warn_if_replicated,
)
from spmdcomm.collectives._movement import gather_blocks, gather_leaves
from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.mesh import platform

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "axis_index",
    "axis_size",
    "RS_AG_MIN_BYTES",
]

Algorithm = Literal["auto", "native", "rs_ag"]

# all_reduce(algorithm="auto") switches a leaf to reduce-scatter + all-gather from this many bytes per device
# on, on CPU only (benchmarks/collectives.py measured it faster than XLA:CPU's all-reduce there; on GPU and
# TPU the native all-reduce is already a ring/tree algorithm, so "auto" keeps it).
RS_AG_MIN_BYTES = 4 * 2**20


def psum(x: Any, axis: AxisName, *, algorithm: Algorithm = "auto") -> Any:
    """Sum of ``x`` over the devices of ``axis``; every device receives the sum.

    Output shape: the input shape. Booleans are counted as ``int32`` (as ``jax.lax.psum`` does); integers
    wrap on overflow.

    A value that is already identical on every device of ``axis`` is multiplied by ``n``. Inside
    ``shard_map`` with ``check_vma=True`` (the default), spmdcomm sees this and warns with
    :class:`~spmdcomm.errors.ReplicatedReductionWarning`; ``psum(1, axis)`` (counting devices) never warns.

    Derivative: that of ``jax.lax.psum`` (linear; its transpose is ``psum`` under ``pmap`` and a
    no-communication ``pvary`` of an invariant cotangent under ``shard_map``), for every ``algorithm``.

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to sum over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      algorithm: how to sum: ``"native"`` is ``jax.lax.psum``; ``"rs_ag"`` is a reduce-scatter followed by an
        all-gather; ``"auto"`` (default) takes ``"rs_ag"`` for leaves of at least :data:`RS_AG_MIN_BYTES` on
        CPU and ``"native"`` otherwise.

    Returns:
      A pytree like ``x`` whose leaves are the sums over ``axis``, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if a leaf is not an array or number, or ``algorithm`` is unknown.

    Examples:
      >>> f = sc.spmd(lambda x: sc.psum({"a": x, "b": 2 * x}, "data"),
      ...             in_specs=sc.P("data"), out_specs=sc.P())
      >>> f(np.ones(8))["b"]
      Array([16.], dtype=float32)
    """
    return _all_reduce("psum", x, axis, "sum", algorithm)


def pmean(x: Any, axis: AxisName, *, algorithm: Algorithm = "auto") -> Any:
    """Mean of ``x`` over the devices of ``axis`` (the sum divided by ``n``); every device receives it.

    Output shape and dtype: those of ``jax.lax.pmean`` (integers give floats). Warns like :func:`psum` when
    the value is already replicated over ``axis``, where a mean is a no-op (see the gradient trap in
    :class:`~spmdcomm.errors.ReplicatedReductionWarning`).

    Derivative: that of ``jax.lax.pmean`` (linear: :func:`psum`'s, divided by ``n``).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to average over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      algorithm: how to sum before dividing: ``"auto"`` (default), ``"native"`` or ``"rs_ag"``, as in
        :func:`psum`.

    Returns:
      A pytree like ``x`` whose leaves are the means over ``axis``, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if a leaf is not an array or number, or ``algorithm`` is unknown.

    Examples:
      >>> sc.spmd(lambda x: sc.pmean(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
      Array([3.5], dtype=float32)
    """
    return _all_reduce("pmean", x, axis, "mean", algorithm)


def pmax(x: Any, axis: AxisName) -> Any:
    """Element-wise maximum of ``x`` over the devices of ``axis``; every device receives it.

    Output shape: the input shape. Compiles to ``jax.lax.pmax`` (NaNs follow XLA's all-reduce: ignored on
    CPU). Derivative (``jax.lax.pmax`` has none): ``jnp.max``'s convention, the tangent of the device holding
    the maximum, split evenly between devices that tie: ``psum(where(x == out, t, 0)) / psum(x == out)``.

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to reduce over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.

    Returns:
      A pytree like ``x`` whose leaves are the element-wise maxima over ``axis``, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> sc.spmd(lambda x: sc.pmax(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
      Array([7.], dtype=float32)
    """
    return _all_reduce("pmax", x, axis, "max")


def pmin(x: Any, axis: AxisName) -> Any:
    """Element-wise minimum of ``x`` over the devices of ``axis``; every device receives it.

    Output shape: the input shape. Compiles to ``jax.lax.pmin``. Derivative: as :func:`pmax`, the tangent of
    the device holding the minimum, split evenly between ties.

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to reduce over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.

    Returns:
      A pytree like ``x`` whose leaves are the element-wise minima over ``axis``, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> sc.spmd(lambda x: sc.pmin(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())(np.arange(8.0))
      Array([0.], dtype=float32)
    """
    return _all_reduce("pmin", x, axis, "min")


def all_reduce(x: Any, axis: AxisName, *, op: ReduceOp = "sum", algorithm: Algorithm = "auto") -> Any:
    """``torch.distributed.all_reduce``: the element-wise ``op`` over all devices of ``axis``, on every device.

    Output shape: the input shape. ``"prod"`` has no ``jax.lax`` primitive: each device gathers the ``n``
    blocks and multiplies them in device order, which is exact for integers, zeros and negative numbers and
    bitwise identical on every device (booleans give their logical AND).

    Derivative: that of :func:`psum`, :func:`pmean`, :func:`pmax` or :func:`pmin` for those ops; for
    ``"prod"`` that of ``jnp.prod`` over the gathered blocks (correct with zeros).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to reduce over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      op: one of ``"sum"`` (default), ``"mean"``, ``"max"``, ``"min"``, ``"prod"``.
      algorithm: for ``"sum"`` and ``"mean"``, how to sum: ``"auto"`` (default), ``"native"`` or ``"rs_ag"``
        (see :func:`psum`); the other ops ignore it.

    Returns:
      A pytree like ``x`` whose leaves are ``op`` over ``axis``, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if ``op`` or ``algorithm`` is unknown, or a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.all_reduce(x, "data", op="prod"), in_specs=sc.P("data"), out_specs=sc.P())
      >>> f(np.array([1, -2, 3, 1, 1, -1, 2, 1]))
      Array([12], dtype=int32)
    """
    return _all_reduce("all_reduce", x, axis, op, algorithm)


def all_gather(x: Any, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> Any:
    """Every device receives the blocks of all devices of ``axis``, in device order.

    For ``n`` devices and ``dim=0``, a block of shape ``(b, ...)`` gives ``(n * b, ...)`` with ``tiled=True``,
    the default (torch's ``all_gather_into_tensor`` shape; ``jax.lax.all_gather`` defaults to
    ``tiled=False``), and ``(n, b, ...)`` with ``tiled=False``. The output is identical on every device
    (``out_specs=P()`` type-checks), and values arrive exactly.

    Derivative: linear; the cotangent of block ``i`` goes back to device ``i``. Under ``pmap`` (and
    ``check_vma=False``) the cotangents of all devices are summed first (a reduce-scatter, like the transpose
    of ``jax.lax.all_gather``); under ``shard_map`` with ``check_vma=True`` an identical cotangent is sliced
    without communication (like ``all_gather(..., to="invarying")``).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to gather over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      dim: with ``tiled=True``, the dimension the blocks are concatenated along (output dimension ``dim`` is
        ``n`` times larger, as ``torch.distributed.all_gather_into_tensor``); with ``tiled=False``, the
        position of the new dimension of size ``n`` they are stacked along. Negative values count from the end.
      tiled: concatenate (``True``, default) or stack (``False``) the blocks.

    Returns:
      A pytree like ``x`` whose leaves hold the ``n`` blocks in device order, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      ShapeError: if ``dim`` is out of range for a leaf, or a leaf is 0-d with ``tiled=True``.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.all_gather(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
      >>> f(np.arange(8)).tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return gather_leaves("all_gather", x, axis, dim, tiled)


def reduce_scatter(x: Any, axis: AxisName, *, dim: int = 0, op: ReduceOp = "sum", tiled: bool = True) -> Any:
    """``torch.distributed.reduce_scatter_tensor``: reduce every device's input element-wise, then split it.

    For ``n`` devices and ``dim=0``, an input of shape ``(n * b, ...)`` gives each device ``(b, ...)`` with
    ``tiled=True``, the default (torch's shape; ``jax.lax.psum_scatter`` defaults to ``tiled=False``), and an
    input of shape ``(n, b, ...)`` gives ``(b, ...)`` with ``tiled=False``.

    The reduction over all devices of ``axis`` is split along ``dim`` into ``n`` equal chunks, and device ``i``
    receives chunk ``i``. With ``tiled=True`` output dimension ``dim`` is ``n`` times smaller; with
    ``tiled=False`` input dimension ``dim`` must equal ``n`` and is removed. Booleans are summed as ``int32``
    counts, as in :func:`psum`. ``"sum"`` and ``"mean"`` compile to one reduce-scatter; ``"max"``, ``"min"``
    and ``"prod"`` to one all-to-all plus a local reduction.

    Derivative: that of ``jax.lax.psum_scatter`` for ``"sum"``/``"mean"`` (linear, transpose an all-gather);
    for the others that of the all-to-all followed by ``jnp.max``/``jnp.min``/``jnp.prod`` (ties split evenly).

    Args:
      x: a pytree of arrays or numbers, this device's input of each leaf (the same shape on every device).
      axis: the mesh axis to reduce over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      dim: the dimension the reduction is split along (default 0); negative values count from the end.
      op: one of ``"sum"`` (default), ``"mean"``, ``"max"``, ``"min"``, ``"prod"``.
      tiled: split dimension ``dim`` into ``n`` chunks (``True``, default), or take index ``i`` of a dimension
        of size ``n`` (``False``).

    Returns:
      A pytree like ``x`` whose leaves are this device's chunk of the reduction.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      ShapeError: if ``dim`` is out of range for a leaf, a leaf is 0-d, dimension ``dim`` does not divide by
        ``n``, or (with ``tiled=False``) it is not ``n``.
      SpmdError: if ``op`` is unknown, or a leaf is not an array or number.

    Examples:
      Four devices each holding ``[0, 1, 2, 3]`` give device ``r`` the value ``4 * r``:

      >>> mesh = sc.data_mesh(devices=jax.devices()[:4])
      >>> f = sc.spmd(lambda x: sc.reduce_scatter(x, "data"), mesh=mesh,
      ...             in_specs=sc.P(), out_specs=sc.P("data"))
      >>> f(np.arange(4)).tolist()
      [0, 4, 8, 12]
    """
    check_op("reduce_scatter", op, REDUCE_OPS)
    n = bound_size("reduce_scatter", axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        d = check_dim("reduce_scatter", path, leaf, dim, axis=axis, n=n)
        check_split("reduce_scatter", path, leaf, d, axis, n, exact=not tiled)
        if op in ("sum", "mean"):
            if leaf.dtype == jnp.bool_:
                leaf = leaf.astype(jnp.int32)  # count, as psum does
            out = lax.psum_scatter(leaf, axis, scatter_dimension=d, tiled=tiled)
            return out if op == "sum" else _mean_from_sum(out, n)
        # Chunk i of every device arrives at device i, stacked along d, then is reduced locally.
        mixed = lax.all_to_all(leaf, axis, d, d, tiled=True)
        chunk = leaf.shape[d] // n
        stacked = mixed.reshape(leaf.shape[:d] + (n, chunk) + leaf.shape[d + 1 :])
        reducers: dict[str, Callable[..., jax.Array]] = {"max": jnp.max, "min": jnp.min, "prod": _prod}
        reduced = reducers[op](stacked, axis=d)
        return reduced if tiled else jnp.squeeze(reduced, d)

    return map_leaves("reduce_scatter", one, x)


def all_to_all(x: Any, axis: AxisName, *, split_dim: int, concat_dim: int) -> Any:
    """Each device splits its block along ``split_dim`` into ``n`` chunks and sends chunk ``j`` to device ``j``.

    Device ``i`` concatenates the chunks it receives, in source-device order, along ``concat_dim``
    (``torch.distributed.all_to_all_single``). Output dimension ``split_dim`` is ``n`` times smaller and
    ``concat_dim`` ``n`` times larger (equal dims keep the shape). Derivative: that of ``jax.lax.all_to_all``
    (linear; the transpose is the inverse all-to-all).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to exchange over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      split_dim: the dimension split into ``n`` chunks; negative values count from the end.
      concat_dim: the dimension the received chunks are concatenated along; negative values count from the end.

    Returns:
      A pytree like ``x`` whose leaves hold the chunks this device received.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      ShapeError: if ``split_dim`` or ``concat_dim`` is out of range for a leaf, a leaf is 0-d, or dimension
        ``split_dim`` does not divide by ``n``.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.all_to_all(x, "data", split_dim=1, concat_dim=0),
      ...             in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> x = np.arange(64).reshape(8, 8)   # device i holds row i
      >>> f(x).reshape(8, 8)[1].tolist()    # device 1 now holds column 1: a distributed transpose
      [1, 9, 17, 25, 33, 41, 49, 57]
    """
    n = bound_size("all_to_all", axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        s = check_dim("all_to_all", path, leaf, split_dim, arg="split_dim", axis=axis, n=n)
        c = check_dim("all_to_all", path, leaf, concat_dim, arg="concat_dim", axis=axis, n=n)
        check_split("all_to_all", path, leaf, s, axis, n, arg="split_dim")
        return lax.all_to_all(leaf, axis, s, c, tiled=True)

    return map_leaves("all_to_all", one, x)


def axis_index(axis: AxisName) -> jax.Array:
    """This device's index along ``axis`` (row-major over a tuple of axes), as an int32 scalar.

    Args:
      axis: a mesh axis name, or a tuple of them, bound by the enclosing ``spmd``, ``jax.shard_map`` or
        ``jax.pmap``.

    Returns:
      An int32 scalar in ``[0, n)``, different on each device of ``axis``.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.

    Examples:
      >>> f = sc.spmd(lambda x: x + sc.axis_index("data"), in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.zeros(8, np.int32)).tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    bound_size("axis_index", axis)
    return lax.axis_index(axis)


def axis_size(axis: AxisName) -> int:
    """The number of devices along ``axis`` (the product of the sizes for a tuple), as a Python int.

    Args:
      axis: a mesh axis name, or a tuple of them, bound by the enclosing ``spmd``, ``jax.shard_map`` or
        ``jax.pmap``.

    Returns:
      ``n``, known at trace time.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
    """
    return bound_size("axis_size", axis)


def _all_reduce(fn: str, x: Any, axis: AxisName, op: Any, algorithm: Any = "auto") -> Any:
    """:func:`all_reduce` on behalf of ``fn``, which its errors and warnings name."""
    check_op(fn, op, REDUCE_OPS)
    if algorithm not in ("auto", "native", "rs_ag"):
        raise SpmdError(describe(fn, f"unknown algorithm {algorithm!r}.", fix='use "auto", "native" or "rs_ag".'))
    n = bound_size(fn, axis)
    pairs, treedef = leaves(fn, x)
    if op in ("sum", "mean"):
        warn_if_replicated(fn, pairs, axis, op)
    out = []
    for _, leaf in pairs:
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
            out.append(_prod(gather_blocks(jnp.asarray(leaf), axis, 0, tiled=False), axis=0))
    return jax.tree.unflatten(treedef, out)


def _use_rs_ag(leaf: Any, algorithm: str, n: int) -> bool:
    if algorithm == "native" or n == 1 or not hasattr(leaf, "dtype"):
        return False
    if algorithm == "rs_ag":
        return True
    nbytes = math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize
    return nbytes >= RS_AG_MIN_BYTES and platform() == "cpu"


def _rs_ag_sum(leaf: Any, axis: AxisName, n: int) -> jax.Array:
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
        leaf = leaf.astype(jnp.int32)  # the same promotion as lax.psum
    flat = leaf.reshape(-1)
    pad = (-flat.size) % n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    part = lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)
    full = gather_blocks(part, axis, 0, tiled=True)
    return full[: leaf.size].reshape(leaf.shape)


def _mean_from_sum(total: jax.Array, n: int) -> jax.Array:
    return total / n  # true division, as lax.pmean: integer inputs give floating outputs


def _prod(x: jax.Array, axis: int) -> jax.Array:
    if x.dtype == jnp.bool_:
        return jnp.all(x, axis=axis)
    return jnp.prod(x, axis=axis, dtype=x.dtype)


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
