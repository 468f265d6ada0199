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
(:func:`spmdcomm.parallel.data.layout.shard_spec`); a leaf that no dimension divides is stored padded with zeros on one
dimension (as torch FSDP2 pads uneven shards), and only leaves of fewer elements than the axis has devices stay
replicated. The optimizer runs in the global view (``jax.jit`` over these sharded arrays), on every leaf cut to its
own shape: optax sees the model's tree with its true shapes, so masks and labels by path or shape, global-norm
clipping, per-leaf trust ratios (LAMB, LARS) and factored statistics (Adafactor) are exactly those of one device,
and XLA inserts the small reductions they need. A padded leaf of ``state.params`` or ``state.opt_state`` has its
stored (padded) shape; :meth:`TrainState.full_params <spmdcomm.TrainState.full_params>` and checkpoints give the
model's own shapes.

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
from jax import lax
from jax.sharding import Mesh

from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.data._flat import FlatLayout, cast, flat_key
from spmdcomm.parallel.data.fsdp import FSDP
from spmdcomm.parallel.data.layout import TreeLayout
from spmdcomm.parallel.data.strategy import ReduceContext, Strategy, psum_whole

__all__ = ["Strategy", "DDP", "ZeRO1", "ZeRO2", "FSDP", "STRATEGIES"]

_ONE_BUFFER = 2**40  # a bucket size no model reaches: one flat all-reduce buffer per dtype


@dataclasses.dataclass(frozen=True)
class DDP(Strategy):
    """Replicated parameters and optimizer state; gradients all-reduced (torch ``DistributedDataParallel``).

    Args:
      bucket_bytes: ``None`` (default) chooses: leaf by leaf within one process (XLA fuses the leaves into
        one variadic all-reduce, and flattening costs more than it saves there), one flat buffer per dtype when
        the mesh spans several processes (each gloo/NCCL call has a fixed cost; measured 2x faster for a small
        CNN over gloo), with the step's metrics riding in it. An int flattens the gradients into buffers of at
        most that many bytes, one all-reduce each (torch's ``bucket_cap_mb``).

    Raises:
      SpmdError: when ``bucket_bytes`` is neither ``None`` nor a positive int.

    Examples:
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

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        return psum_whole(ctx, layout, layout.scatter_sum(grads, ctx.reduce_dtype), stats)

    def store_params(self, layout: TreeLayout, mesh: Mesh, params: Any) -> Any:
        # The optimizer produced each leaf's blocks (its gradient's layout, padded leaves at their own shape); one
        # all-gather per dtype makes the parameters whole again (XLA alone would gather leaf by leaf, and XLA:CPU
        # pays per buffer).
        blocks = lax.with_sharding_constraint(layout.stored(params, "grads", mesh), layout.shardings(mesh, "grads"))
        return jax.shard_map(
            layout.gather_blocks,
            mesh=mesh,
            in_specs=(layout.manual_specs("grads"),),
            out_specs=layout.manual_specs("params"),
            axis_names=set(layout.manual_axes),
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
        return psum_whole(ctx, layout, grads, stats, across_replicas=True)


#: Each strategy class by its name: the one list of strategies.
BY_NAME: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, ZeRO1, ZeRO2, FSDP)}

#: The names ``TrainState.create(..., strategy=...)`` accepts besides :class:`Strategy` objects.
STRATEGIES: tuple[str, ...] = tuple(BY_NAME)


def resolve_strategy(fn: str, strategy: Strategy | str) -> Strategy:
    """The :class:`Strategy` for ``strategy`` (an object, or one of :data:`STRATEGIES`).

    >>> from spmdcomm.parallel.data.strategies import resolve_strategy
    >>> resolve_strategy("TrainState.create", "zero2")
    ZeRO2()
    """
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy in BY_NAME:
        return BY_NAME[strategy]()
    names = ", ".join(repr(name) for name in STRATEGIES)
    raise SpmdError(
        describe(
            fn,
            f"strategy={strategy!r} is not a strategy; expected one of {STRATEGIES} or a spmdcomm.train.Strategy.",
            fix=f"pass strategy= one of {names} (default {DDP.name!r}), or an object such as "
            "spmdcomm.DDP(bucket_bytes=...) or spmdcomm.FSDP(param_dtype=jnp.bfloat16).",
        )
    )


# --------------------------------------------------------------------------------------------------


def _bucketed_psum(
    grads: Any, stats: jax.Array, bucket_bytes: int, reduce_dtype: Any, axis: tuple[str, ...]
) -> tuple[jax.Array, Any]:
    """Sums ``stats`` and the gradients over the data axes ``axis`` in flat buckets; returns both sums.

    Without ``reduce_dtype`` the f32 ``stats`` vector leads the float32 buffer, so a model whose gradients
    fit one bucket needs ONE all-reduce buffer per step (each costs a round trip on gloo).
    """
    flat = FlatLayout.build(grads, exclude=axis)
    vectors = flat.flatten(grads)
    fused = reduce_dtype is None
    stats_key = flat_key(stats, exclude=axis)  # float64 under x64 when model state or metrics are float64
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
