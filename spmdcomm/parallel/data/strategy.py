"""The interface every data-parallel strategy implements: the hooks the state, the steps and the checkpoints call,
so that no generic code asks which strategy it runs. The strategies: :mod:`spmdcomm.parallel.data.strategies`."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdcomm.parallel.data._flat import cast
from spmdcomm.parallel.data.layout import TreeLayout


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Base class of the data-parallel strategies.

    The strategies are :class:`~spmdcomm.DDP`, :class:`~spmdcomm.ZeRO1`, :class:`~spmdcomm.ZeRO2` and
    :class:`~spmdcomm.FSDP`. ``layout`` (when the state is created) decides each leaf's ``PartitionSpec``. Inside
    the compiled step, which is manual over the data axis: ``compute_params`` (the parameter tree the model sees),
    per micro-batch ``micro_grads`` (the local gradient in the form the strategy accumulates), then ``reduce`` (its
    sum over the axis, each leaf in its ``grad_specs`` form). The optimizer then runs in the global view on that
    tree, and ``store_params`` puts the new parameters in their stored layout.
    """

    #: The name ``TrainState.create(..., strategy=...)`` accepts and a checkpoint records.
    name: ClassVar[str]
    #: True when the stored parameters are split: the step differentiates with respect to the blocks, and the
    #: gradient of a split leaf comes out already summed over the axis (the transpose of the gather).
    shards_params: ClassVar[bool] = False
    #: True when reduced gradients and the optimizer state are split per leaf.
    shards_optimizer: ClassVar[bool] = False

    def layout(
        self,
        params: Any,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        axes: tuple[str, ...],
        model_specs: tuple[P, ...] | None = None,
        *,
        stacked: tuple[str, ...] = (),
    ) -> TreeLayout:
        """The per-leaf specs for ``params`` on ``mesh`` over the data ``axes`` (and each leaf's model spec).

        Args:
          params: the model's parameter tree, as ``TrainState.create`` got it.
          tx: the optax transformation; its state's leaves get specs too.
          mesh: the mesh the state lives on.
          axes: the data axes (a tuple of mesh axis names) the batch is split over.
          model_specs: each parameter leaf's ``PartitionSpec`` over the model axes, in the tree's leaf order;
            ``None`` when no leaf is split over a model axis.
          stacked: the axes whose parallelism owns the leaves split over them on dimension 0 (a pipeline's stage
            axis: those leaves hold stacked layers).

        Returns:
          The :class:`~spmdcomm.parallel.data.layout.TreeLayout` of parameters, gradients and optimizer state: hashable,
          stored in the state.
        """
        return TreeLayout.build(
            params,
            tx,
            mesh,
            axes,
            model_specs=model_specs,
            stacked=stacked,
            shard_params=self.shards_params,
            shard_grads=self.shards_optimizer,
            bucket_bytes=self.flat_bucket_bytes(mesh),
        )

    def flat_bucket_bytes(self, mesh: Mesh) -> int | None:
        """The size of the flat buffers the gradients are all-reduced in on ``mesh``.

        Args:
          mesh: the mesh the state lives on.

        Returns:
          The bucket size in bytes, or ``None``: leaf by leaf (the base class's answer).
        """
        return None

    @property
    def remat_policy(self) -> Any:
        """The ``jax.checkpoint`` policy the step applies to ``loss_fn``.

        It says which forward values the backward pass recomputes rather than keeps (None: keep everything, no
        ``jax.checkpoint``).
        """
        return None

    @property
    def local_grads(self) -> bool:
        """Whether a device's gradient holds only terms of its own loss.

        If so, the step may zero the gradient of a micro-batch without real examples (its backward pass may give
        0 * NaN). False when split parameters bring every device's terms in through the transpose of their gather.
        """
        return not self.shards_params

    def full_params(self, layout: TreeLayout, mesh: Mesh, params: Any) -> Any:
        """In the global view: the stored ``params`` as the model's whole tree (split over model axes only).

        Args:
          layout: the state's layout.
          mesh: the state's mesh.
          params: the stored parameters (``state.params``).

        Returns:
          The parameter tree, whole over the data axes: ``params`` itself unless the strategy splits them.
        """
        return params

    def compute_params(self, ctx: ReduceContext, layout: TreeLayout, params: Any) -> Any:
        """Inside the step: the parameter tree the model is applied to.

        Args:
          ctx: the step's data axes, their device count and options.
          layout: the state's layout.
          params: this device's view of the stored parameters.

        Returns:
          The parameters the model sees: ``params`` itself unless the strategy splits or casts them.
        """
        return params

    def micro_grads(self, ctx: ReduceContext, layout: TreeLayout, grads: Any) -> Any:
        """Inside the step: one micro-batch's gradient in the form it is accumulated in.

        Args:
          ctx: the step's data axes, their device count and options.
          layout: the state's layout.
          grads: this device's gradient of one micro-batch.

        Returns:
          The gradient to add to the accumulator: ``grads`` itself unless the strategy reduces per micro-batch.
        """
        return grads

    def store_params(self, layout: TreeLayout, mesh: Mesh, params: Any) -> Any:
        """In the global view, after the optimizer: the new parameters in their stored layout.

        Args:
          layout: the state's layout.
          mesh: the state's mesh.
          params: the parameters the optimizer produced.

        Returns:
          The parameters laid out as ``state.params`` stores them: ``params`` itself unless the strategy moves them.
        """
        return params

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        """Sums the ``stats`` vector and the accumulated gradients over the data axes.

        Args:
          ctx: the step's data axes, their device count and options (``reduce_dtype``).
          layout: the state's layout.
          grads: this device's accumulated gradient.
          stats: one float vector (float32, float64 under x64) of the real-example count, the metric sums and the
            model state, summed along with the gradients.

        Returns:
          ``(stats, reduced)``: the summed vector, and each gradient leaf summed as ``layout.grad_specs`` says
          (whole, or this device's block).
        """
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ReduceContext:
    """What the strategy hooks need to know about the step: the data axes, how many devices they span, and the
    step's options."""

    axes: tuple[str, ...]
    size: int
    reduce_dtype: Any
    skip_nonfinite: bool


def psum_whole(
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
