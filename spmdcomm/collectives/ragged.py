"""``ragged_all_to_all``: torch's ``all_to_all_single`` with split sizes, each device sending a different number of
rows to each, into a static bound; the native collective where the backend has one, a padded all-to-all elsewhere.
See :mod:`spmdcomm.collectives` for what the collectives share (axes, validation, derivatives).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._jax_compat import check_vma_enabled, vary, varying_axes
from spmdcomm.collectives._common import AxisName, bound_size, leaves
from spmdcomm.errors import BackendError, ShapeError, SpmdError, describe
from spmdcomm.runtime.mesh import platform

__all__ = ["ragged_all_to_all", "RAGGED_NATIVE_PLATFORMS"]

# Platforms whose XLA backend has a ragged all-to-all (XLA:CPU has none in jax 0.10: "HLO opcode ragged-all-to-all
# is not supported by XLA:CPU ThunkEmitter"). The one place that decides which implementation "auto" takes.
RAGGED_NATIVE_PLATFORMS = frozenset({"gpu", "tpu"})
RaggedImplementation = Literal["auto", "native", "padded"]


def ragged_all_to_all(
    x: Any,
    send_sizes: Any,
    axis: AxisName,
    *,
    out_rows: int | None = None,
    implementation: RaggedImplementation = "auto",
) -> tuple[Any, jax.Array]:
    """``torch.distributed.all_to_all_single`` with split sizes: each device sends a different number of rows to each.

    Device ``i`` sends rows ``x[o_j : o_j + send_sizes[j]]`` (``o_j`` the sum of ``send_sizes[:j]``) to device
    ``j``: its rows are grouped by destination, in destination order, as torch's ``input_split_sizes`` takes them.
    Device ``j`` receives the chunks of every device packed in source order at the front of an array of
    ``out_rows`` rows, zeros after them, and the number of rows from each source (torch's ``output_split_sizes``,
    exchanged here with one all-gather of ``n`` integers per device). The shapes stay static for XLA:
    ``out_rows`` bounds what a device receives; rows beyond it (those of the last sources first) and rows of ``x``
    past ``sum(send_sizes)`` are not sent, and the returned sizes count what arrived. The default bound,
    ``n * rows``, always holds everything.

    Two implementations give the same values and derivatives: ``"native"``, ``jax.lax.ragged_all_to_all``, moves
    each sent row once (the backends of :data:`RAGGED_NATIVE_PLATFORMS`); ``"padded"`` pads the chunk for every
    destination to ``min(rows, out_rows)`` rows and runs one dense all-to-all, so each device moves
    ``n * min(rows, out_rows)`` rows whatever it sends, plus a gather to pack them (every backend). ``"auto"``
    (default) takes the native one where the platform has it, the padded one elsewhere (CPU).

    Derivative: linear in ``x``; the transpose is the ragged all-to-all back (each received row's cotangent returns
    to the row it came from; rows that were not sent get zero). ``send_sizes`` gets no derivative.

    Args:
      x: a pytree of arrays with the same number of rows (dimension 0) on every leaf, this device's rows grouped
        by destination.
      send_sizes: integers of shape ``(n,)``, this device's row count for each device of ``axis``; negative counts
        send nothing.
      axis: the mesh axis to exchange over, or a tuple of axes acting as one (device index row-major over them);
        it must be bound by the enclosing ``spmd``, ``jax.shard_map`` or ``jax.pmap``.
      out_rows: the number of rows of each output leaf, the bound on what a device receives (default ``n`` times
        the rows of ``x``).
      implementation: ``"auto"`` (default), ``"native"`` or ``"padded"``.

    Returns:
      ``(out, recv_sizes)``: a pytree like ``x`` whose leaves have ``out_rows`` rows, the received rows first in
      source order, then zeros; and the ``int32`` rows received from each device, shape ``(n,)``.

    Raises:
      AxisError: if ``axis`` is not bound here, or is an empty tuple.
      ShapeError: if a leaf is 0-d, the leaves differ in rows, or ``send_sizes`` is not ``n`` integers.
      SpmdError: if ``out_rows`` is not a positive integer, ``implementation`` is unknown, or a leaf is not an
        array or number.
      BackendError: for ``implementation="native"`` on a platform without the native collective.

    Examples:
      Device 0 sends 1 row to itself and 2 to device 1; device 1 sends 1 row to each:

      >>> mesh = sc.data_mesh(devices=jax.devices()[:2])
      >>> f = sc.spmd(lambda x, s: sc.ragged_all_to_all(x, s, "data", out_rows=4), mesh=mesh,
      ...             in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> out, recv = f(np.array([1, 2, 2, 3, 4, 0]), np.array([1, 2, 1, 1]))
      >>> out.tolist(), recv.tolist()
      ([1, 3, 0, 0, 2, 2, 4, 0], [1, 1, 2, 1])
    """
    n = bound_size("ragged_all_to_all", axis)
    pairs, treedef = leaves("ragged_all_to_all", x)
    arrays = [(path, jnp.asarray(leaf)) for path, leaf in pairs]
    rows = _common_rows(arrays)
    sizes = jnp.asarray(send_sizes)
    if sizes.shape != (n,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ShapeError(
            describe(
                "ragged_all_to_all",
                f"send_sizes has shape {tuple(sizes.shape)} and dtype {sizes.dtype}; it needs one integer per "
                f"device of axis {axis!r}, shape ({n},).",
                fix=f"pass {n} row counts, e.g. jnp.bincount(destination, length={n}).",
            )
        )
    bound = n * rows if out_rows is None else _check_out_rows(out_rows)
    native = _uses_native(implementation)
    send, recv, in_offsets, out_offsets = _plan(sizes.astype(jnp.int32), axis, rows, bound)
    if native:
        move = lambda a: lax.ragged_all_to_all(
            a, _zeros_like_varying(a, (bound, *a.shape[1:])), in_offsets, send, out_offsets, recv, axis_name=axis
        )
    else:
        move = lambda a: _padded(a, send, recv, in_offsets, axis, n, bound)
    return jax.tree.unflatten(treedef, [move(a) for _, a in arrays]), recv


def _common_rows(arrays: list[tuple[str, jax.Array]]) -> int:
    """The rows (dimension 0) that every leaf shares; :class:`ShapeError` for a 0-d leaf or leaves that differ."""
    for path, a in arrays:
        if a.ndim == 0:
            raise ShapeError(
                describe(
                    "ragged_all_to_all",
                    "the leaf is 0-d (shape ()); it needs rows (dimension 0) to send.",
                    leaf=path,
                    fix="give the value at least one dimension, e.g. x[None].",
                )
            )
    shapes = {path: a.shape[0] for path, a in arrays}
    if len(set(shapes.values())) > 1:
        raise ShapeError(
            describe(
                "ragged_all_to_all",
                f"the leaves have different numbers of rows (dimension 0): {shapes}; one send_sizes splits them all.",
                fix="give every leaf the same rows, or call once per group of leaves.",
            )
        )
    return next(iter(shapes.values()), 0)


def _check_out_rows(out_rows: Any) -> int:
    if isinstance(out_rows, bool) or not isinstance(out_rows, (int, np.integer)) or out_rows < 1:
        raise SpmdError(
            describe(
                "ragged_all_to_all",
                f"out_rows={out_rows!r} is not a positive integer.",
                fix="pass the most rows a device may receive (default: the axis size times the rows of x).",
            )
        )
    return int(out_rows)


def _uses_native(implementation: str) -> bool:
    """Whether to call ``jax.lax.ragged_all_to_all``: decided at trace time from the platform being traced for."""
    if implementation not in ("auto", "native", "padded"):
        raise SpmdError(
            describe(
                "ragged_all_to_all",
                f"implementation={implementation!r} is not one of 'auto', 'native', 'padded'.",
                fix="pass 'auto' (the native collective where the platform has it), 'native' or 'padded'.",
            )
        )
    here = platform()
    if implementation == "native" and here not in RAGGED_NATIVE_PLATFORMS:
        raise BackendError(
            describe(
                "ragged_all_to_all",
                f"implementation='native' on platform {here!r}: its XLA backend has no ragged all-to-all (only "
                f"{sorted(RAGGED_NATIVE_PLATFORMS)} do).",
                fix="pass implementation='auto' or 'padded' (a dense all-to-all padded to a static bound).",
            )
        )
    return implementation == "native" or (implementation == "auto" and here in RAGGED_NATIVE_PLATFORMS)


def _plan(sizes: jax.Array, axis: AxisName, rows: int, bound: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(send, recv, input_offsets, output_offsets)`` of ``jax.lax.ragged_all_to_all`` for this device.

    Every device clamps its own counts to its rows, then all see the whole matrix ``S[source, destination]`` (one
    all-gather of ``n`` integers each) and clamp each destination's column to ``bound`` in source order: the same
    truncation on both implementations. ``output_offsets[j]`` is where this device's chunk lands on device ``j``.
    """
    sizes = jnp.maximum(sizes, 0)
    ends = jnp.cumsum(sizes)
    in_offsets = jnp.minimum(ends - sizes, rows)
    held = jnp.minimum(ends, rows) - in_offsets
    matrix = lax.all_gather(held, axis)  # [source, destination]
    column_ends = jnp.cumsum(matrix, axis=0)
    starts = jnp.minimum(column_ends - matrix, bound)
    fits = jnp.minimum(column_ends, bound) - starts
    me = lax.axis_index(axis)
    return fits[me], fits[:, me], in_offsets, starts[me]


def _padded(
    a: jax.Array, send: jax.Array, recv: jax.Array, in_offsets: jax.Array, axis: AxisName, n: int, bound: int
) -> jax.Array:
    """The ragged all-to-all as one dense all-to-all of ``[n, min(rows, bound), ...]``: each destination's chunk
    padded to the most rows one pair can carry, then the received chunks packed in source order."""
    rows = a.shape[0]
    chunk = min(rows, bound)
    slot = jnp.arange(chunk)
    picked = a[jnp.clip(in_offsets[:, None] + slot, 0, max(rows - 1, 0))]  # [n, chunk, ...]
    zero = jnp.zeros((), a.dtype)
    sent = jnp.where(_rows_mask(slot[None, :] < send[:, None], picked), picked, zero)
    got = lax.all_to_all(sent, axis, 0, 0, tiled=True)  # chunk i from device i
    row = jnp.arange(bound)
    ends = jnp.cumsum(recv)
    # searchsorted(ends, row, side="right"), counted by hand: jnp.searchsorted fails to trace in a shard_map that
    # leaves an axis to XLA (jax 0.10.2: an AssertionError on the manual axis type).
    source = jnp.minimum(jnp.sum(ends[None, :] <= row[:, None], axis=1), n - 1)
    offset = jnp.clip(row - (ends - recv)[source], 0, chunk - 1)
    packed = got[source, offset]
    return jnp.where(_rows_mask(row < ends[-1], packed), packed, zero)


def _rows_mask(mask: jax.Array, like: jax.Array) -> jax.Array:
    """``mask`` over the leading dimensions of ``like``, broadcast over the rest."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


def _zeros_like_varying(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Zeros of ``shape`` that vary over the axes ``a`` varies over under ``check_vma`` (the native op's output
    buffer must have its operand's type)."""
    zeros = jnp.zeros(shape, a.dtype)
    return vary(zeros, sorted(varying_axes(a))) if check_vma_enabled() else zeros
