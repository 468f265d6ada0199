"""The roles of a train state's mesh axes, named once: which axes split the batch (and of those, which replicate the
state and which shard it), which axis each registered parallelism (:mod:`spmdcomm.parallel.registry`) runs over, and
which belong to the model (tensor parallelism)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import Mesh

from spmdcomm.errors import AxisError, SpmdError, describe
from spmdcomm.parallel._mesh_axes import check_data_axes, data_axes
from spmdcomm.parallel.registry import Parallelism, registered

__all__ = ["MeshRoles", "parallel_configs", "with_data_axis", "mesh_roles", "active", "by_keyword"]


@dataclasses.dataclass(frozen=True)
class MeshRoles:
    """What each axis of a train state's mesh does (``state.roles``; torchtitan's ``ParallelDims``, FSDP2's
    ``DataParallelMeshDims``).

    Attributes:
      data: the data axes: the batch is split over them; ZeRO and FSDP shard the state over the last
        (:attr:`shard`) and replicate it over the others (:attr:`replicate`, hybrid sharding).
      model: every other axis: the model's own (tensor parallelism), left to XLA inside the steps.
      sizes: each axis's size.
      parallel: ``(role, axis)`` of each parallelism the state runs, in registration order (:meth:`axis`).
    """

    data: tuple[str, ...]
    model: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    parallel: tuple[tuple[str, str], ...] = ()

    def axis(self, role: str) -> str | None:
        """The axis of the parallelism with role ``role`` (``"stage"``, ``"context"``, ...); None without it."""
        return dict(self.parallel).get(role)

    @property
    def stage(self) -> str | None:
        """The pipeline's stage axis (None without a pipeline): the stacked layers are split over it, and the
        batch too, as over one more data axis, outside the stack."""
        return self.axis("stage")

    @property
    def context(self) -> str | None:
        """The context axis (None without one): every sequence of the batch (dimension 1) is split over it."""
        return self.axis("context")

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
        """The axes the batch's rows are split over, in row-major order: the data axes, then the axes of the
        parallelisms that split rows (the stage axis)."""
        return self.data + self._axes(lambda p: p.rows)

    @property
    def tokens(self) -> tuple[str, ...]:
        """The axes that split the tokens of every row (the context axis): every device of them counts its rows."""
        return self._axes(lambda p: not p.rows)

    @property
    def stacked(self) -> tuple[str, ...]:
        """The axes whose parallelism owns the parameter leaves split over them on dimension 0 (the stage axis)."""
        return self._axes(lambda p: p.stacks)

    @property
    def manual(self) -> tuple[str, ...]:
        """The axes the steps map by hand (``shard_map``): the batch axes and the token axes; the model axes are
        XLA's."""
        return self.batch + self.tokens

    @property
    def blocks(self) -> int:
        """How many blocks the batch is cut into: one per device of the batch axes and the token axes."""
        return self.size(self.manual)

    def size(self, axes: tuple[str, ...]) -> int:
        """The number of devices ``axes`` span together."""
        table = dict(self.sizes)
        return math.prod(table[a] for a in axes)

    def __str__(self) -> str:
        table = dict(self.sizes)
        parts = [f"replicate {a}={table[a]}" for a in self.replicate] + [f"shard {self.shard}={table[self.shard]}"]
        parts += [f"{role} {a}={table[a]}" for role, a in self.parallel]
        parts += [f"model {a}={table[a]}" for a in self.model]
        return ", ".join(parts)

    def _axes(self, keep: Any) -> tuple[str, ...]:
        kinds = {p.role: p for p in registered()}
        return tuple(a for role, a in self.parallel if keep(kinds[role]))


def parallel_configs(fn: str, mesh: Mesh, given: dict[str, Any]) -> dict[str, Any]:
    """``{keyword: config}`` of the parallelisms a state on ``mesh`` runs, in registration order: the configs
    ``given`` by keyword (``None``: not given), and for a parallelism given none that a mesh axis of its name turns
    on (:attr:`~spmdcomm.parallel.registry.Parallelism.by_name`), its default config. Raises
    :class:`~spmdcomm.errors.SpmdError` for a keyword no parallelism registered or a config of the wrong type."""
    entries = {p.keyword: p for p in registered()}
    unknown = sorted(k for k, v in given.items() if k not in entries)
    if unknown:
        raise SpmdError(
            describe(
                fn,
                f"{unknown} name no parallelism; the registered ones take {sorted(entries)}.",
                fix="pass a parallelism's config by its keyword, e.g. pipeline=sc.Pipeline(microbatches=...).",
            )
        )
    out = {}
    for key, entry in entries.items():
        config = given.get(key)
        if config is None and entry.by_name is not None and entry.by_name in mesh.axis_names:
            config = entry.config()
        if config is None:
            continue
        if not isinstance(config, entry.config):
            raise SpmdError(
                describe(fn, f"{key}={config!r} is not a {entry.config.__name__}.", fix=f"pass {entry.example}.")
            )
        out[key] = config
    return out


