"""Flax logical axis rules for a train state: the logical names a parameter's box or NNX metadata gives its
dimensions (:class:`LogicalNames`), their mapping to mesh axes (:class:`LogicalRules`, as Flax's
``logical_to_mesh_axes``), and the rules in force while a step traces the model (:func:`step_axis_rules`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmdcomm.errors import AxisError, MissingLogicalRuleWarning, SpmdError, describe

__all__ = ["LogicalNames", "LogicalRules", "step_axis_rules"]


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


def step_axis_rules(rules: Any, axes: tuple[str, ...]) -> Any:
    """A context manager that makes ``rules`` (``None``: the active ``nn.logical_axis_rules`` context) with the
    manual ``axes`` dropped the active Flax rules while the step traces the model: inside the step the data axes (and
    each parallelism's axis) are manual, and each device's block of the batch is already its split, so a
    ``nn.with_logical_constraint`` keeps only its model axes (JAX refuses a sharding constraint naming a manual
    axis)."""
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
    None)`` pairs; ``rules`` holds them as a tuple of tuples (hashable: the state keeps them). ``missing``: what a
    logical name with no rule does, ``"warn"`` (its dimension stays whole, as in Flax; :meth:`warn_missing` warns
    once for every such name) or ``"error"`` (raises :class:`~spmdcomm.errors.AxisError`)."""

    def __init__(self, fn: str, given: Any, *, missing: str = "error") -> None:
        import flax.linen as nn

        if missing not in ("warn", "error"):
            raise SpmdError(
                describe(
                    fn,
                    f"missing_logical_rules={missing!r} is not 'warn' or 'error'.",
                    fix="pass 'warn' (a name with no rule leaves its dimension whole, as in Flax) or 'error'.",
                )
            )
        self.fn, self.missing = fn, missing
        self.unruled: list[tuple[str, str]] = []  # (parameter, logical name) left whole for want of a rule
        self.whole: tuple[str, ...] = ()
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

    def add(self, pairs: tuple[tuple[str, str], ...], whole: tuple[str, ...] = ()) -> None:
        """Puts ``pairs`` after the rules in force (a parallelism's logical name and its axis: a rule given for the
        same name comes first, and wins); a name of ``whole`` (a registered parallelism's that the state does not
        run) keeps its dimension whole without a rule or a warning."""
        self.rules += pairs
        self.whole = tuple(whole)

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
        ruled, unruled = {r[0] for r in rules}, {n for n in self.whole if n not in {r[0] for r in rules}}
        for i, n in enumerate(names):
            if isinstance(n, str) and n not in ruled | unruled and (logical.strict or n not in mesh.axis_names):
                if self.missing == "warn":
                    unruled.add(n)
                    self.unruled.append((f"params{leaf}", n))
                    continue
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
        # A name without a rule is a dimension no rule splits, as in Flax's logical_to_mesh_axes.
        names = tuple(None if n in unruled else n for n in names)
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

    def warn_missing(self, mesh: Mesh) -> None:
        """One :class:`~spmdcomm.errors.MissingLogicalRuleWarning` naming every parameter whose logical name had no
        rule (its dimension was left whole), the name and the rule to add; nothing when every name had one."""
        if not self.unruled:
            return
        names = sorted({n for _, n in self.unruled})
        listed = "; ".join(f"{p}: {n!r}" for p, n in self.unruled)
        warnings.warn(
            describe(
                self.fn,
                f"logical name(s) {names} have no rule in {self.where}, so these dimensions stay whole (not split), "
                f"as Flax leaves them: {listed}.",
                fix=f"add a rule for each, e.g. {[(n, None) for n in names]} to keep them whole without this warning, "
                f"or ({names[0]!r}, 'model') to split over a mesh axis (the mesh's axes are "
                f"{tuple(mesh.axis_names)}); TrainState.create(..., missing_logical_rules='error') raises instead.",
            ),
            MissingLogicalRuleWarning,
            stacklevel=4,
        )


# ---------------------------------------------------------------------------------------------------------


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
