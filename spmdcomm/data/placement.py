"""Host input to global arrays: the one placement rule of every spmdcomm API that puts data on devices.

**The rule.** Host input (NumPy arrays and other non-JAX leaves) is *process-local* by default: with several
processes, each process passes the rows for its own devices, as every torch DDP rank loads its own batch,
and the global array is the processes' parts side by side along each split dimension, in process order
(``jax.make_array_from_process_local_data``). With one process the local value is the global value, so
single-process code never sees a difference. ``host_input="global"`` instead means every process passes
the same, full global value and keeps its own part of it (the values are not compared across processes).
Leaves that are replicated (``P()``) are the same under both rules. ``jax.Array`` leaves are never
re-interpreted: they are moved only if their sharding differs from the target.

:func:`spmdcomm.spmd`, :func:`shard_batch`, :func:`spmdcomm.prefetch_to_device` and the train and eval steps
follow this rule, through :func:`place` and :func:`place_batch`.

Ambiguous or impossible input raises instead of being guessed at:

- a split dimension that does not divide into the blocks this process holds (``ShapeError``, naming the
  leaf, the size and the devices, and how to pad);
- processes whose leaves would build different global arrays (different local shapes or dtypes for the
  same leaf, or a different tree): ``ProcessMismatchError`` in every process, naming the processes and
  their shapes. This is checked through a timed sync point (:func:`spmdcomm.runtime.transport.exchange`) once per new
  shape signature, before any data moves (:mod:`spmdcomm.data.agreement`); a signature seen before costs one
  dictionary lookup. A process that alone changes its shapes meets no partner at the check and raises
  :class:`~spmdcomm.errors.BarrierTimeoutError` after the timeout, naming the processes it waited for.

>>> import numpy as np, spmdcomm as sc
>>> from spmdcomm.data import placement
>>> x = placement.place("example", {"x": np.arange(16.0).reshape(8, 2)}, sc.data_sharding())["x"]
>>> x.shape, x.addressable_shards[1].data.tolist()
((8, 2), [[2.0, 3.0]])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from spmdcomm.data.agreement import Agreement, leaf_name
from spmdcomm.data.batches import MaskedBatch, leading_size
from spmdcomm.data.blocks import blocks, check_divisible
from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.runtime.mesh import data_sharding, default_mesh
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import DEFAULT_TIMEOUT

__all__ = [
    "place",
    "place_batch",
    "shard_batch",
    "place_leaves",
    "check_host_input",
    "Agreement",
    "HostInput",
    "HOST_INPUTS",
]

HostInput = Literal["local", "global"]
HOST_INPUTS: tuple[str, ...] = ("local", "global")


def place(
    fn: str,
    tree: Any,
    sharding: Any,
    *,
    host_input: HostInput = "local",
    agreement: Agreement | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Any:
    """``tree`` with every leaf a global ``jax.Array`` placed as ``sharding`` says, under the module's rule.

    ``sharding`` is one ``Sharding`` for every leaf or a pytree prefix of ``tree`` whose leaves are
    shardings. All host leaves that stay within this process's devices go to one batched
    ``jax.device_put``. ``fn`` names the caller in errors. ``agreement`` holds the shape signatures the
    processes already agreed on (default: one shared by the main thread's calls); ``timeout`` bounds the
    check of a new one.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shardings = _broadcast(fn, sharding, tree, len(leaves))
    names = functools.cache(lambda: [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]])
    placed = place_leaves(
        fn, leaves, shardings, names=names, host_input=host_input, agreement=agreement, timeout=timeout
    )
    return jax.tree_util.tree_unflatten(treedef, placed)


