"""Data-parallel strategies: how the train step reduces gradients and where the state lives.

A strategy is chosen once, with ``TrainState.create(..., strategy=...)``. The state carries it (with its
mesh and axis), so every train and eval step built for that state follows it and a checkpoint restores
into it. Under every strategy the state holds the model's own tree: ``state.params`` has the parameter tree's
structure and leaf shapes, and ``state.opt_state`` is exactly what ``tx.init(params)`` gives on one device. The
strategies differ only in the ``NamedSharding`` of each leaf (torch FSDP2's per-parameter sharding) and in the
collectives the step runs:

============================  =====================================  ==============  ===============
strategy                      gradients                              parameters      optimizer state
============================  =====================================  ==============  ===============
``DDP()`` (``"ddp"``)         all-reduced leaf by leaf in one        replicated      replicated
                              process (XLA fuses the leaves), as
                              one flat buffer across processes
``DDP(bucket_bytes=B)``       all-reduced in flat buffers of at      replicated      replicated
                              most ``B`` bytes
``ZeRO1()`` (``"zero1"``)     reduce-scattered (one buffer per       replicated      split per leaf
                              dtype) into per-leaf blocks; the
                              optimizer updates the blocks, then
                              the parameters are all-gathered
``ZeRO2()`` (``"zero2"``)     as ZeRO-1, but with ``accum_steps``    replicated      split per leaf
                              each micro-batch is reduce-scattered
                              into a split accumulator
``FSDP()`` (``"fsdp"``)       reduce-scattered by the backward       split per       split per leaf
                              pass (the transpose of the forward     leaf, gathered
                              pass's all-gather of each leaf)        leaf by leaf
                                                                     for compute
============================  =====================================  ==============  ===============

"Split per leaf" means each leaf is split over the data axis on its first dimension that the axis size divides
(:func:`spmdcomm.train._layout.shard_spec`); a leaf no dimension of which divides stays replicated, so no leaf is ever
padded or reshaped. The optimizer runs in the global view (``jax.jit`` over these sharded arrays): optax sees the
model's tree with its true shapes, so masks and labels by path or shape, global-norm clipping, per-leaf trust
ratios (LAMB, LARS) and factored statistics (Adafactor) are exactly those of one device, and XLA inserts the small
reductions they need. ZeRO-1, ZeRO-2 and FSDP run on the ``shard_map`` backend only.

>>> import optax
>>> state = sc.TrainState.create(params={"w": np.zeros((8, 3), np.float32)}, tx=optax.adam(1e-3), strategy="zero1")
>>> state.strategy, state.params["w"].shape, state.opt_state[0].mu["w"].sharding.spec
(ZeRO1(), (8, 3), P('data',))
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdcomm.errors import BackendError, SpmdError, describe
from spmdcomm.train._flat import FlatLayout, cast
from spmdcomm.train._layout import TreeLayout

__all__ = ["Strategy", "DDP", "ZeRO1", "ZeRO2", "FSDP", "STRATEGIES"]

#: The names ``TrainState.create(..., strategy=...)`` accepts besides :class:`Strategy` objects.
STRATEGIES: tuple[str, ...] = ("ddp", "zero1", "zero2", "fsdp")

_ONE_BUFFER = 2**40  # a bucket size no model reaches: one flat all-reduce buffer per dtype


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Base class of the data-parallel strategies (:class:`DDP`, :class:`ZeRO1`, :class:`ZeRO2`, :class:`FSDP`).

    ``layout`` (when the state is created) decides each leaf's ``PartitionSpec``. Inside the compiled step,
    which is manual over the data axis: ``compute_params`` (the parameter tree the model sees), per micro-batch
    ``micro_grads`` (the local gradient in the form the strategy accumulates), then ``reduce`` (its sum over
    the axis, each leaf in its ``grad_specs`` form). The optimizer then runs in the global view on that tree.
    """

    name: ClassVar[str]
    #: True when the stored parameters are split: the step differentiates with respect to the blocks, and the
    #: gradient of a split leaf comes out already summed over the axis (the transpose of the gather).
    shards_params: ClassVar[bool] = False
    #: True when reduced gradients and the optimizer state are split per leaf.
    shards_optimizer: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("shard_map", "pmap")

    def layout(
        self,
        params: Any,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        axes: tuple[str, ...],
        model_specs: tuple[P, ...] | None = None,
    ) -> TreeLayout:
        """The per-leaf specs for ``params`` on ``mesh`` over the data ``axes`` (and each leaf's model spec):
        hashable, stored in the state."""
        return TreeLayout.build(
            params,
            tx,
            mesh,
            axes,
            model_specs=model_specs,
            shard_params=self.shards_params,
            shard_grads=self.shards_optimizer,
            bucket_bytes=self.flat_bucket_bytes(mesh),
        )

    def flat_bucket_bytes(self, mesh: Mesh) -> int | None:
        """The size of the flat buffers the gradients are all-reduced in on ``mesh`` (None: leaf by leaf)."""
        return None

    @property
    def remat_policy(self) -> Any:
        """A ``jax.checkpoint`` policy for ``loss_fn``: which forward values the backward pass recomputes
        rather than keeps (None: keep everything, no ``jax.checkpoint``)."""
        return None

    def compute_params(self, ctx: ReduceContext, layout: TreeLayout, params: Any) -> Any:
        """Inside the step: the parameter tree the model is applied to."""
        return params

    def micro_grads(self, ctx: ReduceContext, layout: TreeLayout, grads: Any) -> Any:
        """Inside the step: one micro-batch's gradient in the form it is accumulated in."""
        return grads

    def store_params(self, layout: TreeLayout, mesh: Mesh, params: Any) -> Any:
        """In the global view, after the optimizer: the new parameters in their stored layout."""
        return params

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        """Sums the f32 ``stats`` vector and the accumulated gradients over the axis: ``(stats, reduced)``, each
        gradient leaf as ``layout.grad_specs`` says (whole, or this device's block)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ReduceContext:
    """What the strategy hooks need to know about the step: the data axes, how many devices they span, and the
    step's options."""

    axes: tuple[str, ...]
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

    def flat_bucket_bytes(self, mesh: Mesh) -> int | None:
        if self.bucket_bytes is None and len({d.process_index for d in mesh.devices.flat}) > 1:
            return _ONE_BUFFER
        return None if self.bucket_bytes is None else int(self.bucket_bytes)

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        if layout.bucket_bytes is None:
            stats, low = lax.psum((stats, cast(grads, ctx.reduce_dtype)), ctx.axes)
            return stats, jax.tree.map(lambda g, ref: g.astype(ref.dtype), low, grads)
        return _bucketed_psum(grads, stats, layout.bucket_bytes, ctx.reduce_dtype, ctx.axes)


