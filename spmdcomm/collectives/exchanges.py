"""Collectives that regroup blocks along a dimension: ``all_gather``, ``reduce_scatter`` and ``all_to_all``.

With ``n`` the size of the axis, ``all_gather`` makes dimension ``dim`` ``n`` times larger, ``reduce_scatter``
makes it ``n`` times smaller, and ``all_to_all`` makes ``split_dim`` ``n`` times smaller and ``concat_dim`` ``n``
times larger (:mod:`spmdcomm.collectives.ragged` sends a different number of rows to each device). See
:mod:`spmdcomm.collectives` for what they share (axes, validation, derivatives).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._ops import REDUCE_OPS, ReduceOp, check_op
from spmdcomm.collectives._common import AxisName, bound_size, check_dim, check_split, map_leaves
from spmdcomm.collectives._movement import gather_leaves
from spmdcomm.collectives.reductions import _mean_from_sum, _prod

__all__ = ["all_gather", "reduce_scatter", "all_to_all"]


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
    counts, as in :func:`~spmdcomm.psum`. ``"sum"`` and ``"mean"`` compile to one reduce-scatter; ``"max"``,
    ``"min"`` and ``"prod"`` to one all-to-all plus a local reduction.

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
