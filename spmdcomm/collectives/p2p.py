"""Point-to-point sends and the prefix reduction built on them: ``permute``, ``shift`` and ``scan``.

Each compiles to ``jax.lax.ppermute`` (``scan`` to ``ceil(log2 n)`` rounds of it) and differentiates like
it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._ops import SCAN_OPS, check_op, is_index
from spmdcomm.collectives._common import AxisName, bound_size, map_leaves
from spmdcomm.errors import AxisError, SpmdError, describe

__all__ = ["permute", "shift", "scan", "SCAN_OPS"]

ScanOp = Literal["sum", "max", "min", "prod"]


def permute(x: Any, axis: AxisName, *, perm: Sequence[tuple[int, int]]) -> Any:
    """Point-to-point send: for each ``(source, destination)`` pair, ``source``'s block goes to ``destination``.

    Sources must be distinct, and so must destinations (``jax.lax.ppermute``). A device that is no pair's
    destination receives zeros. Output shape: the input shape. Derivative: that of ``jax.lax.ppermute``
    (linear; the transpose sends cotangents back along the inverted pairs).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to send along, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      perm: ``(source, destination)`` pairs of integer device indices along ``axis``, each in ``[0, n)``.

    Returns:
      A pytree like ``x`` holding the block sent to this device, or zeros where none is.

    Raises:
      AxisError: if ``axis`` is not bound here or is an empty tuple, or ``perm`` is not a sequence of integer
        pairs, names a device outside ``[0, n)`` or repeats a source or a destination.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.permute(x, "data", perm=[(0, 1), (1, 0)]),
      ...             in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.arange(1, 9)).tolist()
      [2, 1, 0, 0, 0, 0, 0, 0]
    """
    n = bound_size("permute", axis)
    pairs = _check_perm(perm, axis, n)
    return map_leaves("permute", lambda _, leaf: lax.ppermute(jnp.asarray(leaf), axis, pairs), x)


def shift(x: Any, axis: AxisName, *, offset: int = 1) -> Any:
    """Ring shift: device ``i`` sends its block to device ``(i + offset) % n``, like ``jnp.roll`` over devices.

    Output shape: the input shape. Derivative: that of ``jax.lax.ppermute`` (linear; the transpose shifts by
    ``-offset``).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to shift along, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      offset: how many devices along to send (default 1); negative shifts the other way, and a multiple of
        ``n`` returns ``x`` without communication.

    Returns:
      A pytree like ``x`` holding the block of device ``(i - offset) % n``.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if ``offset`` is not an integer, or a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.shift(x, "data", offset=1), in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.arange(8)).tolist()
      [7, 0, 1, 2, 3, 4, 5, 6]
    """
    n = bound_size("shift", axis)
    if not is_index(offset):
        raise SpmdError(
            describe(
                "shift",
                f"offset={offset!r} is a {type(offset).__name__}, not an int.",
                fix="pass an integer offset, e.g. offset=1 or offset=-1.",
            )
        )
    if offset % n == 0:
        return map_leaves("shift", lambda _, leaf: jnp.asarray(leaf), x)
    pairs = [(i, (i + int(offset)) % n) for i in range(n)]
    return map_leaves("shift", lambda _, leaf: lax.ppermute(jnp.asarray(leaf), axis, pairs), x)


def scan(x: Any, axis: AxisName, *, op: ScanOp = "sum", inclusive: bool = True) -> Any:
    """Prefix reduction over the devices of ``axis`` (``MPI_Scan``): device ``i`` receives ``op`` over devices 0..i.

    With ``inclusive=False`` (``MPI_Exscan``) device ``i`` receives ``op`` over devices ``0..i-1``, and device 0
    the identity of ``op``: 0 for sum, 1 for prod, ``-inf`` (or the dtype's minimum, ``False`` for booleans)
    for max, ``+inf`` (the maximum, ``True``) for min. Output shape: the input shape. Booleans are summed as
    ``int32`` counts, as in :func:`~spmdcomm.psum`; their max/min/prod are any/all/all. Runs in
    ``ceil(log2(n))`` rounds of ``jax.lax.ppermute`` (Hillis-Steele: round ``k`` combines the value from
    ``2**k`` devices back; one more round shifts for the exclusive scan).

    Derivative: that of the same ``ppermute``/``where`` program (for max/min the ties of each pairwise
    ``jnp.maximum``/``jnp.minimum`` split evenly).

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to scan over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      op: one of ``"sum"`` (default), ``"max"``, ``"min"``, ``"prod"`` (:data:`~spmdcomm.collectives.SCAN_OPS`).
      inclusive: whether device ``i``'s own block is part of its prefix (``True``, default, ``MPI_Scan``) or
        not (``False``, ``MPI_Exscan``).

    Returns:
      A pytree like ``x`` whose leaves are this device's prefix reduction.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      SpmdError: if ``op`` is unknown, ``inclusive`` is not a bool, ``op`` is ``"max"``/``"min"`` on a complex
        leaf, or a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.scan(x, "data"), in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.arange(1, 9)).tolist()
      [1, 3, 6, 10, 15, 21, 28, 36]
      >>> g = sc.spmd(lambda x: sc.scan(x, "data", op="max", inclusive=False), in_specs=sc.P("data"),
      ...             out_specs=sc.P("data"))
      >>> g(np.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])).tolist()
      [-inf, 3.0, 3.0, 4.0, 4.0, 5.0, 9.0, 9.0]
    """
    check_op("scan", op, SCAN_OPS)
    if not isinstance(inclusive, (bool, np.bool_)):
        raise SpmdError(
            describe(
                "scan",
                f"inclusive must be True or False, got {inclusive!r}.",
                fix="pass inclusive=True (MPI_Scan) or inclusive=False (MPI_Exscan).",
            )
        )
    n = bound_size("scan", axis)
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

    return map_leaves("scan", one, x)


def _check_perm(perm: Sequence[tuple[int, int]], axis: AxisName, n: int) -> list[tuple[int, int]]:
    try:
        pairs = [(s, d) for s, d in perm]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(is_index(s) and is_index(d) for s, d in pairs):
        raise AxisError(
            describe(
                "permute",
                f"perm={perm!r} is not a sequence of (source, destination) pairs of integer device indices.",
                fix="pass e.g. perm=[(0, 1), (1, 0)].",
            )
        )
    pairs = [(int(s), int(d)) for s, d in pairs]
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
