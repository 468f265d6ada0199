"""The one cache idiom of spmdcomm: a :class:`Cache`, a dict of bounded size that builds what it lacks.

Everything spmdcomm remembers between calls to save work (compiled programs, meshes, per-type answers) lives in
a ``Cache`` named in capitals at the bottom of its module, or in one attribute of the object whose calls it
serves. It is bounded, so a long run that sees many shapes or meshes cannot grow without end; a key that cannot
be hashed is built each time instead of raising.

>>> squares = Cache(limit=2)
>>> squares.get_or_make(3, lambda: 9), squares.get_or_make(3, lambda: 0)
(9, 9)
>>> squares.get_or_make(4, lambda: 16), squares.get_or_make(5, lambda: 25), list(squares)
(16, 25, [4, 5])
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["Cache"]

V = TypeVar("V")


class Cache(dict[Hashable, Any]):
    """A dict of at most ``limit`` entries; :meth:`get_or_make` adds a missing one, dropping the oldest when full.

    Plain ``get`` and ``[]`` stay the dict's own (the fastest lookup, for loops over every leaf of a state).
    """

    def __init__(self, *, limit: int):
        super().__init__()
        self.limit = limit

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The entry for ``key``, built by ``make()`` and kept if missing; an unhashable key is built, not kept."""
        try:
            hit = self.get(key, _MISSING)
        except TypeError:  # an unhashable key (e.g. a function object with __eq__ but no __hash__)
            return make()
        if hit is _MISSING:
            hit = self.put(key, make())
        return hit

    def put(self, key: Hashable, value: V) -> V:
        """Keeps ``value`` under ``key`` (replacing what was there), dropping the oldest entry when full."""
        if key not in self and len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = value
        return value


_MISSING = object()
