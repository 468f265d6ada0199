"""A layer's backward pass cut in two, for ZB-H1's ``I`` and ``W`` actions: the input gradient, which keeps the values
the weight gradient needs, and the weight gradient from those, which computes only what the input gradient did not.

The backward pass ``(w, res, ct, *more) -> (g_w, g_h)`` is traced once to a jaxpr (calls of jitted functions
inlined). Its equations fall in two sets: those the input gradient ``g_h`` depends on, and the rest of those the
weight gradient ``g_w`` depends on. The values of the first set that the second reads (for a dense layer: the
cotangent of its output, ``g_w = x^T ct`` with ``x`` a residual) are kept between the two, so the halves together
run each equation of the whole backward pass once: the weight gradient's matmuls in ``W``, the rest in ``I``.

The halves run inside a loop whose branches differ by stage: a kept value that does not vary over the stage axis
depends on none of the layer's inputs (all of which do) and is recomputed in the second half instead of kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore

from spmdcomm._jax_compat import varying_axes

__all__ = ["BackwardSplit", "split_backward"]

#: The call primitives whose bodies are inlined, so that each of their equations falls in the half that needs it.
_INLINED = ("pjit", "jit", "closed_call")


@dataclasses.dataclass(frozen=True)
class _Literal:
    value: Any


@dataclasses.dataclass(frozen=True)
class _Eqn:
    eqn: Any  # the jaxpr equation (its primitive, parameters and context)
    ins: list[Any]  # value keys (int) or _Literal
    outs: list[int]


@dataclasses.dataclass(frozen=True)
class BackwardSplit:
    """A backward pass cut in two (module docstring); :func:`split_backward` builds it.

    Attributes:
      kept: one ``jax.ShapeDtypeStruct``-like aval per value the first half keeps for the second (with its varying
        manual axes).
    """

    eqns: list[_Eqn]
    consts: dict[int, Any]
    inputs: list[int]  # keys of the flattened (w, res, ct, *more)
    ct: list[int]  # the keys of ct: given to the first half only
    first: list[int]  # equations of the input gradient
    second: list[int]  # equations of the weight gradient
    kept_keys: list[int]
    kept: list[Any]
    g_w: list[Any]  # keys or _Literal
    g_h: list[Any]
    w_tree: Any
    h_tree: Any

    def input_grad(self, *args: Any) -> tuple[Any, list[jax.Array]]:
        """``(g_h, kept)`` from the backward pass's arguments ``(w, res, ct, *more)``."""
        env = self._run(self.first, dict(zip(self.inputs, jax.tree.leaves(args), strict=True)))
        return jax.tree.unflatten(self.h_tree, [_read(env, k) for k in self.g_h]), [env[k] for k in self.kept_keys]

    def weight_grad(self, kept: list[jax.Array], w: Any, res: Any, *more: Any) -> Any:
        """``g_w`` from what :meth:`input_grad` kept and the backward pass's arguments but ``ct``."""
        given = [k for k in self.inputs if k not in self.ct]
        env = dict(zip(given, jax.tree.leaves((w, res, more)), strict=True))
        env = self._run(self.second, env | dict(zip(self.kept_keys, kept, strict=True)))
        return jax.tree.unflatten(self.w_tree, [_read(env, k) for k in self.g_w])

    def _run(self, which: list[int], env: dict[int, Any]) -> dict[int, Any]:
        env = {**self.consts, **env}
        for i in which:
            e = self.eqns[i]
            params = e.eqn.primitive.get_bind_params(e.eqn.params)  # as jax.core.eval_jaxpr binds
            with e.eqn.ctx.manager:
                out = e.eqn.primitive.bind(*(_read(env, k) for k in e.ins), **params)
            env.update(zip(e.outs, out if e.eqn.primitive.multiple_results else [out], strict=True))
        return env