def with_data_axis(fn: str, mesh: Mesh, axis: object, configs: dict[str, Any]) -> Mesh:
    """``mesh``, or, when it lacks the data axis ``axis`` (one name) and has the axis of a parallelism in
    ``configs`` that splits the batch's rows (the stage axis), ``mesh`` with ``axis`` in front at size 1: a mesh of
    stage (and model) axes runs its pipeline with one data replica, through the same step as any layout. Raises
    :class:`~spmdcomm.errors.AxisError` when the mesh has neither; any other mesh is returned as it is, for
    :func:`mesh_roles` to check."""
    rows = [(entry, config) for entry, config in active(configs) if entry.rows]
    if not isinstance(axis, str) or axis in mesh.axis_names or not rows:
        return mesh
    present = [config.axis for _, config in rows if config.axis in mesh.axis_names]
    if not present:
        entry, config = rows[0]
        raise AxisError(
            describe(
                fn,
                f"the mesh {dict(mesh.shape)} has neither the data axis {axis!r} nor {entry.axis_words} "
                f"{config.axis!r}.",
                fix=f"name the mesh's {entry.role} axis with sc.{entry.config.__name__}(axis=...) (and its data "
                f"axis with axis=...), or make the mesh e.g. sc.make_mesh({{{config.axis!r}: -1}}).",
            )
        )
    kind = mesh.axis_types[mesh.axis_names.index(present[0])]
    return Mesh(mesh.devices[np.newaxis], (axis, *mesh.axis_names), axis_types=(kind, *mesh.axis_types))


def mesh_roles(fn: str, mesh: Mesh, axis: object, configs: dict[str, Any]) -> MeshRoles:
    """The roles of ``mesh``'s axes for data axis (or axes) ``axis`` and the parallelisms' ``configs`` (from
    :func:`parallel_configs`), checked: raises :class:`~spmdcomm.errors.AxisError` for a data axis or a
    parallelism's axis the mesh lacks or an axis given two roles, and what a parallelism's own check raises
    (:class:`~spmdcomm.errors.SpmdError` for a schedule the stage count cannot run)."""
    data = data_axes(check_data_axes(fn, mesh, axis))
    parallel: list[tuple[str, str]] = []
    kinds = {p.role: p for p in registered()}
    for entry, config in active(configs):
        own = config.axis
        taken = dict(parallel)
        if own not in mesh.axis_names or own in data or own in taken.values():
            others = f" and the other parallelisms' axes {taken}" if taken else ""
            raise AxisError(
                describe(
                    fn,
                    f"{entry.axis_words} {own!r} must be a mesh axis of its own, not a data axis or another "
                    f"parallelism's axis; the mesh has {dict(mesh.shape)}, the data axes are {data}{others}.",
                    fix=f"add a {own!r} axis to the mesh, e.g. sc.make_mesh({{'data': 2, {own!r}: 4}}), or name "
                    f"yours with sc.{entry.config.__name__}(axis=...).",
                )
            )
        if not entry.rows and any(not kinds[role].rows for role, _ in parallel):
            raise AxisError(
                describe(
                    fn,
                    f"{entry.axis_words} {own!r} splits the tokens of every row, and so does another parallelism's "
                    f"axis of {parallel}: a sequence has one order over one axis.",
                    fix=f"run one of them (drop {entry.keyword}=...).",
                )
            )
        if entry.check is not None:
            entry.check(fn, config, mesh)
        parallel.append((entry.role, own))
    owned = {a for _, a in parallel}
    model = tuple(a for a in mesh.axis_names if a not in data and a not in owned)
    return MeshRoles(data, model, tuple((a, int(n)) for a, n in mesh.shape.items()), tuple(parallel))


def active(configs: dict[str, Any]) -> list[tuple[Parallelism, Any]]:
    """``(entry, config)`` of each parallelism with a config in ``configs`` (``{keyword: config or None}``), in
    registration order."""
    return [(p, configs[p.keyword]) for p in registered() if configs.get(p.keyword) is not None]


def by_keyword(configs: tuple[Any, ...]) -> dict[str, Any]:
    """``{keyword: config}`` of ``configs`` (a state's, ``None`` for one it lacks), in registration order."""
    given = {type(c): c for c in configs if c is not None}
    return {p.keyword: given[p.config] for p in registered() if p.config in given}
