"""Which named scope each instruction of a compiled program runs in, read from the optimised HLO: what
:attr:`Work.by_scope <spmdcomm.explain.Work.by_scope>` counts the FLOPs under.

An instruction's own scope is the ``jax.named_scope`` / Flax module path of its ``op_name`` metadata, without the
primitive, JAX's own structure and the transforms (``jit(f)/transpose(jvp(M))/Dense_0/dot_general`` -> ``M/Dense_0``:
a backward-pass op counts under its forward scope). XLA leaves some instructions without metadata (measured: the
``dot`` s it rewrites, such as one with a dimension of size 1 or the matmuls of a loop body), and an instruction's
metadata is only as good as the pass that wrote it, so the instructions that run it decide too:

- a loop or a branch (``while``, ``conditional``: a ``lax.scan``, ``lax.cond``) runs code that JAX traced inside the
  loop's own scope: an instruction of its body without a scope, or with one outside the loop's, takes the loop's;
- a fusion's or a call's metadata is that of one instruction in it (a fusion's root), so an instruction inside keeps
  its own scope and takes the fusion's only when it has none.

A matmul left with no scope at all counts under ``""``; :func:`beside` names the scopes of the instructions next to
it, whose count may be missing it.

>>> from spmdcomm.explain.scopes import op_scope
>>> op_scope('metadata={op_name="jit(f)/transpose(jvp(Net))/Dense_0/dot_general"}')
'Net/Dense_0'
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from spmdcomm.explain.hlo import _CALLED, _OP_NAME, Module, _Instruction

__all__ = ["op_scope", "scopes", "beside"]

_STRUCTURAL = re.compile(
    r"(while|body|cond|closed_call|shard_map|checkpoint|rematted_computation|remat|pjit|core_call|scan|"
    r"custom_jvp_call|custom_vjp_call|custom_vjp_call_jaxpr|branch_\d+_fun|jit\(.*\))"
)
_TRANSFORM = re.compile(r"[\w\-]+\((.*)\)")
# The instructions whose body JAX traced inside their own scope (lax.scan, fori_loop, while_loop, cond, switch).
_CONTROL = ("while", "conditional")


def op_scope(attrs: str) -> str:
    """The named scopes of an op's own metadata (its ``op_name`` without the primitive, JAX's own structure and
    transforms); ``""`` without one."""
    m = _OP_NAME.search(attrs)
    if m is None:
        return ""
    parts = []
    for part in m.group(1).split("/")[:-1]:
        if _STRUCTURAL.fullmatch(part):
            continue
        while (t := _TRANSFORM.fullmatch(part)) is not None:  # transpose(jvp(Dense_0)) -> Dense_0
            part = t.group(1)
        if part and not _STRUCTURAL.fullmatch(part):
            parts.append(part)
    return "/".join(parts)


def scopes(module: Module) -> dict[str, str]:
    """Every instruction's scope, by name: its own, or that of the instructions running it (the module's rules)."""
    callers = _callers(module)
    resolved: dict[str, str] = {}
    # computation -> (the scope its instructions without one take, the scope every one of them must lie within)
    context: dict[str, tuple[str, str]] = {}

    def enclosing(computation: str) -> tuple[str, str]:
        if computation not in context:
            context[computation] = ("", "")  # a cycle (none in valid HLO) has no context, rather than no end
            runs = callers.get(computation, [])
            fills = [resolve(c) for c in runs]
            bounds = [fill if c.opcode in _CONTROL else enclosing(c.computation)[1] for c, fill in zip(runs, fills)]
            context[computation] = (_common(fills), _common(bounds))
        return context[computation]

    def resolve(inst: _Instruction) -> str:
        if inst.name not in resolved:
            fill, bound = enclosing(inst.computation)
            own = op_scope(inst.attrs)
            resolved[inst.name] = own if own and _within(own, bound) else fill
        return resolved[inst.name]

    for inst in module.instructions:
        resolve(inst)
    return resolved


def beside(module: Module, lost: Iterable[_Instruction], resolved: dict[str, str]) -> tuple[str, ...]:
    """The scopes (``resolved``: :func:`scopes`) of the instructions that feed or use each instruction of ``lost``,
    or that feed or use the instructions running it (its fusion); sorted, without ``""``."""
    lost = list(lost)
    if not lost:
        return ()
    by_name = {i.name: i for i in module.instructions}
    users: dict[str, list[_Instruction]] = {}
    for inst in module.instructions:
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)
    callers = _callers(module)
    found: set[str] = set()
    for inst in lost:
        for near in [inst, *callers.get(inst.computation, [])]:
            around = [by_name[o] for o in near.operands if o in by_name] + users.get(near.name, [])
            found.update(resolved.get(a.name, "") for a in around)
    return tuple(sorted(found - {""}))


def _callers(module: Module) -> dict[str, list[_Instruction]]:
    """Each computation's calling instructions (loops, branches, fusions, calls, reducers)."""
    callers: dict[str, list[_Instruction]] = {}
    for inst in module.instructions:
        for _, value in _CALLED.findall(inst.attrs):
            for callee in re.findall(r"%?([\w.\-]+)", value):
                callers.setdefault(callee, []).append(inst)
    return callers


def _within(scope: str, outer: str) -> bool:
    return not outer or scope == outer or scope.startswith(outer + "/")


def _common(scopes: list[str]) -> str:
    """The longest scope that every one of ``scopes`` lies within (``""`` for none)."""
    if not scopes:
        return ""
    parts = scopes[0].split("/")
    for scope in scopes[1:]:
        other = scope.split("/")
        n = 0
        while n < min(len(parts), len(other)) and parts[n] == other[n]:
            n += 1
        parts = parts[:n]
    return "/".join(parts)
