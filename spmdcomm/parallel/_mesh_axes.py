"""The train state's mesh axes, checked against the mesh: the data axes the batch is split over, and each
parameter's split over the model axes (the mesh's other axes), from ``param_specs``, Flax partitioning boxes or NNX
sharding metadata; logical axis names (``nn.with_logical_partitioning``) are mapped to mesh axes by rules."""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdcomm.errors import AxisError, ShapeError, SpmdError, describe
from spmdcomm.parallel._logical_rules import LogicalNames, LogicalRules
from spmdcomm.parallel.pipeline.stack import Stacked, StageStacked, StageStackedLogical
from spmdcomm.runtime.mesh import check_mesh_axes

__all__ = ["data_axes", "check_data_axes", "model_partitioning", "nnx_logical_specs"]


def data_axes(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """``axis`` (one data axis or a tuple of them) as a tuple."""
    return tuple(axis) if isinstance(axis, tuple) else (axis,)


def check_data_axes(fn: str, mesh: Mesh, axis: Any) -> str | tuple[str, ...]:
    """``axis`` checked against ``mesh``: a mesh axis name, or a non-empty tuple of distinct ones (a tuple of
    one becomes its name)."""
    names = axis if isinstance(axis, tuple) else (axis,)
    if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
        raise AxisError(
            describe(
                fn,
                f"axis={axis!r} must be a mesh axis name or a tuple of distinct ones.",
                fix='pass e.g. axis="data", or axis=("replica", "shard") for hybrid sharding.',
            )
        )
    check_mesh_axes(fn, mesh, names)
    return names[0] if len(names) == 1 else names


def nnx_logical_specs(params: Any) -> Any:
    """The NNX ``params`` state with each ``Param``'s sharding metadata (``out_sharding``, ``sharding_rules``) as a
    :class:`LogicalNames` in place of its value (``P()`` without metadata); ``None`` when no parameter has any."""
    from flax import nnx

    found = False

    def one(v: Any) -> Any:
        nonlocal found
        if not isinstance(v, nnx.Variable):
            return None
        meta = v.get_metadata()
        names = meta.get("out_sharding")
        names = getattr(names, "sharding", names)  # a jax Format: its sharding
        names = getattr(names, "spec", names)  # a NamedSharding: its spec
        stacked = bool(meta.get("pipeline_stacked"))  # sc.nnx.PipelineStack's layers: dimension 0 is theirs
        found = found or bool(names) or stacked
        rules = meta.get("sharding_rules")
        spec = LogicalNames(names, rules or None, strict=False, source="NNX sharding metadata") if names else P()
        return v.replace(Stacked(spec) if stacked else spec)

    specs = jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return specs if found else None


def model_partitioning(
    fn: str,
    params: Any,
    param_specs: Any,
    mesh: Mesh,
    axes: tuple[str, ...],
    rules: LogicalRules,
    *,
    stage: str | None = None,
) -> tuple[Any, tuple[P, ...] | None]:
    """``(params, model specs)``: Flax ``nn.Partitioned`` boxes in ``params`` unboxed into their specs, or
    ``param_specs`` (a tree like ``params``) flattened; logical names (``nn.LogicallyPartitioned`` boxes,
    :class:`LogicalNames` entries) mapped to mesh axes by ``rules``; each spec checked against the mesh's model
    axes and the leaf's shape. ``None`` when no leaf is split over a model axis."""
    from flax.core import meta

    boxed = any(isinstance(x, meta.AxisMetadata) for x in jax.tree.leaves(params, is_leaf=_is_box))
    if boxed:
        if param_specs is not None:
            raise SpmdError(
                describe(
                    fn,
                    "params carry Flax partitioning metadata (nn.with_partitioning) and param_specs was given too.",
                    fix="give one: drop param_specs, or pass nn.unbox(params).",
                )
            )
        param_specs = jax.tree.map(_box_spec, params, is_leaf=_is_box)
        params = meta.unbox(params)
    if param_specs is None:
        param_specs = _arriving_specs(fn, params, mesh, axes)
    if param_specs is None:
        return params, None
    # jax.tree_util.PyTreeDef: jaxlib ships no type stubs, so mypy knows a treedef's methods only through this name
    treedef: jax.tree_util.PyTreeDef
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    try:
        specs = treedef.flatten_up_to(param_specs)
    except (ValueError, TypeError) as e:
        raise SpmdError(
            describe(
                fn,
                f"param_specs does not have the structure of params: {e}",
                fix="give a tree like params with a PartitionSpec (or None) per leaf.",
            )
        ) from None
    model_axes = tuple(a for a in mesh.axis_names if a not in axes)
    out = []
    for (path, leaf), spec in zip(flat, specs, strict=True):
        name, origin = jax.tree_util.keystr(path), ""
        stacked = isinstance(spec, Stacked)
        spec = spec.rest if stacked else spec
        if isinstance(spec, LogicalNames):
            spec, origin = rules.map(name, spec, mesh, axes)
        if stacked:
            spec = P(stage, *(P() if spec is None else spec))
        out.append(_check_model_spec(fn, name, np.shape(leaf), spec, mesh, axes, model_axes, origin))
    rules.warn_missing(mesh)
    return params, tuple(out) if any(s != P() for s in out) else None


# ---------------------------------------------------------------------------------------------------------


def _arriving_specs(fn: str, params: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
    """The model split that ``params`` arrive with, when no box or ``param_specs`` gives one: each ``jax.Array``
    leaf's ``NamedSharding`` spec, kept over the state's model axes (a parameter initialised split for tensor
    parallelism stays split), without data axes (the strategy's to split over); a split over an axis the state's mesh
    lacks is dropped with one warning naming the leaves. ``None`` when no leaf arrives split over a model axis."""
    dropped: list[str] = []

    def one(path: Any, x: Any) -> P:
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if not isinstance(x, jax.Array) or spec is None:
            return P()
        entries = []
        for entry in spec:
            names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            lost = [a for a in names if a not in mesh.axis_names]
            if lost:
                dropped.append(f"params{jax.tree_util.keystr(path)} over {lost} ({spec})")
            kept = tuple(a for a in names if a in mesh.axis_names and a not in axes)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return P(*entries)

    specs = jax.tree_util.tree_map_with_path(one, params)
    if dropped:
        warnings.warn(
            describe(
                fn,
                f"parameters arrive split over mesh axes that the state's mesh {dict(mesh.shape)} lacks, so they are "
                f"stored whole over them: {'; '.join(dropped)}.",
                fix="create the state on a mesh with those axes, or give param_specs= (or nn.with_partitioning "
                "boxes) over the state's model axes.",
            ),
            UserWarning,
            stacklevel=4,
        )
    return specs if any(any(e is not None for e in spec) for spec in jax.tree.leaves(specs, is_leaf=_is_spec)) else None


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _box_spec(x: Any) -> Any:
    """A Flax box's spec entry: ``LogicalNames`` for ``nn.LogicallyPartitioned``, the spec of an ``nn.Partitioned``
    (:class:`Stacked` for a ``PipelineStack``'s layers), ``P()`` for an array."""
    import flax.linen as nn
    from flax.core import meta

    if isinstance(x, StageStackedLogical):
        return Stacked(LogicalNames(x.names[1:], x.rules, strict=True, source="nn.with_logical_partitioning"))
    if isinstance(x, StageStacked):
        return Stacked(P(*x.names[1:]))
    if isinstance(x, nn.LogicallyPartitioned):
        return LogicalNames(x.names, x.rules, strict=True, source="nn.with_logical_partitioning")
    if isinstance(x, meta.Partitioned):
        return x.get_partition_spec()
    return P() if hasattr(x, "shape") else None


def _check_model_spec(
    fn: str,
    name: str,
    shape: tuple[int, ...],
    spec: Any,
    mesh: Mesh,
    axes: tuple[str, ...],
    model_axes: tuple[str, ...],
    origin: str = "",
) -> P:
    if spec is None:
        return P()
    if not isinstance(spec, P):
        spec = P(*spec) if isinstance(spec, (tuple, list)) else spec
    if not isinstance(spec, P):
        raise SpmdError(
            describe(fn, f"param_specs gives {spec!r}, not a PartitionSpec.", leaf=f"params{name}", fix="give P(...).")
        )
    if len(spec) > len(shape):
        raise ShapeError(
            describe(
                fn,
                f"spec {spec}{origin} has {len(spec)} entries but the leaf has shape {shape}.",
                leaf=f"params{name}",
                fix="give at most one entry per dimension.",
            )
        )
    for dim, entry in enumerate(spec):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        for a in names:
            if a in axes:
                raise AxisError(
                    describe(
                        fn,
                        f"spec {spec}{origin} splits dimension {dim} over {a!r}, a data axis; the strategy decides how "
                        f"parameters are split over the data axes {axes}.",
                        leaf=f"params{name}",
                        fix=f"name only model axes {model_axes} in parameter specs.",
                    )
                )
            if a not in model_axes:
                raise AxisError(
                    describe(
                        fn,
                        f"spec {spec}{origin} names {a!r}, which is not an axis of the mesh {dict(mesh.shape)}.",
                        leaf=f"params{name}",
                        fix=f"name the mesh's model axes {model_axes}; for logical names, use "
                        "nn.with_logical_partitioning and give their rules: "
                        "TrainState.create(..., logical_axis_rules=[(name, mesh axis), ...]).",
                    )
                )
        k = math.prod(int(mesh.shape[a]) for a in names)
        if shape[dim] % k:
            raise ShapeError(
                describe(
                    fn,
                    f"spec {spec}{origin} splits dimension {dim} of size {shape[dim]} over {names} ({k} devices), "
                    "which does not divide it.",
                    leaf=f"params{name}",
                    fix=f"make dimension {dim} a multiple of {k}, or split another dimension.",
                )
            )
    return spec


def _is_box(x: Any) -> bool:
    from flax.core import meta

    return isinstance(x, meta.AxisMetadata)
