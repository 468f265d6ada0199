"""A stage's chunks of layers and the actions of the table schedules on one of them
(:mod:`spmdcomm.parallel.pipeline.one_f_one_b`): the forward pass keeping each layer's residuals (one ``jax.vjp`` per
layer), the backward pass from them, and its two halves for ZB-H1 (:mod:`spmdcomm.parallel.pipeline.split`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.parallel.pipeline import split, tables
from spmdcomm.parallel.pipeline.schedule import LayerFn

__all__ = ["Layers", "typed_zeros"]


class Layers:
    """A stage's chunks of layers and the actions on one of them: the forward pass keeping each layer's residuals
    (``jax.vjp`` per layer), the backward pass from them, and its two halves (input and weight gradient)."""

    def __init__(
        self,
        layer_fn: LayerFn,
        chunks: Any,
        stage: jax.Array,
        stages: int,
        k: int,
        x: jax.Array,
        state: Any,
        axis: str,
        *,
        sown: tuple[str, ...] = (),
        axes: tuple[str, ...] = (),
    ) -> None:
        self.chunks, self.stage, self.stages, self.k, self.x = chunks, stage, stages, k, x
        self.axis = axis
        self.state = state  # one layer's state, a stand-in for tracing the backward passes' structure

        def differentiated(w: Any, st: Any, h: jax.Array, index: jax.Array, row: Any) -> Any:
            # What the layer sows (a MoE layer's losses, the collections in `sown`) is an output the loss reads,
            # so it is differentiated with the layer's output: ((h, sown), state).
            out, new = layer_fn(w, st, h, index, row)
            if not sown:
                return (out, {}), new
            kept = type(new)({c: v for c, v in new.items() if c not in sown})
            # Integer values (an expert's token counts) as floats: differentiable outputs (their cotangents unused).
            real = lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(jnp.float32)
            return (out, vary(jax.tree.map(real, {c: new[c] for c in sown}), axes)), kept

        self.layer_fn = differentiated

    def chunk(self, r: Any) -> Any:
        """Chunk ``r``'s parameters (its ``k`` layers on dimension 0)."""
        return jax.tree.map(lambda a: a[r], self.chunks)

    def forward(self, r: Any, h: jax.Array, row: Any, state: Any) -> tuple[jax.Array, list[jax.Array], Any, Any]:
        """Chunk ``r`` on ``h`` from its layers' ``state``: its output, the residuals of its layers (stacked
        ``[k, ...]``), but the parameters, which the stage holds anyway, the layers' new state and what they sowed
        (stacked ``[k, ...]``)."""

        def one(h: jax.Array, xs: Any) -> Any:
            w, st, index = xs
            # The state is an input of the differentiated function (its cotangent unused): a layer that updates
            # it in place (NNX's BatchStat) must be built in the trace that updates it.
            (out, sown), vjp_fn, st = jax.vjp(
                lambda w, h, st: self.layer_fn(w, st, h, index, row), w, h, st, has_aux=True
            )
            return out, ([a for a, keep in zip(*_residuals(vjp_fn, w, self.axis), strict=True) if keep], st, sown)

        out, (res, state, sown) = lax.scan(one, h, (self.chunk(r), state, self._indices(r)))
        return out, res, state, sown

    def backward(self, r: Any, res: list[jax.Array], ct: jax.Array, ct_sown: Any, row: Any) -> tuple[jax.Array, Any]:
        """The cotangent of chunk ``r``'s input and its weight gradient, from its residuals, the cotangent of its
        output and those of what its layers sowed (``[k, ...]``)."""

        def one(ct: jax.Array, xs: Any) -> Any:
            w, res, index, ct_sown = xs
            g_w, g_h, _ = self._vjp(w, res, index, row, ct)((ct, ct_sown))
            return g_h, g_w

        return lax.scan(one, ct, (self.chunk(r), res, self._indices(r), ct_sown), reverse=True)

    def split_backward(self, res_shapes: list[Any], h: jax.Array, sown: Any) -> None:
        """Cuts a layer's backward pass into the input and the weight gradient (:mod:`~.split`), traced on stand-ins
        of the types the loop calls it with (``res_shapes``: a chunk's residuals; ``h``: a layer's input; ``sown``:
        what a layer sows)."""
        w = jax.tree.map(lambda a: a[0], self.chunk(0))
        res = [typed_zeros(a)[0] for a in res_shapes]
        index = vary(jnp.zeros((), jnp.int32), (self.axis,))  # as the loop's, they vary over the stage axis
        backward = lambda w, res, ct, index, row: self._vjp(w, res, index, row, ct[0])(ct)[:2]
        ct = (h, jax.tree.map(typed_zeros, sown))
        self.cut = split.split_backward(backward, w, res, ct, index, index, axis=self.axis)

    def input_grad(
        self, r: Any, res: list[jax.Array], ct: jax.Array, ct_sown: Any, row: Any
    ) -> tuple[jax.Array, list[jax.Array]]:
        """The cotangent of chunk ``r``'s input, and what each layer's weight gradient needs of its backward pass
        (:meth:`weight_grad`), stacked ``[k, ...]``."""

        def one(ct: jax.Array, xs: Any) -> Any:
            w, res, index, ct_sown = xs
            return self.cut.input_grad(w, res, (ct, ct_sown), index, row)

        return lax.scan(one, ct, (self.chunk(r), res, self._indices(r), ct_sown), reverse=True)

    def weight_grad(self, r: Any, res: list[jax.Array], kept: list[jax.Array], row: Any) -> Any:
        """Chunk ``r``'s weight gradient, from its residuals and what :meth:`input_grad` kept: its matmuls only."""

        def one(_: Any, xs: Any) -> Any:
            w, res, index, kept = xs
            return None, self.cut.weight_grad(kept, w, res, index, row)

        return lax.scan(one, None, (self.chunk(r), res, self._indices(r), kept))[1]

    def _indices(self, r: Any) -> jax.Array:
        # Stage s holds chunks s, s + p, ...: chunk r is virtual stage r p + s, layers from (r p + s) k.
        return (r * self.stages + self.stage) * self.k + jnp.arange(self.k)

    def _vjp(self, w: Any, res: list[jax.Array], index: jax.Array, row: Any, ct: jax.Array) -> Any:
        """One layer's ``vjp_fn`` with the stored residuals: traced on a stand-in for its structure, typed as the
        forward pass's input was (as varying as the cotangent ``ct``; the stand-in's forward pass is unused, and
        compiled away)."""
        stand_in = vary(jnp.zeros_like(self.x), tuple(varying_axes(ct)))
        _, vjp_fn = jax.vjp(lambda w, h, st: self.layer_fn(w, st, h, index, row)[0], w, stand_in, self.state)
        (leaves, kept), structure = _residuals(vjp_fn, w, self.axis), jax.tree.structure(vjp_fn)
        stored = iter(res)
        leaves = [next(stored) if keep else a for a, keep in zip(leaves, kept, strict=True)]
        return jax.tree.unflatten(structure, leaves)

    def branches(self, row_of: Any, blank: Any, zb: bool) -> tuple[list[Any], np.ndarray]:
        """The table loop's ``lax.switch`` branches, by action: each ``(r, item, h, ct, cs, res, kept, st) -> (out,
        residuals to keep, the chunk's weight gradient, layer cotangents to keep, the chunk's state, what it sowed)``
        on chunk ``r`` for micro-batch ``item`` (its first row ``row_of(item)``), what an action does not give taken
        from ``blank(st)``; and the branch index of each table op (``IDLE, F, B, I, W``)."""

        def idle(r: Any, item: Any, h: Any, ct: Any, cs: Any, res: Any, kept: Any, st: Any) -> Any:
            return blank(st)

        def forward(r: Any, item: Any, h: Any, ct: Any, cs: Any, res: Any, kept: Any, st: Any) -> Any:
            out, new, st, sown = self.forward(r, h, row_of(item), st)
            _, _, g, c, _, _ = blank(st)
            return out, new, g, c, st, sown

        def backward(r: Any, item: Any, h: Any, ct: Any, cs: Any, res: Any, kept: Any, st: Any) -> Any:
            ct_in, g = self.backward(r, res, ct, cs, row_of(item))
            _, new, _, c, _, sown = blank(st)
            return ct_in, new, g, c, st, sown

        def input_grad(r: Any, item: Any, h: Any, ct: Any, cs: Any, res: Any, kept: Any, st: Any) -> Any:
            ct_in, c = self.input_grad(r, res, ct, cs, row_of(item))
            _, new, g, _, _, sown = blank(st)
            return ct_in, new, g, c, st, sown

        def weight_grad(r: Any, item: Any, h: Any, ct: Any, cs: Any, res: Any, kept: Any, st: Any) -> Any:
            g = self.weight_grad(r, res, kept, row_of(item))
            out, new, _, c, _, sown = blank(st)
            return out, new, g, c, st, sown

        branch_of = np.zeros(5, np.int32)
        branch_of[[tables.F, tables.B, tables.I, tables.W]] = [1, 2, 2, 3]
        return ([idle, forward, input_grad, weight_grad] if zb else [idle, forward, backward]), branch_of


def typed_zeros(like: Any, *lead: int) -> jax.Array:
    """Zeros of ``like``'s shape (after the dimensions ``lead``), dtype and varying axes."""
    return vary(jnp.zeros((*lead, *like.shape), like.dtype), tuple(sorted(varying_axes(like))))


def _residuals(vjp_fn: Any, weights: Any, axis: str) -> tuple[list[Any], list[bool]]:
    """The residuals of a layer's ``vjp_fn`` and which of them to keep: all but the layer's parameters, which the
    stage holds anyway, and the constants of the trace (what does not vary over the stage axis depends on none of
    the layer's inputs, all of which do: the stand-in's trace computes the same)."""
    held = jax.tree.leaves(weights)
    leaves = jax.tree.leaves(vjp_fn)
    return leaves, [axis in varying_axes(a) and not any(a is w for w in held) for a in leaves]
