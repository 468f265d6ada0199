"""Data-parallel strategies: how the train step reduces gradients and where the state lives.

A strategy is chosen once, with ``TrainState.create(..., strategy=...)``. The state carries it (with its
mesh and axis), so every train and eval step built for that state follows it and a checkpoint restores
into it. Each device always computes its local gradient on its block of the batch; the strategies differ
in what happens next:

============================  =====================================  ==============  ===============
strategy                      gradients                              parameters      optimizer state
============================  =====================================  ==============  ===============
``DDP()`` (``"ddp"``)         all-reduced leaf by leaf in one        replicated      replicated
                              process (XLA fuses the leaves), as
                              one flat buffer across processes
``DDP(bucket_bytes=B)``       all-reduced in flat buffers of at      replicated      replicated
                              most ``B`` bytes
``ZeRO1()`` (``"zero1"``)     reduce-scattered as flat vectors;      replicated      1/N per device
                              each device updates its slice, then
                              the parameters are all-gathered
============================  =====================================  ==============  ===============

>>> import optax
>>> state = sc.TrainState.create(params={"w": np.zeros(8, np.float32)}, tx=optax.adam(1e-3), strategy="zero1")
>>> state.strategy
ZeRO1()
>>> state.opt_state[0].mu["float32"].sharding.spec
P('data',)
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm.collectives import all_gather, reduce_scatter
from spmdcomm.errors import SpmdError, describe

__all__ = ["Strategy", "DDP", "ZeRO1", "STRATEGIES"]

#: The names ``TrainState.create(..., strategy=...)`` accepts besides :class:`Strategy` objects.
STRATEGIES: tuple[str, ...] = ("ddp", "zero1")

_ONE_BUFFER = 2**40  # a bucket size no model reaches: one flat all-reduce buffer per dtype


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Base class of the data-parallel strategies (:class:`DDP`, :class:`ZeRO1`).

    The methods below are the parts of the train step that differ between strategies; the step calls them
    in this order inside the compiled program: ``reduce`` (sum the local gradients over the data axis, in
    whatever form the strategy keeps them) and ``update`` (the optax update on that form). ``layout``,
    ``opt_specs`` and ``init_opt_state`` run once, when the state is created.
    """

    name: ClassVar[str]

    def layout(self, params: Any, tx: optax.GradientTransformation, mesh: Mesh, axis: str) -> Any:
        """Static data the strategy derives from the parameters (hashable; stored in the state)."""
        raise NotImplementedError

    def opt_specs(self, layout: Any) -> Any:
        """The ``PartitionSpec`` of the optimizer state (a prefix tree of it)."""
        raise NotImplementedError

    def init_opt_state(self, tx: optax.GradientTransformation, params: Any, layout: Any, mesh: Mesh) -> Any:
        """The placed initial optimizer state for the placed, replicated ``params``."""
        raise NotImplementedError

    def reduce(self, ctx: ReduceContext, layout: Any, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        """Sums the f32 ``stats`` vector and the local gradient sums over the axis: ``(stats, reduced)``."""
        raise NotImplementedError

    def update(
        self, ctx: ReduceContext, layout: Any, state: Any, reduced: Any, denom: jax.Array
    ) -> tuple[Any, Any, jax.Array | None]:
        """Applies the optimizer: ``(params, opt_state, finite)`` (``finite`` only with ``skip_nonfinite``)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ReduceContext:
    """What the strategy hooks need to know about the step: the axis, its size and the step's options."""

    axis: str
    size: int
    reduce_dtype: Any
    skip_nonfinite: bool


@dataclasses.dataclass(frozen=True)
class DDP(Strategy):
    """Replicated parameters and optimizer state; gradients all-reduced (torch ``DistributedDataParallel``).

    ``bucket_bytes``: ``None`` (default) chooses: leaf by leaf within one process (XLA fuses the leaves into
    one variadic all-reduce, and flattening costs more than it saves there), one flat buffer per dtype when
    the mesh spans several processes (each gloo/NCCL call has a fixed cost; measured 2x faster for a small
    CNN over gloo), with the step's metrics riding in it. An int flattens the gradients into buffers of at
    most that many bytes, one all-reduce each (torch's ``bucket_cap_mb``).

    >>> sc.DDP(bucket_bytes=25 * 2**20)
    DDP(bucket_bytes=26214400)
    """

    name: ClassVar[str] = "ddp"
    bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        b = self.bucket_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1):
            raise SpmdError(
                describe(
                    "DDP",
                    f"bucket_bytes={b!r} must be a positive int.",
                    fix="pass None (chosen for the mesh) or a bucket size in bytes, e.g. 25 * 2**20.",
                )
            )

    def layout(self, params: Any, tx: optax.GradientTransformation, mesh: Mesh, axis: str) -> _Buckets | None:
        size = self.bucket_bytes
        if size is None and len({d.process_index for d in mesh.devices.flat}) > 1:
            size = _ONE_BUFFER
        return None if size is None else _Buckets(FlatLayout.build(params), int(size))

    def opt_specs(self, layout: Any) -> Any:
        return P()

    def init_opt_state(self, tx: optax.GradientTransformation, params: Any, layout: Any, mesh: Mesh) -> Any:
        return jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)

    def reduce(self, ctx: ReduceContext, layout: Any, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        if layout is None:
            stats, low = lax.psum((stats, cast(grads, ctx.reduce_dtype)), ctx.axis)
            return stats, jax.tree.map(lambda g, ref: g.astype(ref.dtype), low, grads)
        return _bucketed_psum(grads, stats, layout, ctx.reduce_dtype, ctx.axis)

    def update(
        self, ctx: ReduceContext, layout: Any, state: Any, reduced: Any, denom: jax.Array
    ) -> tuple[Any, Any, jax.Array | None]:
        grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), reduced)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return params, opt_state, _all_finite(grads) if ctx.skip_nonfinite else None


