"""Flat vectors: how a pytree maps to one vector per dtype (DDP's gradient buckets), and small tree helpers."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from spmdcomm._jax_compat import varying_axes


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How a pytree maps to flat vectors, one per dtype and set of varying manual axes, keyed by :func:`flat_key`
    (``"float32"``, ``"float32@stage"``); leaves keep tree order inside a vector."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def build(cls, tree: Any, exclude: tuple[str, ...] = ()) -> FlatLayout:
        """The layout of ``tree``'s leaves, grouped by :func:`flat_key` (ignoring the axes in ``exclude``)."""
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(tuple(x.shape) for x in leaves), tuple(flat_key(x, exclude) for x in leaves))

    def sizes(self, pad_to: int = 1) -> dict[str, int]:
        """Entries per vector, rounded up to a multiple of ``pad_to``."""
        total: dict[str, int] = collections.defaultdict(int)
        for shape, key in zip(self.shapes, self.dtypes, strict=True):
            total[key] += math.prod(shape)
        return {key: -(-size // pad_to) * pad_to for key, size in total.items()}

    def flatten(self, tree: Any, pad_to: int = 1) -> dict[str, jax.Array]:
        """The vectors, zero-padded to a multiple of ``pad_to`` (padding is never dropped: it stays zero)."""
        groups: dict[str, list[jax.Array]] = collections.defaultdict(list)
        for leaf, key in zip(jax.tree.leaves(tree), self.dtypes, strict=True):
            groups[key].append(jnp.ravel(leaf))
        out = {}
        for key, size in self.sizes(pad_to).items():
            vec = jnp.concatenate(groups[key]) if len(groups[key]) > 1 else groups[key][0]
            out[key] = jnp.pad(vec, (0, size - vec.shape[0])) if size > vec.shape[0] else vec
        return out

    def unflatten(self, vectors: dict[str, jax.Array]) -> Any:
        """The tree back from :meth:`flatten`'s vectors (padding dropped)."""
        offsets: dict[str, int] = collections.defaultdict(int)
        leaves = []
        for shape, key in zip(self.shapes, self.dtypes, strict=True):
            size = math.prod(shape)
            leaves.append(vectors[key][offsets[key] : offsets[key] + size].reshape(shape))
            offsets[key] += size
        return jax.tree.unflatten(self.treedef, leaves)


def flat_key(x: Any, exclude: tuple[str, ...] = ()) -> str:
    """The vector ``x`` is packed into: its dtype's name, and the manual axes it varies over but those in
    ``exclude`` (inside a ``shard_map``, values that vary over different axes cannot share a buffer: a pipeline's
    stacked layers differ per stage, the other parameters' gradients do not)."""
    name = jnp.dtype(x.dtype).name
    over = sorted(set(varying_axes(x)) - set(exclude))
    return f"{name}@{','.join(over)}" if over else name


def cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with its float leaves cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda g: g.astype(dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g, tree)


def all_finite(tree: Any) -> jax.Array:
    """True when every entry of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