@dataclasses.dataclass(frozen=True)
class ZeRO1(Strategy):
    """ZeRO stage 1: optimizer state split over the data axis (torch ``ZeroRedundancyOptimizer``).

    Each gradient leaf is reduce-scattered into this device's block (all split leaves of one dtype in one
    buffer, once per step); the optimizer updates the blocks of the parameters and its state in the global
    view, and XLA all-gathers the new parameters. Optimizer memory per device is about 1/N of DDP's. Any optax
    transformation works: it sees the model's tree.
    """

    name: ClassVar[str] = "zero1"
    shards_optimizer: ClassVar[bool] = True
    backends: ClassVar[tuple[str, ...]] = ("shard_map",)

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        return _psum_whole(ctx, layout, layout.scatter_sum(grads, ctx.reduce_dtype), stats)

    def store_params(self, layout: TreeLayout, mesh: Mesh, params: Any) -> Any:
        # The optimizer produced each leaf's blocks (its gradient's layout); one all-gather per dtype makes the
        # parameters whole again (XLA alone would gather leaf by leaf, and XLA:CPU pays per buffer).
        blocks = lax.with_sharding_constraint(params, layout.shardings(mesh, "grads"))
        return jax.shard_map(
            layout.gather_blocks,
            mesh=mesh,
            in_specs=(layout.manual_specs("grads"),),
            out_specs=P(),
            axis_names=set(layout.axes),
            check_vma=True,
        )(blocks)


