"""The roles of a train state's mesh axes, named once: which axes split the batch (and of those, which replicate the
state and which shard it), which splits a pipeline's layers, and which belong to the model (tensor parallelism)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import Mesh

from spmdcomm.errors import AxisError, SpmdError, describe
from spmdcomm.parallel._mesh_axes import check_data_axes, data_axes
from spmdcomm.parallel.context import ContextParallel
from spmdcomm.parallel.pipeline.pipeline import Pipeline, check_schedule

__all__ = ["MeshRoles", "mesh_roles", "with_data_axis"]


@dataclasses.dataclass(frozen=True)
class MeshRoles:
    """What each axis of a train state's mesh does (``state.roles``; torchtitan's ``ParallelDims``, FSDP2's
    ``DataParallelMeshDims``).

    Attributes:
      data: the data axes: the batch is split over them; ZeRO and FSDP shard the state over the last
        (:attr:`shard`) and replicate it over the others (:attr:`replicate`, hybrid sharding).
      stage: the pipeline's stage axis (None without a pipeline): the stacked layers are split over it, and the
        batch too, as over one more data axis, outside the stack.
      model: every other axis: the model's own (tensor parallelism), left to XLA inside the steps.
      sizes: each axis's size.
      context: the context axis (None without one): every sequence of the batch (dimension 1) is split over it.
    """

    data: tuple[str, ...]
    stage: str | None
    model: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    context: str | None = None

    @property
    def shard(self) -> str:
        """The data axis ZeRO and FSDP split the state over (the last data axis)."""
        return self.data[-1]

    @property
    def replicate(self) -> tuple[str, ...]:
        """The data axes the state is replicated over (every data axis but the last)."""
        return self.data[:-1]

    @property
    def batch(self) -> tuple[str, ...]:
        """The axes the batch is split over, in row-major order: the data axes, then the stage axis."""
        return self.data + ((self.stage,) if self.stage else ())

    @property
    def manual(self) -> tuple[str, ...]:
        """The axes the steps map by hand (``shard_map``): the batch axes and the context axis; the model axes are
        XLA's."""
        return self.batch + ((self.context,) if self.context else ())

    @property
    def blocks(self) -> int:
        """How many blocks the batch is cut into: one per device of the batch axes and the context axis."""
        return self.size(self.manual)

    def size(self, axes: tuple[str, ...]) -> int:
        """The number of devices ``axes`` span together."""
        table = dict(self.sizes)
        return math.prod(table[a] for a in axes)

    def __str__(self) -> str:
        table = dict(self.sizes)
        parts = [f"replicate {a}={table[a]}" for a in self.replicate] + [f"shard {self.shard}={table[self.shard]}"]
        parts += [f"stage {self.stage}={table[self.stage]}"] if self.stage else []
        parts += [f"context {self.context}={table[self.context]}"] if self.context else []
        parts += [f"model {a}={table[a]}" for a in self.model]
        return ", ".join(parts)


def mesh_roles(
    fn: str, mesh: Mesh, axis: object, pipeline: Pipeline | None, context: ContextParallel | None = None
) -> MeshRoles:
    """The roles of ``mesh``'s axes for data axis (or axes) ``axis``, ``pipeline`` and ``context``, checked: raises
    :class:`~spmdcomm.errors.AxisError` for a data, stage or context axis the mesh lacks or an axis given two roles,
    and :class:`~spmdcomm.errors.SpmdError` for a schedule the stage count cannot run."""
    data = data_axes(check_data_axes(fn, mesh, axis))
    stage = None
    if pipeline is not None:
        if not isinstance(pipeline, Pipeline):
            raise SpmdError(
                describe(fn, f"pipeline={pipeline!r} is not a Pipeline.", fix="pass sc.Pipeline(microbatches=...).")
            )
        stage = pipeline.axis
        if stage not in mesh.axis_names or stage in data:
            raise AxisError(
                describe(
                    fn,
                    f"the pipeline's stage axis {stage!r} must be a mesh axis that is not a data axis; the mesh has "
                    f"{dict(mesh.shape)} and the data axes are {data}.",
                    fix=f"add a {stage!r} axis to the mesh, e.g. sc.make_mesh({{'data': 2, {stage!r}: 4}}), or "
                    "name yours with sc.Pipeline(axis=...).",
                )
            )
        check_schedule(fn, pipeline, int(mesh.shape[stage]), None, None)
    seq = None
    if context is not None:
        if not isinstance(context, ContextParallel):
            raise SpmdError(
                describe(fn, f"context={context!r} is not a ContextParallel.", fix="pass sc.ContextParallel().")
            )
        seq = context.axis
        if seq not in mesh.axis_names or seq in data or seq == stage:
            raise AxisError(
                describe(
                    fn,
                    f"the context axis {seq!r} must be a mesh axis that is neither a data axis nor the stage axis; "
                    f"the mesh has {dict(mesh.shape)}, the data axes are {data} and the stage axis {stage!r}.",
                    fix=f"add a {seq!r} axis to the mesh, e.g. sc.make_mesh({{'data': 2, {seq!r}: 4}}), or name "
                    "yours with sc.ContextParallel(axis=...).",
                )
            )
    model = tuple(a for a in mesh.axis_names if a not in data and a not in (stage, seq))
    return MeshRoles(data, stage, model, tuple((a, int(n)) for a, n in mesh.shape.items()), seq)


def with_data_axis(fn: str, mesh: Mesh, axis: object, pipeline: object) -> Mesh:
    """``mesh``, or, when it lacks the data axis ``axis`` (one name) and has ``pipeline``'s stage axis, ``mesh``
    with ``axis`` in front at size 1: a mesh of stage (and model) axes runs its pipeline with one data replica,
    through the same step as any layout. Raises :class:`~spmdcomm.errors.AxisError` when the mesh has neither;
    any other mesh is returned as it is, for :func:`mesh_roles` to check."""
    if not isinstance(axis, str) or axis in mesh.axis_names or not isinstance(pipeline, Pipeline):
        return mesh
    if pipeline.axis not in mesh.axis_names:
        raise AxisError(
            describe(
                fn,
                f"the mesh {dict(mesh.shape)} has neither the data axis {axis!r} nor the pipeline's stage axis "
                f"{pipeline.axis!r}.",
                fix=f"name the mesh's stage axis with sc.Pipeline(axis=...) (and its data axis with axis=...), or "
                f"make the mesh e.g. sc.make_mesh({{{pipeline.axis!r}: -1}}).",
            )
        )
    kind = mesh.axis_types[mesh.axis_names.index(pipeline.axis)]
    return Mesh(mesh.devices[np.newaxis], (axis, *mesh.axis_names), axis_types=(kind, *mesh.axis_types))
