"""Which dimension of a leaf a strategy splits over the shard axis, and the specs a ``shard_map`` manual over some
axes takes: the per-leaf rules :class:`spmdcomm.parallel.data.layout.TreeLayout` is built from."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import PartitionSpec as P

from spmdcomm.parallel.data import _blocks

__all__ = ["shard_dim", "shard_spec", "manual_spec", "dim", "keep", "names", "path_key", "mirrored"]


def shard_dim(shape: tuple[int, ...], n: int, taken: tuple[Any, ...] = ()) -> int | None:
    """The dimension of ``shape`` split ``n`` ways among those whose entry in ``taken`` (a model spec) is None: the
    first whose size is a positive multiple of ``n``; else, for a leaf of at least ``n`` elements, the one that
    padding to a multiple of ``n`` grows least (the first of equals); else None (the leaf stays whole)."""
    free = [dim for dim in range(len(shape)) if dim >= len(taken) or taken[dim] is None]
    for dim in free:
        if shape[dim] >= n and shape[dim] % n == 0:
            return dim
    if not free or math.prod(shape) < n:
        return None
    return min(free, key=lambda dim: math.prod(_blocks.padded(shape, dim, n)))


def shard_spec(shape: tuple[int, ...], axis: str, n: int, model: P | None = None) -> P:
    """The ``PartitionSpec`` that splits a leaf of ``shape`` over ``axis`` (``n`` devices) on a dimension that
    its ``model`` spec leaves free, keeping the model spec's entries; ``model`` itself when none divides.

    >>> shard_spec((3, 3, 16, 32), "data", 8), shard_spec((10,), "data", 8), shard_spec((5,), "data", 8)
    (P(None, None, 'data'), P('data',), P())
    >>> shard_spec((16, 32), "data", 8, model=P("model"))
    P('model', 'data')
    """
    model = P() if model is None else model
    dim = shard_dim(tuple(shape), n, tuple(model)) if n > 1 else None
    if dim is None:
        return model
    entries = list(model) + [None] * (dim + 1 - len(model))
    entries[dim] = axis
    return P(*entries)


def manual_spec(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with only the entries over ``axes`` (the manual axes of a partial-manual ``shard_map``).

    >>> manual_spec(P("model", "data"), ("data",))
    P(None, 'data')
    """
    entries = [keep(e, axes) for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def dim(spec: P, axis: str) -> int | None:
    """The dimension ``spec`` splits over ``axis`` alone (None: none)."""
    return next((d for d, entry in enumerate(spec) if entry == axis), None)


def keep(entry: Any, axes: tuple[str, ...]) -> Any:
    """A spec entry with only the names in ``axes`` (None when none is left)."""
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in axes)
    return None if not names else names[0] if len(names) == 1 else names


def names(spec: P, dim: int) -> Any:
    """``spec``'s entry for dimension ``dim`` (None past its end)."""
    return spec[dim] if dim < len(spec) else None


def path_key(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def mirrored(
    by_path: dict[tuple[str, ...], int],
    path: tuple[Any, ...],
    shape: tuple[int, ...] | None,
    shapes: tuple[tuple[int, ...], ...],
) -> int | None:
    """The parameter leaf an optimizer leaf at ``path`` mirrors: the one whose path ends ``path`` (longest
    first) with the same shape (any shape for ``shape=None``); None when there is none."""
    key = path_key(path)
    for start in range(len(key)):
        i = by_path.get(key[start:])
        if i is not None and (shape is None or shapes[i] == tuple(shape)):
            return i
    return None