@dataclasses.dataclass(frozen=True)
class ZeRO2(ZeRO1):
    """ZeRO stage 2: as :class:`ZeRO1`, and the gradient accumulator is split too.

    With ``make_train_step(..., accum_steps=k)`` each micro-batch's gradient is reduce-scattered into a split
    accumulator (k reduce-scatters per step: memory for communication, as DeepSpeed's stage 2), where ZeRO-1
    keeps a whole local accumulator and reduces once. With ``accum_steps=1`` the two compile to the same
    program.
    """

    name: ClassVar[str] = "zero2"

    def micro_grads(self, ctx: ReduceContext, layout: TreeLayout, grads: Any) -> Any:
        # Inside the shard group per micro-batch; across replica groups once per step, in reduce.
        return layout.scatter_sum(grads, ctx.reduce_dtype, across_replicas=False)

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        return _psum_whole(ctx, layout, grads, stats, across_replicas=True)


@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    """Fully sharded data parallelism (torch FSDP2 ``fully_shard``, ZeRO stage 3).

    Parameters, gradients and optimizer state are split per leaf over the data axis; ``state.params`` is the
    model's tree of sharded arrays. The step all-gathers each split leaf for the forward pass; the backward pass
    (the transpose of that all-gather) reduce-scatters each gradient straight into blocks; the optimizer updates
    the blocks in the global view. :meth:`TrainState.full_params <spmdcomm.TrainState.full_params>` gathers the
    whole tree.

    ``reshard_after_forward=True`` (default, as torch's): the gathered parameters are not kept for the backward
    pass, which gathers again each one it needs (a ``jax.checkpoint`` policy that keeps every computed value,
    the activations, and drops only what was moved: gathers and the reshapes and casts after them; no layer is
    recomputed). ``False`` keeps the gathered parameters from the forward to the backward pass (one all-gather
    per leaf instead of up to two). XLA:CPU in jax 0.10 merges the second gathers with the first (it drops the
    rematerialisation barrier before its common-subexpression pass), so on CPU both compile alike.
    ``param_dtype`` (e.g. ``jnp.bfloat16``): the model computes with low-precision copies of the gathered
    parameters while the blocks, the gradients and the optimizer stay float32 (torch's
    ``MixedPrecisionPolicy(param_dtype=...)``): the blocks are gathered in ``param_dtype`` (half the bytes for
    bfloat16) and the gradients reduce-scattered in it, or in the step's ``reduce_dtype`` when given.
    """

    name: ClassVar[str] = "fsdp"
    shards_params: ClassVar[bool] = True
    shards_optimizer: ClassVar[bool] = True
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

    @property
    def remat_policy(self) -> Any:
        # Only the gathered parameters are dropped after the forward pass (torch's resharding): activations are
        # kept, so the backward pass gathers again but recomputes no layer.
        return _keep_computed_values if self.reshard_after_forward else None

    def compute_params(self, ctx: ReduceContext, layout: TreeLayout, params: Any) -> Any:
        # Split leaves are gathered in the compute dtype; the backward pass reduce-scatters their gradient in the
        # step's reduce_dtype (else the compute dtype). Replicated leaves are cast to the compute dtype here.
        whole = layout.gather_params(params, self.param_dtype, ctx.reduce_dtype)
        if self.param_dtype is not None:
            leaves = jax.tree.leaves(whole)
            leaves = [
                x if split or not _is_float(x) else x.astype(self.param_dtype)
                for x, split in zip(leaves, layout.is_split("params"), strict=True)
            ]
            whole = jax.tree.unflatten(layout.treedef, leaves)
        return whole

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        return _psum_whole(ctx, layout, grads, stats, across_replicas=True)


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
            f"strategy={strategy!r} is not a strategy; expected one of {STRATEGIES} or a spmdcomm.train.Strategy.",
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
                "(its optimizer runs in the global view over per-leaf sharded arrays, which pmap cannot express).",
                fix='build the step with backend="shard_map" (the default), or use strategy="ddp" with the pmap '
                "backend.",
            )
        )


