"""Which blocks of a value each device and process holds under a sharding, and the check that a value divides
into them (with the message that says how to pad): the arithmetic under :mod:`spmdcomm.data.placement`'s rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import jax
import numpy as np
from jax.sharding import Sharding

from spmdcomm._cache import Cache
from spmdcomm.errors import ShapeError, describe
from spmdcomm.runtime.process import process_count, process_index

__all__ = ["check_divisible", "blocks"]


def check_divisible(
    fn: str, leaf: str | Callable[[], str], shape: tuple[int, ...], sharding: Sharding, *, local: bool = False
) -> tuple[int, ...]:
    """The global shape of a value of ``shape`` placed on ``sharding``; raises :class:`ShapeError` if a split
    dimension does not divide into its blocks.

    ``local``: ``shape`` is this process's part (process-local host input), to be divided into the blocks
    this process's devices hold; otherwise ``shape`` is global and divides into all blocks. ``leaf`` (a
    path, or a function giving it) names the value in the message.
    """
    shape = tuple(shape)
    key = (sharding, shape, local)
    hit = _GLOBAL_SHAPES.get(key)
    if hit is not None:
        return hit
    spec = getattr(sharding, "spec", None)
    if spec is not None and len(spec) > len(shape):
        raise ShapeError(
            describe(
                fn,
                f"spec {spec} has {len(spec)} entries but the value has shape {shape} (rank {len(shape)}).",
                leaf=_name(leaf),
                fix="give the spec at most one entry per dimension.",
            )
        )
    total, mine, devices = blocks(sharding, len(shape))
    if local and shape and not mine[0]:
        raise ShapeError(
            describe(
                fn,
                f"process {process_index()} holds none of the devices of sharding {sharding}, so it has no rows "
                "of its own to pass under host_input='local'.",
                leaf=_name(leaf),
                fix="place it on a mesh that includes devices of every process, or pass host_input='global'.",
            )
        )
    out = []
    for d, size in enumerate(shape):
        k = mine[d] if local else total[d]
        if size % k:
            raise ShapeError(_not_divisible(fn, _name(leaf), d, shape, sharding, k, total[d], devices[d], local))
        out.append(size // k * total[d] if local else size)
    return _GLOBAL_SHAPES.put(key, tuple(out))


def blocks(sharding: Sharding, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[list[int], ...]]:
    """For each of ``ndim`` dimensions placed on ``sharding``: how many blocks all devices hold, how many
    distinct ones this process's devices hold, and the ids of this process's devices in block order."""
    return _BLOCKS.get_or_make((sharding, ndim), lambda: _count_blocks(sharding, ndim))


# ---------------------------------------------------------------------------------------------------------


_GLOBAL_SHAPES = Cache(limit=4096)  # (sharding, shape, local) -> the global shape
_BLOCKS = Cache(limit=1024)  # (sharding, ndim) -> what blocks() answers


def _count_blocks(sharding: Sharding, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[list[int], ...]]:
    probe = (len(sharding.device_set),) * ndim
    every = sharding.devices_indices_map(probe)
    # JAX types the values as `Index | None` but takes them from devices_indices_map, which has no None; jax.Device:
    # jaxlib ships no type stubs, so mypy knows a Device's attributes only through this name (Any).
    mine = cast(Mapping[jax.Device, tuple[slice, ...]], sharding.addressable_devices_indices_map(probe))
    total, local, ids = [], [], []
    for d in range(ndim):
        total.append(len({index[d].indices(probe[d])[0] for index in every.values()}))
        local.append(len({index[d].indices(probe[d])[0] for index in mine.values()}))
        ids.append(sorted((index[d].indices(probe[d])[0], dev.id) for dev, index in mine.items()))
    return tuple(total), tuple(local), tuple([i for _, i in pairs] for pairs in ids)


def _name(leaf: str | Callable[[], str]) -> str:
    return (leaf if isinstance(leaf, str) else leaf()) or "<root>"


def _not_divisible(
    fn: str,
    leaf: str,
    d: int,
    shape: tuple[int, ...],
    sharding: Sharding,
    k: int,
    total: int,
    devices: list[int],
    local: bool,
) -> str:
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    entry = spec[d] if spec is not None and d < len(spec) else None
    if entry is not None and mesh is not None:
        axes = entry if isinstance(entry, tuple) else (entry,)
        where = f"mesh axis {entry!r} of size {int(np.prod([mesh.shape[a] for a in axes]))}"
    else:
        where = f"the {total} blocks of sharding {sharding}"
    if local:
        detail = (
            f"process {process_index()} holds {k} of them, on devices {devices}, and with "
            "host_input='local' passes only its own rows; "
        )
    else:
        detail = f"blocks on devices {devices}; " if process_count() == 1 else ""
    message = (
        f"dimension {d} of size {shape[d]} (shape {shape}) does not divide across {where} "
        f"({detail}needs a multiple of {k})."
    )
    if d == 0:
        fix = (
            f"pad dimension 0 to a multiple of {k}: spmdcomm.pad_batch(batch, {k}) pads with zeros and returns a "
            f"MaskedBatch whose mask marks the real rows (prefetch_to_device(..., multiple_of={k}) does it "
            "per batch); or choose a mesh whose axis size divides it."
        )
    else:
        fix = f"pad dimension {d} to a multiple of {k}, or choose a mesh whose axis size divides it."
    return describe(fn, message, leaf=leaf, fix=fix)
