"""The 1F1B schedule (``sc.Pipeline(..., schedule="1f1b")``; PipeDream-flush, torch's ``Schedule1F1B``): a
micro-batch's backward pass through the stages starts at the tick its forward pass leaves the last stage, so a
stage keeps the activations of a bounded number of micro-batches, whatever ``m``, and recomputes none of them.

The step's loop hands this schedule the pieces of a micro-batch
(:class:`~spmdcomm.parallel.pipeline.schedule.MicroPieces`): the user's loss on a part of the device's rows. The
stack splits it: run in the *pre* piece, the stack hands over its input and its parameters (what follows it is
unused); run in the *post* piece, it returns the output the pipeline computed. The layers outside the stack
(embedding, head, loss) run on the rows' own device, as in GPipe.

One loop of ``m + 2p - 2`` ticks over a data replica's ``m`` micro-batches (device ``s`` of the replica owns
micro-batches ``[s m/p, (s+1) m/p)``, a part each of its rows). At tick ``t``, on every stage ``s`` at once:

- *forward*: micro-batch ``t - s`` through this stage's layers (``jax.vjp``; its residuals, but the parameters,
  go to slot ``(t - s) mod (2p - 1)`` of a ring buffer); stage 0 takes micro-batch ``t`` from its owner's pre piece;
- *loss*: the micro-batch leaving the last stage (``t - p + 1``) goes to its owner, whose post piece gives the loss
  and the cotangent of the stack's output, which goes back to the last stage;
- *backward*: micro-batch ``t - 2p + 2 + s`` back through this stage's layers from its residuals; stage 0 hands
  the cotangent of its input to the owner, whose pre piece, run again, takes it back through the embedding.

The first ``p - 1`` ticks hold no backward item and the last ``p - 1`` no forward item, and run only their own
half: the loop's work is ``m + p - 1`` ticks of one forward and one backward item, GPipe's, and so is its bubble,
``(p - 1) / (m + p - 1)``. Stage ``s`` holds a micro-batch's residuals from its forward tick to its backward
tick, ``2(p - 1 - s) + 1`` ticks, so the ring has ``2p - 1`` slots, every layer's activations of one micro-batch
each (no rematerialisation; torch's asynchronous 1F1B holds ``p - s``: here a forward and a backward item share
each tick in lockstep). A tick with no forward (or backward, or loss) item computes on real rows (a stand-in) and
drops its result with a zero cotangent, as the GPipe loop's bubbles do. Moves between a stage and an owner are
all-reduces over the stage axis of one micro-batch's activations (one device sends, the others add zeros), four
per tick, beside the two ``ppermute`` s of the stages; every device runs the pre and post pieces each tick, where
only the owner's count, and the pre piece again for the embedding's backward pass.
"""

from __future__ import annotations

import contextvars
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.pipeline.schedule import LayerFn, MicroPieces, scan_layers

if TYPE_CHECKING:
    from spmdcomm.parallel.pipeline.pipeline import Pipeline

__all__ = ["loop", "stack_piece"]

#: The piece being traced: None (no 1F1B loop: the stack runs as GPipe), a dict (pre: the stack puts what it was
#: given there), or the stack's output (post).
_PIECE: contextvars.ContextVar[Any] = contextvars.ContextVar("spmdcomm_1f1b_piece", default=None)


def stack_piece(layer_fn: LayerFn, params: Any, state: Any, x: jax.Array) -> tuple[jax.Array, Any] | None:
    """What a 1F1B pipeline's stack does in the piece being traced: ``None`` outside the 1F1B loop (the eval step:
    the stack runs as GPipe); in a pre piece it hands over what it was given and returns its input (what follows
    the stack is then unused, and compiled away); in a post piece it returns the output the pipeline computed."""
    piece = _PIECE.get()
    if piece is None:
        return None
    if jax.tree.leaves(state):
        raise SpmdError(
            describe(
                "PipelineStack",
                "a stack with mutable state (BatchNorm's statistics) under schedule='1f1b'.",
                fix="use sc.Pipeline(..., schedule='gpipe') for a stack with state.",
            )
        )
    if isinstance(piece, dict):
        piece.update(layer_fn=layer_fn, params=params, x=x)
        return x, state
    return piece, state