def split_backward(backward: Callable[..., tuple[Any, Any]], *args: Any, axis: str) -> BackwardSplit:
    """Traces ``backward(w, res, ct, *more) -> (g_w, g_h)`` on ``args`` (values or tracers of the types it will be
    called with) and cuts it in two (module docstring); ``axis`` is the stage axis."""
    closed = jax.make_jaxpr(backward)(*args)
    out_shapes = jax.eval_shape(backward, *args)
    w_tree, h_tree = jax.tree.structure(out_shapes[0]), jax.tree.structure(out_shapes[1])
    flat = _Flattener()
    inputs = [flat.new(v.aval) for v in closed.jaxpr.invars]
    consts = [flat.const(c, v.aval) for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)]
    outs = flat.inline(closed.jaxpr, inputs, consts)
    n_w = len(jax.tree.leaves(out_shapes[0]))
    g_w, g_h = outs[:n_w], outs[n_w:]
    w_count, res_count = len(jax.tree.leaves(args[0])), len(jax.tree.leaves(args[1]))
    ct = inputs[w_count + res_count : w_count + res_count + len(jax.tree.leaves(args[2]))]
    first = flat.needed(g_h)
    second = [i for i in flat.needed(g_w) if i not in set(first)]
    while True:
        made = {k for i in first for k in flat.eqns[i].outs} | set(ct)
        # What the weight gradient reads, and the parts of it the first half computes whole (a weight's gradient
        # that the input gradient needs too, or a cotangent passed straight through).
        read = {k for i in second for k in flat.eqns[i].ins if isinstance(k, int)}
        read |= {k for k in g_w if isinstance(k, int)}
        kept_keys = sorted(made & read)
        # A value that does not vary over the stage axis is a constant of the trace: recomputed, not kept.
        constant = [k for k in kept_keys if axis not in varying_axes(flat.avals[k])]
        if not constant:
            break
        second = sorted(set(second) | set(flat.needed(constant)))
    return BackwardSplit(
        eqns=flat.eqns,
        consts=flat.consts,
        inputs=inputs,
        ct=ct,
        first=first,
        second=second,
        kept_keys=kept_keys,
        kept=[flat.avals[k] for k in kept_keys],
        g_w=g_w,
        g_h=g_h,
        w_tree=w_tree,
        h_tree=h_tree,
    )


class _Flattener:
    """The equations of a jaxpr with its calls inlined, each value named by an int key."""

    def __init__(self) -> None:
        self.eqns: list[_Eqn] = []
        self.avals: dict[int, Any] = {}
        self.consts: dict[int, Any] = {}

    def new(self, aval: Any) -> int:
        key = len(self.avals)
        self.avals[key] = aval
        return key

    def const(self, value: Any, aval: Any) -> int:
        key = self.new(aval)
        self.consts[key] = value
        return key

    def inline(self, jaxpr: Any, inputs: list[Any], consts: list[Any]) -> list[Any]:
        names: dict[Any, Any] = dict(zip(jaxpr.invars, inputs, strict=True))
        names.update(zip(jaxpr.constvars, consts, strict=True))
        read = lambda a: _Literal(a.val) if isinstance(a, jcore.Literal) else names[a]
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            inner = eqn.params.get("jaxpr")
            if eqn.primitive.name in _INLINED and isinstance(inner, jcore.ClosedJaxpr):
                outs = self.inline(
                    inner.jaxpr,
                    ins,
                    [self.const(c, v.aval) for c, v in zip(inner.consts, inner.jaxpr.constvars, strict=True)],
                )
            else:
                outs = [self.new(v.aval) for v in eqn.outvars]
                self.eqns.append(_Eqn(eqn, ins, outs))
            for v, key in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jcore.DropVar):
                    names[v] = key
        return [read(a) for a in jaxpr.outvars]

    def needed(self, targets: list[Any]) -> list[int]:
        """The equations the values ``targets`` depend on, in order."""
        wanted = {k for k in targets if isinstance(k, int)}
        found = []
        for i in reversed(range(len(self.eqns))):
            e = self.eqns[i]
            if wanted & set(e.outs):
                found.append(i)
                wanted |= {k for k in e.ins if isinstance(k, int)}
        return found[::-1]


def _read(env: dict[int, Any], key: Any) -> Any:
    return key.value if isinstance(key, _Literal) else env[key]