def place_batch(
    fn: str,
    batch: Any,
    *,
    mesh: Mesh,
    axis: str | tuple[str, ...],
    multiple_of: int = 1,
    multiple_name: str = "multiple_of",
    host_input: HostInput = "local",
    agreement: Agreement | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[Any, Any]:
    """``(data, mask)`` of a batch split along dimension 0 over ``axis`` of ``mesh``, under the module's rule.

    ``batch`` is a pytree of arrays with a common leading size, or a :class:`~spmdcomm.MaskedBatch` whose
    1-D bool ``mask`` has one entry per row (``mask`` is ``None`` for a plain batch). The rows must split
    into equal blocks for the devices along ``axis`` (this process's devices for process-local host input),
    each a multiple of ``multiple_of`` rows (the train step passes its ``accum_steps``, named in errors as
    ``multiple_name``). Data and mask go to the devices in one batched call.
    """
    check_host_input(fn, host_input)
    data, mask = (batch.data, batch.mask) if isinstance(batch, MaskedBatch) else (batch, None)
    rows = leading_size(fn, data)
    sharding = data_sharding(mesh=mesh, axis=axis)
    # Host rows on a mesh that spans processes: a problem is reported to the other processes before raising.
    spanning = not sharding.is_fully_addressable and any(not isinstance(x, jax.Array) for x in jax.tree.leaves(data))
    local = spanning and host_input == "local"
    total, mine, devices = blocks(sharding, 1)
    k = mine[0] if local else total[0]
    need = k * multiple_of
    problem = None
    if need and rows % need:  # (no devices here at all: place() says so)
        where = f" on process {process_index()}" if local else ""
        what = (
            f"this process's {k} devices on axis {axis!r} (devices {devices[0]}; {total[0]} in all)"
            if local
            else f"{k} devices on axis {axis!r}"
        )
        if multiple_of > 1:
            what += f" x {multiple_name}={multiple_of}"
        problem = ShapeError(
            describe(
                fn,
                f"the batch has {rows} examples{where}, which does not split evenly over {what} "
                f"(needs a multiple of {need}).",
                fix=f"pad it with spmdcomm.pad_batch(batch, {need}), which pads with zeros and returns a "
                "MaskedBatch whose mask marks the real examples (masked means then count those only).",
            )
        )
    elif mask is not None and (np.ndim(mask) != 1 or int(np.shape(mask)[0]) != rows):
        problem = ShapeError(
            describe(
                fn,
                f"the mask has shape {np.shape(mask)} but the batch has {rows} rows.",
                leaf="mask",
                fix="build the batch with spmdcomm.pad_batch.",
            )
        )
    if problem is not None:
        if spanning:
            (agreement or _MAIN).refuse(fn, problem, timeout)
        raise problem
    tree = data if mask is None else MaskedBatch(data, mask)
    placed = place(fn, tree, sharding, host_input=host_input, agreement=agreement, timeout=timeout)
    return (placed, None) if mask is None else (placed.data, placed.mask)


def shard_batch(
    batch: Any,
    *,
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
    host_input: HostInput = "local",
) -> Any:
    """Puts a batch on ``mesh`` as global ``jax.Array``s split along dimension 0 over ``axis``.

    ``batch`` is a pytree of arrays with a common leading size (a :class:`~spmdcomm.MaskedBatch` keeps its
    mask, split the same way). Host leaves follow :mod:`spmdcomm.data.placement`'s rule: by default each process
    passes its own rows; ``host_input="global"``: every process passes the whole batch. The rows must divide
    across the devices (pad with :func:`spmdcomm.pad_batch` otherwise).

    Like ``jax.device_put``, a 64-byte aligned NumPy leaf may be aliased on CPU rather than copied: do
    not write into it while its device array is in use. (:func:`spmdcomm.prefetch_to_device` copies.)

    Args:
      batch: a pytree of arrays with a common leading size, or a :class:`~spmdcomm.MaskedBatch`.
      mesh: the mesh to place on (default :func:`spmdcomm.default_mesh`).
      axis: the mesh axis, or tuple of axes, that dimension 0 is split over (default ``"data"``).
      host_input: ``"local"`` (default): each process passes its own rows; ``"global"``: every process
        passes the whole batch.

    Returns:
      ``batch`` with every leaf a global ``jax.Array`` split along dimension 0 over ``axis``; a
      :class:`~spmdcomm.MaskedBatch` for a :class:`~spmdcomm.MaskedBatch`, its mask split alike.

    Raises:
      ShapeError: when the rows do not split evenly over the devices along ``axis`` (this process's, for
        process-local input), or a mask's shape does not match the rows.
      AxisError: when ``axis`` names an axis that ``mesh`` does not have.
      SpmdError: when ``host_input`` is neither ``"local"`` nor ``"global"``, or a leaf is not an array.
      ProcessMismatchError: when processes pass leaves of different shapes, dtypes or trees.
      BarrierTimeoutError: when another process does not reach the check of a new shape signature in time.

    Examples:
      >>> b = sc.shard_batch({"x": np.arange(16.0).reshape(8, 2)})
      >>> b["x"].sharding.spec == sc.P("data"), b["x"].addressable_shards[1].data.tolist()
      (True, [[2.0, 3.0]])
    """
    mesh = default_mesh() if mesh is None else mesh
    data, mask = place_batch("shard_batch", batch, mesh=mesh, axis=axis, host_input=host_input)
    return MaskedBatch(data, mask) if isinstance(batch, MaskedBatch) else data


def place_leaves(
    fn: str,
    leaves: Sequence[Any],
    shardings: Sequence[Sharding],
    *,
    names: Callable[[], Sequence[str]],
    host_input: HostInput = "local",
    agreement: Agreement | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[Any]:
    """:func:`place` on flat lists: ``leaves[i]`` goes to ``shardings[i]``; ``names()`` gives the leaves'
    paths for messages (only called when one is needed)."""
    check_host_input(fn, host_input)
    out = list(leaves)
    several = process_count() > 1
    puts: list[int] = []  # leaves for the batched device_put
    spanning: list[int] = []  # host leaves on shardings that span processes
    for i, (x, s) in enumerate(zip(leaves, shardings, strict=True)):
        if isinstance(x, jax.Array):
            if not x.sharding.is_equivalent_to(s, x.ndim):
                puts.append(i)
            continue
        x = out[i] = np.asarray(x)
        if several and not s.is_fully_addressable:
            spanning.append(i)
        else:
            check_divisible(fn, functools.partial(leaf_name, names, i), x.shape, s)
            puts.append(i)
    if puts:
        moved = jax.device_put([out[i] for i in puts], [shardings[i] for i in puts])
        for i, y in zip(puts, moved, strict=True):
            out[i] = y
    if spanning:
        shapes = (agreement or _MAIN).global_shapes(
            fn,
            [out[i] for i in spanning],
            [shardings[i] for i in spanning],
            lambda: [names()[i] for i in spanning],
            host_input,
            timeout,
        )
        made = jax.make_array_from_process_local_data(
            [shardings[i] for i in spanning], [out[i] for i in spanning], shapes
        )
        for i, y in zip(spanning, made, strict=True):
            out[i] = y
    return out


def check_host_input(fn: str, host_input: Any) -> HostInput:
    """Raises :class:`~spmdcomm.errors.SpmdError` unless ``host_input`` is one of :data:`HOST_INPUTS`."""
    if host_input not in HOST_INPUTS:
        raise SpmdError(
            describe(
                fn,
                f"host_input={host_input!r} is not one of {HOST_INPUTS}.",
                fix="pass 'local' (each process passes its own rows, the default) or 'global' (every process "
                "passes the same full value); see spmdcomm.data.placement.",
            )
        )
    return host_input


# ---------------------------------------------------------------------------------------------------------


_MAIN = Agreement()


def _broadcast(fn: str, sharding: Any, tree: Any, count: int) -> list[Sharding]:
    if isinstance(sharding, Sharding):
        return [sharding] * count
    per_leaf = jax.tree.map(
        lambda s, sub: [s] * len(jax.tree.leaves(sub)), sharding, tree, is_leaf=lambda x: isinstance(x, Sharding)
    )
    out = jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, Sharding))
    if len(out) != count or not all(isinstance(s, Sharding) for s in out):
        raise SpmdError(
            describe(
                fn,
                "the shardings are not a pytree prefix of the value.",
                fix="pass one Sharding, or a pytree of Shardings whose structure is a prefix of the value's.",
            )
        )
    return out
