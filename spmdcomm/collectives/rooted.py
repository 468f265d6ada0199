"""Rooted collectives: one device (``root``) sends to or receives from all the others.

``broadcast``, ``reduce``, ``gather`` and ``scatter``. ``jax.lax`` has no CPU kernel for them
(``pbroadcast`` does not lower on CPU) or no counterpart at all, so they are built from all-gather,
all-to-all and all-reduce and run on every backend. They move values, never add them, so what they deliver
is exact (``-0.0``, denormals, infinities and NaN payloads included, for every dtype).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._ops import REDUCE_OPS, ReduceOp, check_op, check_root
from spmdcomm.collectives._common import AxisName, bound_size, check_dim, check_split, map_leaves
from spmdcomm.collectives._movement import exact, gather_blocks, gather_leaves, select_exact
from spmdcomm.collectives.reductions import _all_reduce
from spmdcomm.runtime.mesh import platform

__all__ = ["broadcast", "reduce", "gather", "scatter", "BROADCAST_SPLIT_MIN_BYTES"]

# broadcast switches a leaf from one all-gather (every device receives all n blocks and keeps the root's) to
# all-to-all + all-gather (2(n-1)/n of the leaf per device, like an all-reduce) from this many bytes per device
# on, per platform, when the axis has more than 2 devices (with 2 both move the same bytes). CPU: measured by
# benchmarks/collectives.py on 8 devices (equal at 64 KiB, the split 3x faster at 256 KiB). GPU/TPU (not
# measured): the size where one more collective's latency (~10-20 us) equals the bandwidth saved at 8 devices.
BROADCAST_SPLIT_MIN_BYTES: dict[str, int] = {"cpu": 2**16, "gpu": 2**20, "tpu": 2**20}


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

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf (the same shape on every device).
      axis: the mesh axis to broadcast over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      root: the index along ``axis`` of the device whose block is sent (default 0).

    Returns:
      A pytree like ``x`` holding device ``root``'s blocks, identical on every device.

    Raises:
      AxisError: if ``axis`` is not bound here or is an empty tuple, or ``root`` is not an integer in
        ``[0, n)``.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.broadcast(x, "data", root=3), in_specs=sc.P("data"), out_specs=sc.P())
      >>> f(np.arange(8.0))
      Array([3.], dtype=float32)
    """
    n = bound_size("broadcast", axis)
    root = check_root("broadcast", root, n, axis=axis)
    return map_leaves("broadcast", lambda _, leaf: _broadcast_leaf(jnp.asarray(leaf), axis, root, n), x)


def reduce(x: Any, axis: AxisName, *, root: int = 0, op: ReduceOp = "sum") -> Any:
    """``torch.distributed.reduce``: device ``root`` receives the element-wise ``op`` over all devices.

    Every other device receives its own input unchanged (bit for bit; cast to the result dtype where ``op``
    changes it, as ``"mean"`` of integers). Output shape: the input shape.

    Derivative: that of ``where(axis_index(axis) == root, all_reduce(x, axis, op), x)``, with
    :func:`~spmdcomm.all_reduce`'s derivative for ``op``.

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf.
      axis: the mesh axis to reduce over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      root: the index along ``axis`` of the device that receives the result (default 0).
      op: one of ``"sum"`` (default), ``"mean"``, ``"max"``, ``"min"``, ``"prod"``, as in
        :func:`~spmdcomm.all_reduce`.

    Returns:
      A pytree like ``x``: on device ``root`` the reduction over ``axis``, on the others their own input.

    Raises:
      AxisError: if ``axis`` is not bound here or is an empty tuple, or ``root`` is not an integer in
        ``[0, n)``.
      SpmdError: if ``op`` is unknown, or a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.reduce(x, "data", root=0), in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.arange(8.0)).tolist()
      [28.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    check_op("reduce", op, REDUCE_OPS)
    n = bound_size("reduce", axis)
    root = check_root("reduce", root, n, axis=axis)
    total = _all_reduce("reduce", x, axis, op)
    is_root = lax.axis_index(axis) == root

    def pick(t: Any, leaf: Any) -> jax.Array:
        t, leaf = jnp.asarray(t), jnp.asarray(leaf)  # Python numbers stay numbers through lax.psum
        return select_exact(is_root, t, leaf.astype(t.dtype))

    return jax.tree.map(pick, total, x)


def gather(x: Any, axis: AxisName, *, root: int = 0, dim: int = 0) -> Any:
    """``torch.distributed.gather``: device ``root`` receives every device's block concatenated along ``dim``.

    Every other device receives zeros of the same shape (SPMD programs need one shape on all devices). Output
    dimension ``dim`` is ``n`` times larger. Compiles to one all-gather; values arrive exactly.

    Derivative: linear, that of ``where(axis_index(axis) == root, all_gather(x, axis, dim=dim), 0)``: block
    ``i`` of the root's cotangent goes back to device ``i``.

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf (at least 1-d).
      axis: the mesh axis to gather over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      root: the index along ``axis`` of the device that receives the blocks (default 0).
      dim: the dimension the blocks are concatenated along (default 0); negative values count from the end.

    Returns:
      A pytree like ``x``: on device ``root`` the ``n`` blocks in device order, on the others zeros of that
      shape.

    Raises:
      AxisError: if ``axis`` is not bound here or is an empty tuple, or ``root`` is not an integer in
        ``[0, n)``.
      ShapeError: if a leaf is 0-d or ``dim`` is out of range for it.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.gather(x, "data", root=1), in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.arange(8)).reshape(8, 8)[:3].tolist()[1]
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    n = bound_size("gather", axis)
    root = check_root("gather", root, n, axis=axis)
    return gather_leaves("gather", x, axis, dim, True, root=root)


