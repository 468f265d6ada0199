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
``ZeRO2()`` (``"zero2"``)     as ZeRO-1, but with ``accum_steps``    replicated      1/N per device
                              each micro-batch is reduce-scattered
                              into a 1/N accumulator
``FSDP()`` (``"fsdp"``)       reduce-scattered by the backward       1/N per         1/N per device
                              pass (the transpose of the forward     device,
                              pass's all-gather)                     gathered for
                                                                     compute
============================  =====================================  ==============  ===============

Gradients are never whole after the reduction in ZeRO-1, ZeRO-2 and FSDP, and only FSDP keeps the
parameters split between steps. ZeRO-2 and FSDP run on the ``shard_map`` backend only.

>>> import optax
>>> state = sc.TrainState.create(params={"w": np.zeros(8, np.float32)}, tx=optax.adam(1e-3), strategy="zero1")
>>> state.strategy
ZeRO1()
>>> state.opt_state[0].mu["float32"].sharding.spec
P('data',)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._flat import FlatLayout, ShardedLayout, all_finite, cast
from spmdcomm.collectives import all_gather, reduce_scatter
from spmdcomm.errors import BackendError, SpmdError, describe

__all__ = ["Strategy", "DDP", "ZeRO1", "ZeRO2", "FSDP", "STRATEGIES"]

#: The names ``TrainState.create(..., strategy=...)`` accepts besides :class:`Strategy` objects.
STRATEGIES: tuple[str, ...] = ("ddp", "zero1", "zero2", "fsdp")

_ONE_BUFFER = 2**40  # a bucket size no model reaches: one flat all-reduce buffer per dtype


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Base class of the data-parallel strategies (:class:`DDP`, :class:`ZeRO1`, :class:`ZeRO2`, :class:`FSDP`).

    The methods are the parts of the train step that differ between strategies. When the state is created:
    ``layout`` (static data derived from the parameters), ``place_params``, ``init_opt_state``. Inside the
    compiled step: ``compute_params`` (the parameters the model sees), then per micro-batch ``micro_grads``
    (the local gradient in the form the strategy accumulates), then ``reduce`` (sum over the data axis)
    and ``update`` (the optax update on that form).
    """

    name: ClassVar[str]
    #: True when the stored parameters are this device's shards: the step differentiates with respect to
    #: them, and the gradient comes out already summed over the axis (the transpose of the gather).
    shards_params: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("shard_map", "pmap")

    def layout(self, params: Any, tx: optax.GradientTransformation, mesh: Mesh, axis: str) -> Any:
        """Static data the strategy derives from the (replicated) parameters; hashable, stored in the state."""
        return None

    def param_specs(self, layout: Any) -> Any:
        """The ``PartitionSpec`` of the stored parameters (a prefix tree)."""
        return P()

    def opt_specs(self, layout: Any) -> Any:
        """The ``PartitionSpec`` of the optimizer state (a prefix tree)."""
        return P()

    def place_params(self, params: Any, layout: Any, mesh: Mesh) -> Any:
        """The stored form of the placed, replicated ``params``."""
        return params

    def init_opt_state(self, tx: optax.GradientTransformation, params: Any, layout: Any, mesh: Mesh) -> Any:
        """The placed initial optimizer state for the stored ``params``."""
        return jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)

    def compute_params(self, ctx: ReduceContext, layout: Any, params: Any) -> Any:
        """Inside the step: the parameter tree the model is applied to."""
        return params

    def micro_grads(self, ctx: ReduceContext, layout: Any, grads: Any) -> Any:
        """Inside the step: one micro-batch's gradient in the form it is accumulated in."""
        return grads

    def reduce(self, ctx: ReduceContext, layout: Any, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        """Sums the f32 ``stats`` vector and the accumulated gradients over the axis: ``(stats, reduced)``."""
        raise NotImplementedError

    def update(
        self, ctx: ReduceContext, layout: Any, state: Any, reduced: Any, denom: jax.Array
    ) -> tuple[Any, Any, jax.Array | None]:
        """Applies the optimizer: ``(params, opt_state, finite)`` (``finite`` only with ``skip_nonfinite``)."""
        raise NotImplementedError

    def full_params(self, params: Any, layout: Any, mesh: Mesh) -> Any:
        """The whole parameter tree, replicated, from the stored form (outside the step)."""
        return params


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
        return params, opt_state, all_finite(grads) if ctx.skip_nonfinite else None


@dataclasses.dataclass(frozen=True)
class ZeRO1(Strategy):
    """ZeRO stage 1: optimizer state split over the data axis (torch ``ZeroRedundancyOptimizer``).

    The gradients are flattened into one vector per dtype (padded to a multiple of the axis size, never
    dropped) and reduce-scattered once per step; each device updates its slice of the flat parameters and
    optimizer state, and the parameters are all-gathered. Optimizer memory per device is 1/N of DDP's. The
    optax transformation must treat every parameter entry independently (sgd, momentum, adam, adamw,
    rmsprop, lion, ...): ``TrainState.create`` checks it and raises for global-norm clipping or factored
    states.
    """

    name: ClassVar[str] = "zero1"

    def layout(self, params: Any, tx: optax.GradientTransformation, mesh: Mesh, axis: str) -> ShardedLayout:
        return ShardedLayout.build(self.name, params, tx, axis, mesh.shape[axis])

    def opt_specs(self, layout: ShardedLayout) -> Any:
        return layout.opt_specs

    def init_opt_state(self, tx: optax.GradientTransformation, params: Any, layout: ShardedLayout, mesh: Mesh) -> Any:
        shardings = _shardings(mesh, layout.opt_specs)
        return jax.jit(lambda p: tx.init(layout.vectors(p)), out_shardings=shardings)(params)

    def reduce(
        self, ctx: ReduceContext, layout: ShardedLayout, grads: Any, stats: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return lax.psum(stats, ctx.axis), _reduce_scatter(ctx, layout.vectors(grads))

    def update(
        self, ctx: ReduceContext, layout: ShardedLayout, state: Any, reduced: Any, denom: jax.Array
    ) -> tuple[Any, Any, jax.Array | None]:
        me, n = lax.axis_index(ctx.axis), ctx.size
        param_shards = {
            key: lax.dynamic_slice_in_dim(vec, me * (vec.shape[0] // n), vec.shape[0] // n)
            for key, vec in layout.vectors(state.params).items()
        }
        new_shards, opt_state, finite = _shard_update(ctx, state, param_shards, reduced, denom)
        return layout.flat.unflatten(all_gather(new_shards, ctx.axis)), opt_state, finite


@dataclasses.dataclass(frozen=True)
class ZeRO2(ZeRO1):
    """ZeRO stage 2: as :class:`ZeRO1`, and the gradient accumulator is split too.

    With ``make_train_step(..., accum_steps=k)`` each micro-batch's gradient is reduce-scattered into a 1/N
    accumulator (k reduce-scatters per step: memory for communication, as DeepSpeed's stage 2), where ZeRO-1
    keeps a whole local accumulator and reduces once. With ``accum_steps=1`` the two compile to the same
    program. ``shard_map`` backend only.
    """

    name: ClassVar[str] = "zero2"
    backends: ClassVar[tuple[str, ...]] = ("shard_map",)

    def micro_grads(self, ctx: ReduceContext, layout: ShardedLayout, grads: Any) -> dict[str, jax.Array]:
        return _reduce_scatter(ctx, layout.vectors(grads))

    def reduce(
        self, ctx: ReduceContext, layout: ShardedLayout, grads: dict[str, jax.Array], stats: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return lax.psum(stats, ctx.axis), grads


@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    """Fully sharded data parallelism (torch FSDP ``fully_shard``, ZeRO stage 3).

    Parameters, gradients and optimizer state live as 1/N shards on each device: the parameters are stored
    as one flat vector per layer (top-level entry of the parameter tree) and dtype, padded to a multiple of
    N (padding is zeros, never dropped). The step all-gathers each layer's vector for the forward pass; the
    backward pass (the transpose of that all-gather) reduce-scatters the gradients straight into shards;
    each device updates its shards of the parameters and optimizer state. ``state.params`` holds the shards;
    :meth:`TrainState.full_params <spmdcomm.TrainState.full_params>` gathers the model tree.

    ``reshard_after_forward=True`` (default, as torch's): nothing gathered is kept for the backward pass:
    ``loss_fn`` runs under ``jax.checkpoint``, so the backward pass gathers the parameters again and
    recomputes the forward pass (activation checkpointing comes with it: less memory, one more forward
    pass). ``False`` keeps the gathered parameters and activations from the forward to the backward pass
    (one all-gather per layer instead of two). XLA:CPU in jax 0.10 merges the second gathers with the first (it drops
    the rematerialisation barrier before its common-subexpression pass), so on CPU both compile alike.
    ``param_dtype`` (e.g. ``jnp.bfloat16``): the model
    computes with low-precision copies of the gathered parameters while the shards, the gradients and the
    optimizer stay float32 (torch's ``MixedPrecisionPolicy(param_dtype=...)``): the shards are gathered in
    ``param_dtype`` (half the bytes for bfloat16) and the gradients reduce-scattered in it, or in the step's
    ``reduce_dtype`` when given (its ``reduce_dtype``). The optimizer must be element-wise, as for
    :class:`ZeRO1`. ``shard_map`` backend only.
    """

    name: ClassVar[str] = "fsdp"
    shards_params: ClassVar[bool] = True
    backends: ClassVar[tuple[str, ...]] = ("shard_map",)
    reshard_after_forward: bool = True
    param_dtype: Any = None

    def __post_init__(self) -> None:
        if self.param_dtype is not None:
            dtype = jnp.dtype(self.param_dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise SpmdError(
                    describe("FSDP", f"param_dtype={dtype} is not a float dtype.", fix="pass e.g. jnp.bfloat16.")
                )
            object.__setattr__(self, "param_dtype", dtype)

    def layout(self, params: Any, tx: optax.GradientTransformation, mesh: Mesh, axis: str) -> ShardedLayout:
        return ShardedLayout.build(self.name, params, tx, axis, mesh.shape[axis], grouped=True)

    def param_specs(self, layout: ShardedLayout) -> Any:
        return P(layout.axis)

    def opt_specs(self, layout: ShardedLayout) -> Any:
        return layout.opt_specs

    def place_params(self, params: Any, layout: ShardedLayout, mesh: Mesh) -> dict[str, jax.Array]:
        return jax.jit(layout.vectors, out_shardings=NamedSharding(mesh, P(layout.axis)))(params)

    def init_opt_state(self, tx: optax.GradientTransformation, params: Any, layout: ShardedLayout, mesh: Mesh) -> Any:
        return jax.jit(tx.init, out_shardings=_shardings(mesh, layout.opt_specs))(params)

    def compute_params(self, ctx: ReduceContext, layout: ShardedLayout, params: dict[str, jax.Array]) -> Any:
        # Each shard is gathered in the compute dtype; the backward pass reduce-scatters the gradient in the
        # step's reduce_dtype (else the compute dtype), so the gradient with respect to the shard arrives
        # summed over the axis.
        whole = {}
        for key, shard in params.items():
            compute = self.param_dtype if self.param_dtype is not None and _is_float(shard) else shard.dtype
            low = ctx.reduce_dtype if ctx.reduce_dtype is not None and _is_float(shard) else compute
            whole[key] = _gather_shards(shard, ctx.axis, jnp.dtype(compute), jnp.dtype(low))
        return layout.flat.unflatten(whole)

    def reduce(
        self, ctx: ReduceContext, layout: ShardedLayout, grads: dict[str, jax.Array], stats: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return lax.psum(stats, ctx.axis), grads

    def update(
        self, ctx: ReduceContext, layout: ShardedLayout, state: Any, reduced: Any, denom: jax.Array
    ) -> tuple[Any, Any, jax.Array | None]:
        return _shard_update(ctx, state, state.params, reduced, denom)

    def full_params(self, params: Any, layout: ShardedLayout, mesh: Mesh) -> Any:
        return jax.jit(layout.flat.unflatten, out_shardings=NamedSharding(mesh, P()))(params)


def resolve_strategy(fn: str, strategy: Strategy | str) -> Strategy:
    """The :class:`Strategy` for ``strategy`` (an object, or one of :data:`STRATEGIES`)."""
    if isinstance(strategy, Strategy):
        return strategy
    by_name = {"ddp": DDP, "zero1": ZeRO1, "zero2": ZeRO2, "fsdp": FSDP}
    if isinstance(strategy, str) and strategy in by_name:
        return by_name[strategy]()
    raise SpmdError(
        describe(
            fn,
            f"strategy={strategy!r} is not a strategy; expected one of {STRATEGIES} or a spmdcomm.Strategy.",
            fix='pass strategy="ddp" (default), "zero1", "zero2", "fsdp", or an object such as '
            "spmdcomm.DDP(bucket_bytes=...) or spmdcomm.FSDP(param_dtype=jnp.bfloat16).",
        )
    )


def check_strategy_backend(fn: str, strategy: Strategy, backend: str) -> None:
    """Raises :class:`~spmdcomm.errors.BackendError` if ``strategy`` cannot run on ``backend``."""
    if backend not in strategy.backends:
        raise BackendError(
            describe(
                fn,
                f"strategy {strategy!r} runs on the {' or '.join(strategy.backends)} backend, not {backend!r} "
                "(it needs shard_map's per-device varying values for its sharded gradients).",
                fix='build the step with backend="shard_map" (the default), or use strategy="ddp" or "zero1" '
                "with the pmap backend.",
            )
        )


# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Buckets:
    flat: FlatLayout
    bucket_bytes: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_shards(shard: jax.Array, axis: str, compute: Any, reduce: Any) -> jax.Array:
    """All-gathers ``shard`` over ``axis`` in dtype ``compute``; its derivative reduce-scatters in ``reduce``."""
    return lax.all_gather(shard.astype(compute), axis, tiled=True)


def _gather_shards_fwd(shard: jax.Array, axis: str, compute: Any, reduce: Any) -> tuple[jax.Array, Any]:
    return _gather_shards(shard, axis, compute, reduce), jnp.zeros((), shard.dtype)


def _gather_shards_bwd(axis: str, compute: Any, reduce: Any, like: jax.Array, ct: jax.Array) -> tuple[jax.Array]:
    return (lax.psum_scatter(ct.astype(reduce), axis, tiled=True).astype(like.dtype),)


_gather_shards.defvjp(_gather_shards_fwd, _gather_shards_bwd)


def _is_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _shardings(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _reduce_scatter(ctx: ReduceContext, vectors: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {
        key: reduce_scatter(cast(vec, ctx.reduce_dtype), ctx.axis).astype(vec.dtype) for key, vec in vectors.items()
    }


def _shard_update(
    ctx: ReduceContext,
    state: Any,
    param_shards: dict[str, jax.Array],
    grad_sums: dict[str, jax.Array],
    denom: jax.Array,
) -> tuple[dict[str, jax.Array], Any, jax.Array | None]:
    """The optax update of this device's shards; ``finite`` agreed over the axis (each device sees a slice)."""
    grad_shards = {key: (g / denom).astype(g.dtype) for key, g in grad_sums.items()}
    updates, opt_state = state.tx.update(grad_shards, state.opt_state, param_shards)
    new_shards = optax.apply_updates(param_shards, updates)
    finite = None
    if ctx.skip_nonfinite:
        bad = sum(jnp.sum(~jnp.isfinite(g)) for g in grad_shards.values())
        finite = lax.psum(bad, ctx.axis) == 0
    return new_shards, opt_state, finite


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