def loop(pipeline: Pipeline, pieces: MicroPieces, model_state: Any, micro: Any, axes: tuple[str, ...]) -> Any:
    """The step's loop under 1F1B (module docstring): each group of ``micro`` (the step's ``accum_steps``) as one
    1F1B pipeline. Returns ``(grad_sum, metric_sums, model_state, count)``, as
    :meth:`~spmdcomm.parallel.pipeline.schedule.Schedule.loop`."""
    if jax.tree.leaves(model_state):
        raise SpmdError(
            describe(
                "make_train_step",
                "a model with mutable state (BatchNorm's statistics) under schedule='1f1b'.",
                fix="use sc.Pipeline(..., schedule='gpipe').",
            )
        )
    axis = pipeline.axis
    # Each piece differentiates this device's own use of the parameters; the parameters every stage holds whole
    # have their gradients summed over the stage axis once, after the loop.
    whole = [axis not in varying_axes(a) for a in jax.tree.leaves(pieces.params)]
    params = vary(pieces.params, (axis,))
    every = tuple(sorted(set(axes) | {axis}))

    groups = micro[1].shape[0]

    def group(j: Any, batch: Any, mask: jax.Array) -> tuple[Any, ...]:
        return _group(pipeline, pieces, params, every, (j, groups), batch, mask)

    grads, metrics, count = group(0, *jax.tree.map(lambda a: a[0], micro))
    if groups > 1:

        def body(carry: Any, xs: Any) -> Any:
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            (b, m), j = xs
            return tuple(add(c, n) for c, n in zip(carry, group(j, b, m), strict=True)), None

        rest = jax.tree.map(lambda a: a[1:], micro)
        (grads, metrics, count), _ = lax.scan(body, (grads, metrics, count), (rest, jnp.arange(1, groups)))
    treedef = jax.tree.structure(grads)
    leaves = [lax.psum(g, axis) if w else g for g, w in zip(jax.tree.leaves(grads), whole, strict=True)]
    return pieces.grads(jax.tree.unflatten(treedef, leaves)), metrics, model_state, count