def scatter(x: Any, axis: AxisName, *, root: int = 0, dim: int = 0) -> Any:
    """``torch.distributed.scatter``: device ``root``'s block is split along ``dim``; device ``i`` gets chunk ``i``.

    The other devices' inputs are ignored (they must have the same shape). Output dimension ``dim`` is ``n``
    times smaller. Compiles to one all-to-all (device ``i`` receives chunk ``i`` of every block and keeps the
    root's: the bytes of a reduce-scatter), so values arrive exactly.

    Derivative: linear, that of slicing chunk ``i`` out of :func:`broadcast`: device ``i``'s cotangent becomes
    chunk ``i`` of the root's, the other devices get zero.

    Args:
      x: a pytree of arrays or numbers, this device's block of each leaf (the same shape on every device).
      axis: the mesh axis to scatter over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      root: the index along ``axis`` of the device whose block is split (default 0).
      dim: the dimension split into ``n`` chunks (default 0); negative values count from the end.

    Returns:
      A pytree like ``x`` holding this device's chunk of the root's blocks.

    Raises:
      AxisError: if ``axis`` is not bound here or is an empty tuple, or ``root`` is not an integer in
        ``[0, n)``.
      ShapeError: if a leaf is 0-d, ``dim`` is out of range for it, or dimension ``dim`` does not divide by
        ``n``.
      SpmdError: if a leaf is not an array or number.

    Examples:
      >>> f = sc.spmd(lambda x: sc.scatter(x, "data", root=0), in_specs=sc.P(), out_specs=sc.P("data"))
      >>> f(np.arange(8.0)).tolist()
      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    n = bound_size("scatter", axis)
    root = check_root("scatter", root, n, axis=axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        d = check_dim("scatter", path, leaf, dim, axis=axis, n=n)
        check_split("scatter", path, leaf, d, axis, n)
        chunk = leaf.shape[d] // n

        def move(v: jax.Array) -> jax.Array:
            mixed = lax.all_to_all(v, axis, d, d, tiled=True)  # [chunk i of device 0, of device 1, ...]
            return lax.slice_in_dim(mixed, root * chunk, (root + 1) * chunk, axis=d)

        return exact(move, leaf)

    return map_leaves("scatter", one, x)


def _broadcast_leaf(x: jax.Array, axis: AxisName, root: int, n: int, *, split: bool | None = None) -> jax.Array:
    """Device ``root``'s ``x`` on every device, by data movement only (exact, differentiable, transposable)."""
    if split is None:
        nbytes = x.size * x.dtype.itemsize
        split = n > 2 and nbytes >= BROADCAST_SPLIT_MIN_BYTES.get(platform(), 2**20)
    if not split or n == 1:
        return exact(lambda v: gather_blocks(v, axis, 0, tiled=False)[root], x)

    def move(v: jax.Array) -> jax.Array:
        flat = v.reshape(-1)
        pad = (-flat.size) % n
        if pad:
            flat = jnp.pad(flat, (0, pad))
        # Device j receives chunk j of every device's leaf (row i from device i) and keeps the root's row;
        # the all-gather then assembles the root's chunks everywhere.
        mixed = lax.all_to_all(flat.reshape(n, -1), axis, 0, 0, tiled=True)
        full = gather_blocks(mixed[root], axis, 0, tiled=True)
        return full[: v.size].reshape(v.shape)

    return exact(move, x)
