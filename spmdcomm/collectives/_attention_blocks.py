"""The blockwise math of the context-parallel attention kernels (:mod:`spmdcomm.collectives.attention`): the mask of
a pair of blocks, float32 softmax attention of whole sequences, and the ring's derivative.

The ring's derivative is a custom JVP whose tangent is a linear function with a transpose of its own
(``linear_call``): forward mode (``jax.jvp``, ``jax.linearize``) runs :func:`_ring_tangent`, one more ring that
carries the tangents of the key/value blocks with them; reverse mode transposes it into :func:`_ring_transpose`,
which runs the ring again, recomputing each block's probabilities from the saved log-sum-exp. Either way one
``t x t`` block of scores per head is live at a time, and the forward pass saves only ``q``, ``k``, ``v``, the output
and the log-sum-exp (a ``jax.custom_vjp`` would do the same for ``jax.grad`` but refuses ``jax.jvp``).

Shapes: ``q`` ``[b, t, h, d]``, ``k`` and ``v`` ``[b, s, h_kv, d]``; inside, queries are grouped ``[b, t, h_kv, g,
d]`` (``g = h / h_kv``) and scores are ``[b, h_kv, g, t, s]`` in float32, -inf where the mask hides a key, so that
``exp`` gives exactly 0 there and a row that sees no key sums to 0 (its output is then 0, never NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._jax_compat import linear_call, varying_axes
from spmdcomm.errors import ShapeError, SpmdError, describe

__all__ = ["Side", "attend", "mask", "ring", "ring_forward", "sides"]

#: Per-token side information of one side of the attention: positions ``[B, t]`` (``B`` 1 or the batch; None only for
#: keys that no causal mask reads), segment ids ``[B, t]`` or None, and (keys only) validity ``[B, t]`` or None.
Side = tuple[jax.Array | None, jax.Array | None, jax.Array | None]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def ring(axis: str, causal: bool, q: jax.Array, k: jax.Array, v: jax.Array, qside: Side, kside: Side) -> jax.Array:
    """Ring attention's output (:func:`ring_forward`); its derivative (:func:`_ring_jvp`) runs the ring again."""
    return ring_forward(axis, causal, q, k, v, qside, kside)[0]