def _group(
    pipeline: Pipeline, pieces: MicroPieces, params: Any, every: tuple[str, ...], group: Any, batch: Any, mask: Any
) -> tuple[Any, ...]:
    """One 1F1B pipeline over this device's rows ``batch`` of group ``group = (j, groups)``: ``(grads, metric
    sums, count)``."""
    axis, m = pipeline.axis, pipeline.microbatches
    p, s = lax.axis_size(axis), lax.axis_index(axis)
    j, groups = group
    q = m // p
    rows = mask.shape[0]
    mb = rows // q
    ring = 2 * p - 1
    parts = jax.tree.map(lambda a: a.reshape((q, mb) + a.shape[1:]), (batch, mask))

    def pre(p_: Any, part: Any) -> tuple[Any, Any, LayerFn]:
        b, mk = jax.tree.map(lambda a: a[part], parts)
        captured: dict[str, Any] = {}
        token = _PIECE.set(captured)
        try:
            pieces.loss(p_, b, mk, j, part)
        finally:
            _PIECE.reset(token)
        if captured:
            return captured["x"], captured["params"], captured["layer_fn"]
        raise SpmdError(
            describe(
                "make_train_step",
                "schedule='1f1b' but the loss never ran a PipelineStack (or run_stack).",
                fix="build the pipelined layers with sc.PipelineStack, or use schedule='gpipe'.",
            )
        )

    def post(p_: Any, h: jax.Array, part: Any) -> tuple[jax.Array, Any]:
        b, mk = jax.tree.map(lambda a: a[part], parts)
        token = _PIECE.set(h)
        try:
            count, (value, (loss, aux)) = pieces.loss(p_, b, mk, j, part)
        finally:
            _PIECE.reset(token)
        aux = {k: v for k, v in aux.items() if k != "model_state"}
        return value, (count, pieces.metrics(count, loss, aux))

    x0, weights0, fn0 = pre(params, 0)
    local = jax.tree.leaves(weights0)[0].shape[0]  # this stage's layers

    def chunk(layer_fn: LayerFn, weights: Any, h: jax.Array, row: Any) -> jax.Array:
        return scan_layers(layer_fn, weights, {}, h, offset=s * local, row=row, remat=False)[0]

    def forward(weights: Any, layer_fn: LayerFn, h: jax.Array, item: Any, part: Any) -> Any:
        # The first row of micro-batch `item` relative to that of this device's part `part`, whose key the
        # layers draw from: device d's rows of group j begin at (d groups + j) rows.
        row = (item // q - s) * (groups * rows) + (item % q - part) * mb
        return jax.vjp(lambda w, h: chunk(layer_fn, w, h, row), weights, h)

    # The residuals' structure: a forward pass traced once (its results are unused, and compiled away).
    _, vjp0 = forward(weights0, fn0, x0, s * q, 0)
    kept = _kept(vjp0, weights0)
    slots = [jnp.zeros((ring,) + r.shape, r.dtype) for r, k in zip(jax.tree.leaves(vjp0), kept, strict=True) if k]
    metric_shapes = jax.eval_shape(lambda: post(params, x0, 0)[1][1])
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    left = [(i + 1, i) for i in range(p - 1)]
    right = [(i, i + 1) for i in range(p - 1)]
    from_stage = lambda src, v: lax.psum(jnp.where(s == src, v, jnp.zeros_like(v)), axis)

    def tick(carry: Any, t: jax.Array, *, forward_items: bool, backward_items: bool) -> tuple[Any, None]:
        carry_f, carry_b, slots, stack_grads, grads, metrics, count = carry
        # Forward: stage 0 takes micro-batch t from its owner; the others what their left neighbour passed on.
        # (Traced in every phase for the residuals' structure; unused in the last, and compiled away.)
        x_own, weights, layer_fn = pre(params, t % q)
        item = t - s
        real = (item >= 0) & (item < m)
        x_in = from_stage(jnp.minimum(t, m - 1) // q, x_own)
        h = jnp.where(real, jnp.where(s == 0, x_in, carry_f), x_own)
        out, vjp_fn = forward(weights, layer_fn, h, jnp.clip(item, 0, m - 1), t % q)
        residuals, structure = jax.tree.flatten(vjp_fn)
        kept = _kept(vjp_fn, weights)
        if forward_items:
            stored = [r for r, k in zip(residuals, kept, strict=True) if k]
            slot = jnp.clip(item, 0, m - 1) % ring
            slots = [a.at[slot].set(jnp.where(real, r, a[slot])) for a, r in zip(slots, stored, strict=True)]
            carry_f = lax.ppermute(out, axis, right)
        if not backward_items:
            return (carry_f, carry_b, slots, stack_grads, grads, metrics, count), None
        ct_last = jnp.zeros_like(out)
        if forward_items:
            # The loss of the micro-batch leaving the last stage, on its owner; the cotangent goes back.
            done = t - (p - 1)
            owner = (done >= 0) & (done < m) & (s == jnp.clip(done, 0, m - 1) // q)
            h_out = vary(from_stage(p - 1, out), (axis,))  # varying: the cotangent stays this device's
            part = jnp.clip(done, 0, m - 1) % q
            value, post_vjp, (c, sums) = jax.vjp(lambda p_, h: post(p_, h, part), params, h_out, has_aux=True)
            g_post, ct_out = post_vjp(vary(jnp.where(owner, 1.0, 0.0).astype(value.dtype), every))
            ct_last = lax.psum(jnp.where(owner, ct_out, jnp.zeros_like(ct_out)), axis)
            metrics = jax.tree.map(lambda a, n: a + jnp.where(owner, n, jnp.zeros_like(n)), metrics, sums)
            count = count + jnp.where(owner, c, 0.0)
            grads = jax.tree.map(jnp.add, grads, g_post)
        # Backward: micro-batch t - 2p + 2 + s from its residuals. Where there is none, a real micro-batch's
        # (the slot of micro-batch 0 was written before any backward tick, that of m - 1 before the last phase).
        back = t - 2 * (p - 1) + s
        real_b = (back >= 0) & (back < m)
        it = iter(a[jnp.clip(back, 0, m - 1) % ring] for a in slots)
        ct = jnp.where(real_b, jnp.where(s == p - 1, ct_last, carry_b), jnp.zeros_like(out))
        vjp_back = jax.tree.unflatten(structure, [next(it) if k else r for r, k in zip(residuals, kept, strict=True)])
        g_stack, ct_in = vjp_back(ct)
        stack_grads = jax.tree.map(jnp.add, stack_grads, g_stack)
        # Stage 0's input cotangent goes to its owner, back through the layers before the stack.
        first = t - 2 * (p - 1)
        mine = (first >= 0) & (first < m) & (s == jnp.clip(first, 0, m - 1) // q)
        ct_x = from_stage(0, ct_in)
        _, pre_vjp = jax.vjp(lambda p_: pre(p_, jnp.clip(first, 0, m - 1) % q)[0], params)
        (g_pre,) = pre_vjp(jnp.where(mine, ct_x, jnp.zeros_like(ct_x)))
        grads = jax.tree.map(jnp.add, grads, g_pre)
        carry_b = lax.ppermute(ct_in, axis, left)
        return (carry_f, carry_b, slots, stack_grads, grads, metrics, count), None

    # Three phases: the first p - 1 ticks hold only forward items, the last p - 1 only backward items.
    carry = vary(
        (x0, x0, slots, zeros(weights0), zeros(params), zeros(metric_shapes), jnp.zeros((), jnp.float32)), every
    )
    for start, stop, forward_items, backward_items in [
        (0, p - 1, True, False),
        (p - 1, m + p - 1, True, True),
        (m + p - 1, m + 2 * p - 2, False, True),
    ]:
        phase = functools.partial(tick, forward_items=forward_items, backward_items=backward_items)
        carry, _ = lax.scan(phase, carry, jnp.arange(start, stop))
    _, _, _, stack_grads, grads, metrics, count = carry
    # The stack's gradient, summed over the ticks, goes back to the parameters once (through the pre piece).
    _, to_params = jax.vjp(lambda p_: pre(p_, 0)[1], params)
    (g_stack,) = to_params(stack_grads)
    return jax.tree.map(jnp.add, grads, g_stack), metrics, count


def _kept(vjp_fn: Any, weights: Any) -> list[bool]:
    """Which residuals of a forward piece's ``vjp_fn`` go to the ring: all but the stage's parameters, which
    every tick holds anyway."""
    held = jax.tree.leaves(weights)
    return [not any(r is w for w in held) for r in jax.tree.leaves(vjp_fn)]