@dataclasses.dataclass(frozen=True)
class ZeRO1(Strategy):
    """ZeRO stage 1: optimizer state split over the data axis (torch ``ZeroRedundancyOptimizer``).

    The gradients are flattened into one vector per dtype (padded to a multiple of the axis size, never
    dropped) and reduce-scattered; each device updates its slice of the flat parameters and optimizer
    state, and the parameters are all-gathered. Optimizer memory per device is 1/N of DDP's. The optax
    transformation must treat every parameter entry independently (sgd, momentum, adam, adamw, rmsprop,
    lion, ...): ``TrainState.create`` checks it and raises for global-norm clipping or factored states.
    """

    name: ClassVar[str] = "zero1"

    def layout(self, params: Any, tx: optax.GradientTransformation, mesh: Mesh, axis: str) -> _ZeroLayout:
        return _ZeroLayout.build(params, tx, axis, mesh.shape[axis])

    def opt_specs(self, layout: _ZeroLayout) -> Any:
        return layout.opt_specs

    def init_opt_state(self, tx: optax.GradientTransformation, params: Any, layout: _ZeroLayout, mesh: Mesh) -> Any:
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.opt_specs, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(lambda p: tx.init(layout.flat.flatten(p, pad_to=layout.shards)), out_shardings=shardings)(params)

    def reduce(
        self, ctx: ReduceContext, layout: _ZeroLayout, grads: Any, stats: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        stats = lax.psum(stats, ctx.axis)
        vectors = layout.flat.flatten(grads, pad_to=ctx.size)
        shards = {
            name: reduce_scatter(cast(vec, ctx.reduce_dtype), ctx.axis).astype(vec.dtype)
            for name, vec in vectors.items()
        }
        return stats, shards

    def update(
        self, ctx: ReduceContext, layout: _ZeroLayout, state: Any, reduced: Any, denom: jax.Array
    ) -> tuple[Any, Any, jax.Array | None]:
        grad_shards = {name: (g / denom).astype(g.dtype) for name, g in reduced.items()}
        me, n = lax.axis_index(ctx.axis), ctx.size
        param_shards = {
            name: lax.dynamic_slice_in_dim(vec, me * (vec.shape[0] // n), vec.shape[0] // n)
            for name, vec in layout.flat.flatten(state.params, pad_to=n).items()
        }
        updates, opt_state = state.tx.update(grad_shards, state.opt_state, param_shards)
        new_shards = optax.apply_updates(param_shards, updates)
        finite = None
        if ctx.skip_nonfinite:
            # Each device sees only its slice: the verdict is agreed over the axis.
            bad = sum(jnp.sum(~jnp.isfinite(g)) for g in grad_shards.values())
            finite = lax.psum(bad, ctx.axis) == 0
        return layout.flat.unflatten(all_gather(new_shards, ctx.axis)), opt_state, finite


def resolve_strategy(fn: str, strategy: Strategy | str) -> Strategy:
    """The :class:`Strategy` for ``strategy`` (an object, or one of :data:`STRATEGIES`)."""
    if isinstance(strategy, Strategy):
        return strategy
    by_name = {"ddp": DDP, "zero1": ZeRO1}
    if isinstance(strategy, str) and strategy in by_name:
        return by_name[strategy]()
    raise SpmdError(
        describe(
            fn,
            f"strategy={strategy!r} is not a strategy; expected one of {STRATEGIES} or a spmdcomm.Strategy.",
            fix='pass strategy="ddp" (default), "zero1", or an object such as spmdcomm.DDP(bucket_bytes=...).',
        )
    )


def cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with its float leaves cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda g: g.astype(dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g, tree)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How a pytree maps to one flat vector per dtype (leaves in tree order)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def build(cls, tree: Any) -> FlatLayout:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(tuple(x.shape) for x in leaves), tuple(jnp.dtype(x.dtype).name for x in leaves))

    def sizes(self, pad_to: int = 1) -> dict[str, int]:
        """Entries per dtype, rounded up to a multiple of ``pad_to``."""
        total: dict[str, int] = collections.defaultdict(int)
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            total[dt] += math.prod(shape)
        return {dt: -(-size // pad_to) * pad_to for dt, size in total.items()}

    def flatten(self, tree: Any, pad_to: int = 1) -> dict[str, jax.Array]:
        """One vector per dtype, zero-padded to a multiple of ``pad_to``."""
        groups: dict[str, list[jax.Array]] = collections.defaultdict(list)
        for leaf, dt in zip(jax.tree.leaves(tree), self.dtypes, strict=True):
            groups[dt].append(jnp.ravel(leaf))
        out = {}
        for dt, size in self.sizes(pad_to).items():
            vec = jnp.concatenate(groups[dt]) if len(groups[dt]) > 1 else groups[dt][0]
            out[dt] = jnp.pad(vec, (0, size - vec.shape[0])) if size > vec.shape[0] else vec
        return out

    def unflatten(self, vectors: dict[str, jax.Array]) -> Any:
        """The tree back from :meth:`flatten`'s vectors (padding dropped)."""
        offsets: dict[str, int] = collections.defaultdict(int)
        leaves = []
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            size = math.prod(shape)
            leaves.append(vectors[dt][offsets[dt] : offsets[dt] + size].reshape(shape))
            offsets[dt] += size
        return jax.tree.unflatten(self.treedef, leaves)


# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Buckets:
    flat: FlatLayout
    bucket_bytes: int


@dataclasses.dataclass(frozen=True)
class _ZeroLayout:
    """The optimizer works on flat per-dtype parameter vectors split evenly over ``axis``."""

    flat: FlatLayout
    axis: str
    shards: int
    spec_treedef: Any
    spec_leaves: tuple[P, ...]

    @property
    def opt_specs(self) -> Any:
        """The PartitionSpec of every optimizer-state leaf: split vectors ``P(axis)``, scalars ``P()``."""
        return jax.tree.unflatten(self.spec_treedef, self.spec_leaves)

    @classmethod
    def build(cls, params: Any, tx: optax.GradientTransformation, axis: str, n: int) -> _ZeroLayout:
        flat = FlatLayout.build(params)
        _check_elementwise(tx, flat, n)
        shard = {dt: jax.ShapeDtypeStruct((size // n,), dt) for dt, size in flat.sizes(pad_to=n).items()}
        abstract = jax.eval_shape(tx.init, shard)
        shard_shapes = {s.shape for s in shard.values()}
        leaves, treedef = jax.tree.flatten(abstract)
        specs = tuple(P(axis) if a.ndim == 1 and a.shape in shard_shapes else P() for a in leaves)
        return cls(flat, axis, n, treedef, specs)


def _bucketed_psum(
    grads: Any, stats: jax.Array, buckets: _Buckets, reduce_dtype: Any, axis: str
) -> tuple[jax.Array, Any]:
    """Sums ``stats`` and the gradients over ``axis`` in flat buckets; returns both sums.

    Without ``reduce_dtype`` the f32 ``stats`` vector leads the float32 buffer, so a model whose gradients
    fit one bucket needs ONE all-reduce buffer per step (each costs a round trip on gloo).
    """
    vectors = buckets.flat.flatten(grads)
    fused = reduce_dtype is None
    stats_key = jnp.dtype(stats.dtype).name  # float64 under x64 when model state or metrics are float64
    if fused:
        vectors[stats_key] = jnp.concatenate([stats, vectors.get(stats_key, stats[:0])])
    else:
        stats = lax.psum(stats, axis)
    out = {}
    for name, vec in vectors.items():
        low = cast(vec, reduce_dtype)
        step = max(1, buckets.bucket_bytes // low.dtype.itemsize)
        chunks = [lax.psum(low[i : i + step], axis) for i in range(0, low.shape[0], step)]
        out[name] = (jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]).astype(vec.dtype)
    if fused:
        stats, out[stats_key] = out[stats_key][: stats.shape[0]], out[stats_key][stats.shape[0] :]
    return stats, buckets.flat.unflatten(out)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _check_elementwise(tx: optax.GradientTransformation, flat: FlatLayout, n: int) -> None:
    """Raises unless ``tx`` treats every parameter entry independently (its state and its updates)."""
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
                f'strategy="zero1": the optax transformation fails on flat parameter slices ({type(e).__name__}: {e}).',
                fix=fix,
            )
        ) from e
    for dt in dtypes:
        joined = np.concatenate([np.asarray(h[dt]) for h in halves])
        if not np.allclose(np.asarray(whole[dt]), joined, rtol=1e-4, atol=1e-6):
            raise SpmdError(
                describe(
                    "TrainState.create",
                    'strategy="zero1" needs an optimizer that updates each parameter entry independently, but '
                    "this one gives different updates on slices of the parameters than on the whole (e.g. "
                    "clipping by global norm).",
                    fix=fix,
                )
            )
