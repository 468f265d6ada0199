"""Flat parameter vectors: how a pytree maps to one vector per dtype (and per layer), and how such vectors
are split over a mesh axis. Shared by the strategies that flatten (buckets, ZeRO, fully sharded)."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from spmdcomm.errors import SpmdError, describe


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How a pytree maps to flat vectors: one per dtype, or one per (group, dtype) with ``groups``.

    Vectors are keyed by the dtype name (``"float32"``) or, grouped, ``"<group>/<dtype>"``; leaves keep tree
    order inside a vector. A group is a top-level entry of the tree (a layer of a Flax model).
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    keys: tuple[str, ...]

    @classmethod
    def build(cls, tree: Any, *, grouped: bool = False) -> FlatLayout:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        dtypes = tuple(jnp.dtype(x.dtype).name for _, x in flat)
        keys = tuple(f"{_group(path)}/{dt}" if grouped else dt for (path, _), dt in zip(flat, dtypes, strict=True))
        return cls(treedef, tuple(tuple(x.shape) for _, x in flat), dtypes, keys)

    def sizes(self, pad_to: int = 1) -> dict[str, int]:
        """Entries per vector, rounded up to a multiple of ``pad_to``."""
        total: dict[str, int] = collections.defaultdict(int)
        for shape, key in zip(self.shapes, self.keys, strict=True):
            total[key] += math.prod(shape)
        return {key: -(-size // pad_to) * pad_to for key, size in total.items()}

    def flatten(self, tree: Any, pad_to: int = 1) -> dict[str, jax.Array]:
        """The vectors, zero-padded to a multiple of ``pad_to`` (padding is never dropped: it stays zero)."""
        groups: dict[str, list[jax.Array]] = collections.defaultdict(list)
        for leaf, key in zip(jax.tree.leaves(tree), self.keys, strict=True):
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
        for shape, key in zip(self.shapes, self.keys, strict=True):
            size = math.prod(shape)
            leaves.append(vectors[key][offsets[key] : offsets[key] + size].reshape(shape))
            offsets[key] += size
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """Flat vectors split evenly over ``axis`` (``shards`` ways), and how the optimizer state of such split
    vectors is split: each 1-D optimizer leaf of a shard's length is ``P(axis)``, others (step counts)
    ``P()``."""

    flat: FlatLayout
    axis: str
    shards: int
    spec_treedef: Any
    spec_leaves: tuple[P, ...]

    @property
    def opt_specs(self) -> Any:
        return jax.tree.unflatten(self.spec_treedef, self.spec_leaves)

    @classmethod
    def build(
        cls, name: str, params: Any, tx: optax.GradientTransformation, axis: str, n: int, *, grouped: bool = False
    ) -> ShardedLayout:
        flat = FlatLayout.build(params, grouped=grouped)
        check_elementwise(name, tx, flat, n)
        shard = {key: jax.ShapeDtypeStruct((size // n,), key.rsplit("/", 1)[-1]) for key, size in flat.sizes(n).items()}
        abstract = jax.eval_shape(tx.init, shard)
        shard_shapes = {s.shape for s in shard.values()}
        leaves, treedef = jax.tree.flatten(abstract)
        specs = tuple(P(axis) if a.ndim == 1 and a.shape in shard_shapes else P() for a in leaves)
        return cls(flat, axis, n, treedef, specs)

    def vectors(self, tree: Any) -> dict[str, jax.Array]:
        """``tree`` as padded vectors ready to split ``shards`` ways."""
        return self.flat.flatten(tree, pad_to=self.shards)


def cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with its float leaves cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda g: g.astype(dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g, tree)


def all_finite(tree: Any) -> jax.Array:
    """True when every entry of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def check_elementwise(name: str, tx: optax.GradientTransformation, flat: FlatLayout, n: int) -> None:
    """Raises unless ``tx`` treats every parameter entry independently (its state and its updates), which
    a strategy that splits the optimizer state needs."""
    fix = (
        'use strategy="ddp", or an element-wise optax transformation (sgd, momentum, adam, adamw, rmsprop, '
        "lion, ...); global-norm clipping and factored states need the whole gradient."
    )
    dtypes = sorted(set(flat.dtypes))
    rng = np.random.default_rng(0)
    size = 4 * n
    g = [{dt: (rng.standard_normal(size) * 100).astype(dt) for dt in dtypes} for _ in range(2)]
    p = {dt: rng.standard_normal(size).astype(dt) for dt in dtypes}

    def run(grads: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, np.ndarray]:
        state = tx.init(params)
        for gi in grads:
            upd, state = tx.update(gi, state, params)
            params = optax.apply_updates(params, upd)
        return params

    try:
        whole = run(g, p)
        halves = [
            run([{dt: v[sl] for dt, v in gi.items()} for gi in g], {dt: v[sl] for dt, v in p.items()})
            for sl in (slice(0, size // 2), slice(size // 2, size))
        ]
    except Exception as e:  # noqa: BLE001 - any failure on flat vectors means the transform is not supported
        raise SpmdError(
            describe(
                "TrainState.create",
                f'strategy="{name}": the optax'
                f" transformation fails on flat parameter slices ({type(e).__name__}: {e}).",
                fix=fix,
            )
        ) from e
    for dt in dtypes:
        joined = np.concatenate([np.asarray(h[dt]) for h in halves])
        if not np.allclose(np.asarray(whole[dt]), joined, rtol=1e-4, atol=1e-6):
            raise SpmdError(
                describe(
                    "TrainState.create",
                    f'strategy="{name}" needs an optimizer'
                    f" that updates each parameter entry independently, but "
                    "this one gives different updates on slices of the parameters than on the whole (e.g. "
                    "clipping by global norm).",
                    fix=fix,
                )
            )


def _group(path: tuple[Any, ...]) -> str:
    """A readable name of a leaf's top-level entry (``Dense_0``), or ``"params"`` for a bare leaf."""
    if not path:
        return "params"
    text = jax.tree_util.keystr(path[:1])
    return text.strip("[]'\".") or "params"