def ring_forward(
    axis: str, causal: bool, q: jax.Array, k: jax.Array, v: jax.Array, qside: Side, kside: Side
) -> tuple[jax.Array, jax.Array]:
    """The output ``[b, t, h, d]`` and the log-sum-exp ``[b, h_kv, g, t]`` (-inf where no key is visible)."""
    b, t, h, d = q.shape
    qg = _grouped(q, k.shape[2])
    vary = functools.partial(_vary, axes=_axes(axis, q, k, v, qside, kside))
    shape = qg.shape[:1] + qg.shape[2:4] + (t,)  # [b, h_kv, g, t]

    def step(state: Any, block: Any) -> Any:
        top, total, acc = state
        kb, vb, ks = block
        s = _scores(qg, kb, mask(qside, ks, causal))
        # The running maximum only keeps exp() in range; the result does not depend on it (no gradient).
        new = lax.stop_gradient(jnp.maximum(top, jnp.max(s, axis=-1)))
        safe = jnp.where(jnp.isfinite(new), new, 0.0)  # a row that has seen no key yet: all its terms are 0
        p = jnp.exp(s - safe[..., None])
        fade = jnp.exp(top - safe)
        acc = acc * fade[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p, vb.astype(jnp.float32))
        return (new, total * fade + jnp.sum(p, axis=-1), acc), block

    start = vary((jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (d,))))
    (top, total, acc), _ = _around(step, start, vary((k, v, kside)), axis)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, top + jnp.log(total), -jnp.inf)
    out = (acc / total[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out.astype(q.dtype), lse


def sides(
    fn: str, q: Any, k: Any, v: Any, positions: Callable[[int], jax.Array], segment_ids: Any, kv_mask: Any
) -> tuple[Side, Side]:
    """The query and key sides (``q`` and ``k`` hold the same tokens): ``positions(t)`` ``[t]``, and segments and
    validity ``[1 or b, t]``, after checking every shape against ``q``."""
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (q, k, v)):
        raise SpmdError(describe(fn, "q, k and v must be arrays.", fix="pass jax or NumPy arrays."))
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]:
        raise ShapeError(
            describe(
                fn,
                f"{shapes} do not fit: q is [batch, tokens, heads, head_dim], k and v [batch, tokens, kv_heads, "
                "head_dim], all three with the same batch, tokens (the same tokens of the sequence) and head_dim.",
                fix="reshape the projections to [batch, tokens, heads, head_dim].",
            )
        )
    if q.shape[2] % k.shape[2]:
        raise ShapeError(
            describe(
                fn,
                f"{shapes}: {k.shape[2]} KV heads do not divide {q.shape[2]} query heads (grouped-query attention: "
                "query head j reads KV head j // (heads / kv_heads)).",
                fix=f"use a number of KV heads that divides {q.shape[2]}.",
            )
        )

    b, t = q.shape[:2]
    contract = {
        "segment_ids": (f"int [{t}] (shared by the rows) or [{b}, {t}] (one per row)", "iu"),
        "kv_mask": (f"bool or int [{t}] (shared by the rows) or [{b}, {t}] (one per row)", "biu"),
    }
    fixes = {
        "segment_ids": "pass segment_ids for the same tokens as q, k and v: each token's segment, an int.",
        "kv_mask": "pass kv_mask for this device's keys, the tokens of k and v: True or nonzero for a key that is "
        "attended to, False or 0 for padding (a tokenizer's 0/1 attention_mask works as it is).",
    }

    def rows(name: str, x: Any) -> Any:
        if x is None:
            return None
        x = jnp.asarray(x)
        kind, kinds = contract[name]
        if not (x.ndim == 1 or (x.ndim == 2 and x.shape[0] == b)) or x.shape[-1] != t or x.dtype.kind not in kinds:
            raise ShapeError(
                describe(fn, f"{name} is {x.dtype} {tuple(x.shape)}; with {shapes} it must be {kind}.", fix=fixes[name])
            )
        return x[None] if x.ndim == 1 else x

    segments, valid = rows("segment_ids", segment_ids), rows("kv_mask", kv_mask)
    if valid is not None and valid.dtype != bool:
        valid = valid != 0  # an integer mask: nonzero attends (values cannot be checked inside jit)
    pos = positions(q.shape[1])[None]
    return (pos, segments, None), (pos, segments, valid)


def mask(qside: Side, kside: Side, causal: bool) -> jax.Array:
    """``[1 or b, t_q, t_k]`` (``t_k`` 1 where the key side has no positions, segments or validity), True where the
    key is visible to the query."""
    (qp, qs, _), (kp, ks, valid) = qside, kside
    assert qp is not None and (kp is not None or not causal), "the queries' positions, and the keys' when causal"
    # Without key positions (the ring's derivative carries none when not causal) the key axis broadcasts.
    visible = jnp.ones((1, qp.shape[1], 1 if kp is None else kp.shape[1]), bool)
    if causal and kp is not None:
        visible = visible & (kp[:, None, :] <= qp[:, :, None])
    if qs is not None and ks is not None:
        visible = visible & (ks[:, None, :] == qs[:, :, None])
    if valid is not None:
        visible = visible & valid.astype(bool)[:, None, :]
    return visible


def attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax attention of whole sequences in float32; zeros for a query that sees no key."""
    s = _scores(_grouped(q, k.shape[2]), k, visible)
    top = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)


# --------------------------------------------------------------------------------------------------


def _ring_jvp(axis: str, causal: bool, primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    """The output, and its tangent: :func:`_ring_tangent` in forward mode, transposed into :func:`_ring_transpose`
    in reverse mode. Only the tangents that are not symbolic zeros are the linear function's inputs (a derivative in
    ``q`` alone transposes to ``dq`` alone); those of the positions, segments and padding (integers) are ignored."""
    q, k, v, qside, kside = primals
    out, lse = ring_forward(axis, causal, q, k, v, qside, kside)
    moving = tuple(not isinstance(t, jax.custom_derivatives.SymbolicZero) for t in tangents[:3])
    if not any(moving):
        return out, jnp.zeros_like(out)
    res = (q, k, v, qside, kside, out, lse)
    tangent = functools.partial(_ring_tangent, axis, causal, moving)
    transpose = functools.partial(_ring_transpose, axis, causal, moving)
    return out, linear_call(tangent, transpose, res, tuple(t for t, m in zip(tangents, moving) if m))


ring.defjvp(_ring_jvp, symbolic_zeros=True)


def _ring_tangent(axis: str, causal: bool, moving: tuple[bool, ...], res: Any, tangents: Any) -> jax.Array:
    """The output's tangent, linear in the tangents of ``moving`` (of ``q``, ``k``, ``v``): with ``p`` each block's
    probabilities and ``ds`` the tangent of its scores, ``dO = sum_blocks (p * ds) v + p dv - (sum_blocks
    rowsum(p * ds)) O``; the ring once more, ``dk`` and ``dv`` travelling with their blocks. Only what is needed
    travels (the callee of ``linear_call`` is not pruned of dead code)."""
    q, k, v, qside, kside, out, lse = res
    given = iter(tangents)
    dq, dk, dv = (next(given) if m else None for m in moving)
    b, t, h, d = q.shape
    qg, og = (_grouped(x, k.shape[2]).astype(jnp.float32) for x in (q, out))
    dqg = None if dq is None else _grouped(dq, k.shape[2]).astype(jnp.float32)
    vary = functools.partial(_vary, axes=_axes(axis, q, k, v, qside, kside, dq, dk, dv))
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]  # rows with no visible key: every p below is 0
    f32 = lambda x: x.astype(jnp.float32)

    def step(state: Any, block: Any) -> Any:
        acc, rows = state
        kb, vb, ks, dkb, dvb = block
        p = jnp.exp(_scores(qg, kb, mask(qside, ks, causal)) - lse)
        terms = [
            jnp.einsum("bqkgd,bskd->bkgqs", x, f32(y))
            for x, y in ((dqg, kb), (qg, dkb))
            if x is not None and y is not None
        ]
        if terms:
            pds = p * sum(terms[1:], terms[0]) / np.sqrt(d)
            acc = acc + jnp.einsum("bkgqs,bskd->bqkgd", pds, f32(vb))
            rows = rows + jnp.einsum("bkgqs->bqkg", pds)
        if dvb is not None:
            acc = acc + jnp.einsum("bkgqs,bskd->bqkgd", p, f32(dvb))
        return (acc, rows), block

    start = vary((jnp.zeros(qg.shape), jnp.zeros(qg.shape[:-1])))
    (acc, rows), _ = _around(step, start, vary((k, v, _keys(kside, causal), dk, dv)), axis)
    return (acc - rows[..., None] * og).reshape(b, t, h, d).astype(q.dtype)


def _ring_transpose(axis: str, causal: bool, moving: tuple[bool, ...], res: Any, dout: jax.Array) -> tuple:
    """The cotangents of ``q``, ``k``, ``v`` that ``moving`` marks: the ring once more, each block's probabilities
    recomputed from the saved log-sum-exp, ``dk``/``dv`` travelling with their blocks (one block in memory at a
    time). Only what is needed travels and is computed."""
    q, k, v, qside, kside, out, lse = res
    qg = _grouped(q, k.shape[2]).astype(jnp.float32)
    do = _grouped(dout, k.shape[2]).astype(jnp.float32)
    vary = functools.partial(_vary, axes=_axes(axis, q, k, v, qside, kside, dout))
    # delta_q = sum_s p_qs dp_qs = dO_q . O_q: the softmax's Jacobian term, one number per query and head.
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", do, _grouped(out, k.shape[2]).astype(jnp.float32))
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]  # rows with no visible key: every p below is 0
    scale = 1.0 / np.sqrt(q.shape[-1])
    want_q, want_k, want_v = moving

    def step(dq: Any, block: Any) -> Any:
        kb, vb, ks, dk, dv = block
        p = jnp.exp(_scores(qg, kb, mask(qside, ks, causal)) - lse)
        if want_v:
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p, do)
        if want_q or want_k:
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do, vb.astype(jnp.float32))
            ds = p * (dp - delta[..., None]) * scale
            if want_q:
                dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb.astype(jnp.float32))
            if want_k:
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qg)
        return dq, (kb, vb, ks, dk, dv)

    zeros = lambda x, want: jnp.zeros(x.shape, jnp.float32) if want else None
    blocks = (k, v, _keys(kside, causal), zeros(k, want_k), zeros(v, want_v))
    dq, block = _around(step, vary(zeros(qg, want_q)), vary(blocks), axis)
    dk, dv = _shift(block[3:], axis)  # block j's gradients are on device j - 1: one hop home
    grads = (None if dq is None else dq.reshape(q.shape), dk, dv)
    return tuple(_cotangent(g, x) for g, x, m in zip(grads, (q, k, v), moving) if m)


def _keys(kside: Side, causal: bool) -> Side:
    """The key side as the ring's derivative carries it: without the positions when no causal mask reads them."""
    positions, segments, valid = kside
    return (positions if causal else None, segments, valid)


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, t, h, d]`` as ``[b, t, h_kv, g, d]``: query head ``j`` is group member ``j % g`` of KV head ``j // g``."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d)


