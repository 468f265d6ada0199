"""Reductions over an axis whose result every device receives, and the axis queries.

``psum``, ``pmean``, ``pmax``, ``pmin`` and ``all_reduce`` return the input shape; ``axis_index`` and
``axis_size`` tell a device where it sits on an axis. See :mod:`spmdcomm.collectives` for what they share
(axes, validation, derivatives).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._ops import REDUCE_OPS, ReduceOp, check_op
from spmdcomm.collectives._common import AxisName, bound_size, leaves, warn_if_replicated
from spmdcomm.collectives._movement import gather_blocks
from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.mesh import platform

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_reduce",
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
