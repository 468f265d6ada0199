"""The train state's mesh axes, checked against the mesh: the data axes the batch is split over, and each
parameter's split over the model axes (the mesh's other axes), from ``param_specs``, Flax partitioning boxes or NNX
sharding metadata; logical axis names (``nn.with_logical_partitioning``) are mapped to mesh axes by rules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdcomm.errors import AxisError, ShapeError, SpmdError, describe
from spmdcomm.runtime.mesh import check_mesh_axes
from spmdcomm.train.stack import Stacked, StageStacked, StageStackedLogical

__all__ = [
    "data_axes",
    "check_data_axes",
    "model_partitioning",
    "LogicalNames",
    "LogicalRules",
    "nnx_logical_specs",
    "step_axis_rules",
]


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


class LogicalNames:
    """A leaf's dimension names still to be mapped to mesh axes by rules (a spec entry of ``model_partitioning``).

    ``strict``: every name is logical and needs a rule (Linen ``LogicallyPartitioned``); otherwise a name with no
    rule that is a mesh axis stays that axis (NNX ``out_sharding``, as ``nnx.get_partition_spec`` reads it).
    ``rules``: the box's or variable's own rules (``None``: none)."""

    def __init__(self, names: Sequence[Any], rules: Any, *, strict: bool, source: str) -> None:
        self.names = tuple(tuple(n) if isinstance(n, list) else n for n in names)
        self.rules, self.strict, self.source = rules, strict, source

    def __repr__(self) -> str:
        return f"LogicalNames({self.names!r})"


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
    return params, tuple(out) if any(s != P() for s in out) else None


# ---------------------------------------------------------------------------------------------------------


def step_axis_rules(rules: Any, axes: tuple[str, ...]) -> Any:
    """A context manager that makes ``rules`` (``None``: the active ``nn.logical_axis_rules`` context) with their
    data axes dropped the active Flax rules while the step traces the model: inside the step the data axes are
    manual, and each device's block of the batch is already its data split, so a ``nn.with_logical_constraint``
    keeps only its model axes (JAX refuses a sharding constraint naming a manual axis)."""
    import contextlib

    from flax.core import spmd

    rules = spmd.get_logical_axis_rules() if rules is None else rules
    if not rules:
        return contextlib.nullcontext()
    local = []
    for name, target in rules:
        if isinstance(target, (tuple, list)):
            kept = tuple(a for a in target if a not in axes)
            target = None if not kept else kept[0] if len(kept) == 1 else kept
        elif isinstance(target, str) and target in axes:
            target = None
        local.append((name, target))
    return spmd.logical_axis_rules(tuple(local))


class LogicalRules:
    """The logical axis rules in force for a new state: ``logical_axis_rules`` as given, else the active
    ``nn.logical_axis_rules`` context (read once), checked to be ``(logical name, mesh axis | tuple of them |
    None)`` pairs; ``rules`` holds them as a tuple of tuples (hashable: the state keeps them)."""

    def __init__(self, fn: str, given: Any) -> None:
        import flax.linen as nn

        self.fn = fn
        if given is None:
            self.rules = self._check(nn.get_logical_axis_rules(), "the active nn.logical_axis_rules context")
            self.where = (
                f"the nn.logical_axis_rules context {list(self.rules)}"
                if self.rules
                else "none (logical_axis_rules was not given, and no nn.logical_axis_rules context is active)"
            )
        else:
            self.rules = self._check(given, "logical_axis_rules")
            self.where = f"logical_axis_rules={list(self.rules)}"

    def _check(self, rules: Any, what: str) -> tuple[tuple[str, Any], ...]:
        def target_ok(t: Any) -> bool:
            if t is None or isinstance(t, str) or t is P.UNCONSTRAINED:
                return True
            return isinstance(t, (tuple, list)) and all(isinstance(a, str) for a in t)

        pairs = rules if isinstance(rules, (tuple, list)) else None
        bad = pairs is None or not all(
            isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) and target_ok(r[1]) for r in pairs
        )
        if bad:
            raise SpmdError(
                describe(
                    self.fn,
                    f"{what} is {rules!r}, not a sequence of (logical name, mesh axis) pairs.",
                    fix='give pairs such as [("batch", "data"), ("embed", None), ("mlp", "model")]: each logical '
                    "name with a mesh axis, a tuple of mesh axes, or None (not split).",
                )
            )
        return tuple((r[0], tuple(r[1]) if isinstance(r[1], list) else r[1]) for r in pairs or ())

    def map(self, leaf: str, logical: LogicalNames, mesh: Mesh, axes: tuple[str, ...]) -> tuple[P, str]:
        """``(spec over the model axes, a note on where it came from)`` for ``logical``'s names: Flax's
        ``logical_to_mesh_axes``, a name with no rule raising; data axes then dropped (the strategy splits
        parameters over them)."""
        names, where = logical.names, self.where
        rules = self.rules
        if logical.rules is not None:
            own = self._check(logical.rules, f"the {logical.source}'s own rules")
            if logical.strict:  # Linen: a box's own rules replace the others, as in Flax
                rules, where = own, f"the box's own rules {list(own)}"
            else:  # NNX: the variable's sharding_rules first, then the others
                rules, where = own + rules, f"the variable's sharding_rules {list(own)}, then {where}"
        strs = [n for n in names if isinstance(n, str)]
        if len(set(strs)) != len(strs):
            raise AxisError(
                describe(
                    self.fn,
                    f"the logical names {names} repeat a name.",
                    leaf=f"params{leaf}",
                    fix="give each dimension its own logical name.",
                )
            )
        ruled = {r[0] for r in rules}
        for i, n in enumerate(names):
            if isinstance(n, str) and n not in ruled and (logical.strict or n not in mesh.axis_names):
                also = f" ({n!r} is also a mesh axis; a logical name needs a rule even so)" * (n in mesh.axis_names)
                raise AxisError(
                    describe(
                        self.fn,
                        f"logical name {n!r} (dimension {i} of {names}, from {logical.source}) has no rule{also}; "
                        f"the rules in force: {where}.",
                        leaf=f"params{leaf}",
                        fix=f"add a rule for it to logical_axis_rules (or the nn.logical_axis_rules context): "
                        f"({n!r}, None) keeps the dimension whole, ({n!r}, 'model') splits it over a mesh axis; "
                        f"the mesh's axes are {tuple(mesh.axis_names)}.",
                    )
                )
        spec: list[Any] = []
        for i, (n, r) in enumerate(zip(names, _assign(names, rules, ruled), strict=True)):
            if n not in ruled:  # None, or NNX mesh axes without a rule: checked as given (a data axis raises)
                spec.append(r)
                continue
            if r is P.UNCONSTRAINED:
                raise AxisError(
                    describe(
                        self.fn,
                        f"dimension {i} of the logical names {names} maps to {r!r}; a parameter needs a mesh axis, "
                        "a tuple of them, or None.",
                        leaf=f"params{leaf}",
                        fix=f"map {n!r} to a mesh axis or None for parameters.",
                    )
                )
            for a in _axes_of(r):
                if a not in mesh.axis_names:
                    raise AxisError(
                        describe(
                            self.fn,
                            f"logical name {n!r} (dimension {i} of {names}) maps to {a!r} by {where}, but {a!r} is "
                            f"not an axis of the mesh {dict(mesh.shape)}.",
                            leaf=f"params{leaf}",
                            fix=f"add {a!r} to the mesh (size 1 keeps it whole), or map {n!r} to one of "
                            f"{tuple(mesh.axis_names)} or None.",
                        )
                    )
            kept = tuple(a for a in _axes_of(r) if a not in axes)  # data axes: the strategy's to split over
            spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        mapped = P(*spec)
        if not any(n in ruled for n in strs):  # NNX mesh-axis names only: nothing was mapped
            return mapped, ""
        return mapped, f" (the logical names {names} mapped to {mapped} by {where})"


def _assign(names: tuple[Any, ...], rules: tuple[tuple[str, Any], ...], ruled: set[str]) -> list[Any]:
    """Each dimension's mesh axes, as Flax's ``logical_to_mesh_axes`` assigns them: rule by rule in order, a rule
    gives its mesh axes to the dimension of its name if that dimension has none yet and no other dimension uses
    any of them; a dimension no rule could take stays whole (``None``). Names without a rule (NNX mesh axes) and
    ``None`` stand for themselves."""
    unset = object()
    result: list[Any] = [unset if n in ruled else n for n in names]
    for name, target in rules:
        if name in names:
            i = names.index(name)
            used = {a for r in result if r is not unset for a in _axes_of(r)}
            if result[i] is unset and not set(_axes_of(target)) & used:
                result[i] = target
    return [None if r is unset else r for r in result]


def _axes_of(entry: Any) -> tuple[str, ...]:
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return tuple(a for a in entry if isinstance(a, str))
    return ()


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