def _scores(qg: jax.Array, k: jax.Array, visible: jax.Array) -> jax.Array:
    """Float32 scores ``[b, h_kv, g, t_q, t_k]``, -inf where ``visible`` (``[1 or b, t_q, t_k]``) is False."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) / np.sqrt(qg.shape[-1])
    return jnp.where(visible[:, None, None], s, -jnp.inf)


def _around(step: Any, carry: Any, block: Any, axis: str) -> tuple[Any, Any]:
    """``carry, block = step(carry, block)`` for the ``c`` blocks of the ring in turn: this device's own, then each
    one hop on (``c - 1`` hops); the final ``carry`` and ``block``.

    One loop of ``c`` steps whose first takes no hop (a conditional on the step's index), rather than a first step
    before a loop of ``c - 1`` hops: XLA unrolls a loop of one iteration (``c = 2``) and then computes both steps'
    score blocks at once, keeping twice the blocks of any other ``c``. In a loop, one step's blocks are live at a
    time."""
    hop = lambda i, x: lax.cond(i > 0, lambda y: _shift(y, axis), lambda y: y, x)
    body = lambda state, i: (step(state[0], hop(i, state[1])), None)
    (carry, block), _ = lax.scan(body, (carry, block), jnp.arange(lax.axis_size(axis)))
    return carry, block


def _shift(tree: Any, axis: str) -> Any:
    """Every array of ``tree`` moved one device on along ``axis`` (device ``i`` to ``i + 1``, the last to 0)."""
    c = lax.axis_size(axis)
    return jax.tree.map(lambda x: lax.ppermute(x, axis, [(i, (i + 1) % c) for i in range(c)]), tree)


def _axes(axis: str, *trees: Any) -> tuple[str, ...]:
    """The manual axes any array of ``trees`` varies over, and ``axis``: what every carry of a ring loop varies over
    (scan carries must keep their type, and the blocks vary over ``axis`` once they move)."""
    found = {axis}.union(*(varying_axes(x) for x in jax.tree.leaves(trees)))
    return tuple(sorted(found))


def _vary(tree: Any, axes: tuple[str, ...]) -> Any:
    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _cotangent(grad: jax.Array, x: jax.Array) -> jax.Array:
    """``grad`` in ``x``'s dtype, summed over the axes it varies over and ``x`` does not (the transpose of the cast
    that made ``x`` varying there), as a custom VJP must return it."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(x)))
    return (lax.psum(grad, extra) if extra else grad).astype(x.dtype)