# --------------------------------------------------------------------------------------------------


def _keep_computed_values(prim: Any, *args: Any, **params: Any) -> bool:
    """A ``jax.checkpoint`` policy that keeps what the forward pass computed (activations) and drops what it only
    moved: gathers and the reshapes, slices, casts and transposes between a gather and its use. The backward pass
    then gathers each parameter again instead of keeping it (naming the gathered values is not enough: the
    policy would keep the reshape they were named from)."""
    return prim.name not in _MOVED


_MOVED = frozenset(
    {
        "all_gather",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "reshape",
        "transpose",
        "slice",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "concatenate",
        "copy",
        "copy_p",
        "name",
        "pvary",
        "pcast",
    }
)


def _is_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _psum_whole(
    ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array, *, across_replicas: bool = False
) -> tuple[jax.Array, Any]:
    """Sums ``stats`` and the leaves the shard axis does not split over the data axes, in one all-reduce; split
    leaves are already this device's block of the sum over the shard axis, and of the sum over the data axes
    unless ``across_replicas`` (FSDP's backward pass sums inside the shard group only: the blocks are then summed
    across the replica axes, hybrid sharding)."""
    leaves = jax.tree.leaves(grads)
    split = layout.is_split("grads")
    whole = [i for i, s in enumerate(split) if not s]
    stats, summed = lax.psum((stats, [cast(leaves[i], ctx.reduce_dtype) for i in whole]), ctx.axes)
    for i, s in zip(whole, summed, strict=True):
        leaves[i] = s.astype(leaves[i].dtype)
    if across_replicas and layout.replica_axes:
        blocks = [i for i, s in enumerate(split) if s]
        summed = lax.psum([cast(leaves[i], ctx.reduce_dtype) for i in blocks], layout.replica_axes)
        for i, s in zip(blocks, summed, strict=True):
            leaves[i] = s.astype(leaves[i].dtype)
    return stats, jax.tree.unflatten(layout.treedef, leaves)


def _bucketed_psum(
    grads: Any, stats: jax.Array, bucket_bytes: int, reduce_dtype: Any, axis: tuple[str, ...]
) -> tuple[jax.Array, Any]:
    """Sums ``stats`` and the gradients over the data axes ``axis`` in flat buckets; returns both sums.

    Without ``reduce_dtype`` the f32 ``stats`` vector leads the float32 buffer, so a model whose gradients
    fit one bucket needs ONE all-reduce buffer per step (each costs a round trip on gloo).
    """
    flat = FlatLayout.build(grads)
    vectors = flat.flatten(grads)
    fused = reduce_dtype is None
    stats_key = jnp.dtype(stats.dtype).name  # float64 under x64 when model state or metrics are float64
    if fused:
        vectors[stats_key] = jnp.concatenate([stats, vectors.get(stats_key, stats[:0])])
    else:
        stats = lax.psum(stats, axis)
    out = {}
    for name, vec in vectors.items():
        low = cast(vec, reduce_dtype)
        step = max(1, bucket_bytes // low.dtype.itemsize)
        chunks = [lax.psum(low[i : i + step], axis) for i in range(0, low.shape[0], step)]
        out[name] = (jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]).astype(vec.dtype)
    if fused:
        stats, out[stats_key] = out[stats_key][: stats.shape[0]], out[stats_key][stats.shape[0] :]
    return stats, flat.unflatten(out)
