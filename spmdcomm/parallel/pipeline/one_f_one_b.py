"""The schedules that run each micro-batch's backward pass while others go forward: 1F1B (``schedule="1f1b"``;
PipeDream-flush, torch's ``Schedule1F1B``), interleaved 1F1B (``"1f1b"`` with ``repeats=v``, torch's
``ScheduleInterleaved1F1B``) and ZB-H1 (``"zb-h1"``, Qi et al. 2023, torch's ``ScheduleInterleavedZeroBubble``). A
stage keeps a bounded number of micro-batches' activations, whatever ``m``, and recomputes none of them.

What each stage runs when is a table (:mod:`spmdcomm.parallel.pipeline.tables`), computed in NumPy before tracing;
this module's loop runs any table. The step's loop hands it the pieces of a micro-batch
(:class:`~spmdcomm.parallel.pipeline.schedule.MicroPieces`): the user's loss on a part of the device's rows. The
stack splits it: run in the *pre* piece, the stack hands over its input and its parameters (what follows it is
unused); run in the *post* piece, it returns the output the pipeline computed. The layers outside the stack
(embedding, head, loss) run on the rows' own device, as in GPipe. Device ``s`` of a data replica owns micro-batches
``[s m/p, (s+1) m/p)``, a part each of its rows.

One loop over the table's units. At each unit every stage runs its action on one chunk of its layers (a
``lax.switch``: a stage without one computes nothing):

- ``F``: the chunk's forward pass, one ``jax.vjp`` per layer; the residuals (every layer's activations, but the
  parameters) go to the ring slot the table names. Stage 0's chunk 0 takes its input from the rows' device (its
  pre piece); other inputs come from the inbox of activations the left neighbour sent;
- ``B``: the chunk's backward pass from its residuals and the cotangent in the inbox the right neighbour (or the
  loss) filled: the cotangent of its input, sent left, and its weight gradient;
- ``I`` and ``W`` (ZB-H1): the same split in two, each layer's ``vjp`` run twice on the same residuals: the input
  gradient, keeping the cotangent of each layer's output, and later the weight gradient from those (each layer's
  weight gradient recomputes the cotangents inside that layer, between its weights and its output).

The output of every action moves one stage right and one stage left (two ``ppermute`` s; cyclic with ``v > 1``:
the last stage's chunk ``r`` feeds stage 0's chunk ``r + 1``); the receivers' inbox slots are in the table. Three
events are the same on every device (a ``lax.cond`` on the table): stage 0 takes a micro-batch from its device;
the last stage's chunk ``v - 1`` finished one, whose device's post piece gives the loss and the cotangent; stage 0
finished a backward pass, whose cotangent goes through its device's pre piece. Moves between a stage and the rows'
device are all-reduces over the stage axis of one micro-batch's activations (one device sends, the others add
zeros), and every device runs the pre and post pieces at those units (only the rows' device's count).
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.pipeline import tables
from spmdcomm.parallel.pipeline.schedule import LayerFn, MicroPieces

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
                "a stack with mutable state (BatchNorm's statistics) under a schedule other than 'gpipe'.",
                fix="use sc.Pipeline(..., schedule='gpipe') for a stack with state.",
            )
        )
    if isinstance(piece, dict):
        # The loop differentiates the layers in pieces of its own, out of the user's reach: nothing they sow
        # (a MoE layer's losses) could come back. Tracing one layer finds out.
        first = jax.tree.map(lambda a: a[0], params)
        _, out = jax.eval_shape(lambda p, h: layer_fn(p, {}, h, jnp.int32(0), 0), first, x)
        if out:
            raise SpmdError(
                describe(
                    "PipelineStack",
                    f"the stack's block sows into {sorted(out)} under a schedule other than 'gpipe': that schedule "
                    "cannot hand per-micro-batch values back to the loss.",
                    fix="use sc.Pipeline(..., schedule='gpipe'), which hands them out [L, m, ...].",
                )
            )
        piece.update(layer_fn=layer_fn, params=params, x=x)
        return x, state
    return piece, state


def loop(pipeline: Pipeline, pieces: MicroPieces, model_state: Any, micro: Any, axes: tuple[str, ...]) -> Any:
    """The step's loop under a table's schedule (module docstring): each group of ``micro`` (the step's
    ``accum_steps``) as one pipeline. Returns ``(grad_sum, metric_sums, model_state, count)``, as
    :meth:`~spmdcomm.parallel.pipeline.schedule.Schedule.loop`."""
    if jax.tree.leaves(model_state):
        raise SpmdError(
            describe(
                "make_train_step",
                f"a model with mutable state (BatchNorm's statistics) under schedule={pipeline.schedule!r}.",
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
    """One pipeline of the schedule's table over this device's rows ``batch`` of group ``group = (j, groups)``:
    ``(grads, metric sums, count)``."""
    axis, m, v = pipeline.axis, pipeline.microbatches, pipeline.repeats
    p, s = lax.axis_size(axis), lax.axis_index(axis)
    plan = tables.table(pipeline.schedule, stages=p, microbatches=m, repeats=v)
    j, groups = group
    q = m // p
    rows = mask.shape[0]
    mb = rows // q
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
                f"schedule={pipeline.schedule!r} but the loss never ran a PipelineStack (or run_stack).",
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

    # The stack's layers and layer function, traced once (part 0's: a micro-batch's rows are keyed from there).
    x0, weights0, layer_fn = pre(params, 0)
    local = jax.tree.leaves(weights0)[0].shape[0]  # this stage's layers: v chunks of k
    k = local // v
    chunks = jax.tree.map(lambda a: a.reshape((v, k) + a.shape[1:]), weights0)
    layers = _Layers(layer_fn, chunks, s, p, k, x0)

    def row_of(item: jax.Array) -> jax.Array:
        # The first row of micro-batch `item` relative to this device's part 0, whose key the layers draw from:
        # device d's rows of group j begin at (d groups + j) rows.
        return (item // q - s) * (groups * rows) + (item % q) * mb

    zb = plan.kind == "zb-h1"
    res_shapes = jax.eval_shape(lambda h: layers.forward(0, h, 0)[1], x0)
    buffers = lambda n, shape, dtype: jnp.zeros((n,) + shape, dtype)
    ring = [buffers(plan.slots["res"], a.shape, a.dtype) for a in res_shapes]
    cts = buffers(plan.slots["grad"], (k,) + x0.shape, x0.dtype) if zb else jnp.zeros((0,), x0.dtype)
    inbox_f = buffers(plan.slots["inbox_f"], x0.shape, x0.dtype)
    inbox_b = buffers(plan.slots["inbox_b"], x0.shape, x0.dtype)
    metric_shapes = jax.eval_shape(lambda: post(params, x0, 0)[1][1])
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    cyclic = v > 1  # the last stage's chunk r feeds stage 0's chunk r + 1
    right = [(i, (i + 1) % p) for i in range(p if cyclic else p - 1)]
    left = [((i + 1) % p, i) for i in range(p if cyclic else p - 1)]
    from_stage = lambda src, x: lax.psum(jnp.where(s == src, x, jnp.zeros_like(x)), axis)
    nothing = lambda: jnp.zeros_like(x0)
    # Every branch's results vary over the manual axes, as the loop's carry does (shard_map's typing).
    varied = lambda f: lambda *a: vary(f(*a), every)
    cond = lambda pred, yes, no: lax.cond(pred, varied(yes), varied(no))

    # The switch's branches, by action: each gives (out, residuals to keep, weight gradient of the chunk, layer
    # cotangents to keep); what an action does not give is zeros.
    def idle(r: Any, item: Any, h: Any, ct: Any, res: Any, kept: Any) -> Any:
        blank = jax.ShapeDtypeStruct(cts.shape[1:], cts.dtype) if zb else jax.ShapeDtypeStruct((), cts.dtype)
        return nothing(), vary(zeros(res_shapes), every), vary(zeros(layers.chunk(0)), every), vary(zeros(blank), every)

    def forward(r: Any, item: Any, h: Any, ct: Any, res: Any, kept: Any) -> Any:
        out, new = layers.forward(r, h, row_of(item))
        _, _, g, c = idle(r, item, h, ct, res, kept)
        return out, new, g, c

    def backward(r: Any, item: Any, h: Any, ct: Any, res: Any, kept: Any) -> Any:
        ct_in, g = layers.backward(r, res, ct, row_of(item))
        _, new, _, c = idle(r, item, h, ct, res, kept)
        return ct_in, new, g, c

    def input_grad(r: Any, item: Any, h: Any, ct: Any, res: Any, kept: Any) -> Any:
        ct_in, c = layers.input_grad(r, res, ct, row_of(item))
        _, new, g, _ = idle(r, item, h, ct, res, kept)
        return ct_in, new, g, c

    def weight_grad(r: Any, item: Any, h: Any, ct: Any, res: Any, kept: Any) -> Any:
        g = layers.weight_grad(r, res, kept, row_of(item))
        out, new, _, c = idle(r, item, h, ct, res, kept)
        return out, new, g, c

    branches = [idle, forward, input_grad, weight_grad] if zb else [idle, forward, backward]
    branch_of = np.zeros(5, np.int32)
    branch_of[[tables.F, tables.B, tables.I, tables.W]] = [1, 2, 2, 3]

    def unit(carry: Any, xs: Any) -> tuple[Any, None]:
        inbox_f, inbox_b, ring, cts, stack_grads, grads, metrics, count = carry
        columns, events = xs
        op, r, item, res_slot, inbox, grad_slot, recv_f, recv_b, recv_loss = (c[s] for c in columns)
        # Stage 0's chunk 0 takes the micro-batch from the device that holds its rows (its layers before the stack).
        first = events["input"]
        x_in = cond(
            first >= 0,
            lambda: from_stage(jnp.maximum(first, 0) // q, pre(params, jnp.maximum(first, 0) % q)[0]),
            nothing,
        )
        slot = jnp.maximum(inbox, 0)
        h = jnp.where(inbox < 0, x_in, inbox_f[slot])
        res = [a[jnp.maximum(res_slot, 0)] for a in ring]
        kept = cts[jnp.maximum(grad_slot, 0)] if zb else cts
        action = jnp.asarray(branch_of)[op]
        out, new, g, c = lax.switch(action, [varied(b) for b in branches], r, item, h, inbox_b[slot], res, kept)
        is_f = op == tables.F
        ring = [a.at[res_slot].set(jnp.where(is_f, n, a[res_slot])) for a, n in zip(ring, new, strict=True)]
        if zb:
            cts = cts.at[grad_slot].set(jnp.where(op == tables.I, c, cts[grad_slot]))
        stack_grads = jax.tree.map(lambda a, d: a.at[r].add(d), stack_grads, g)
        # The loss of the micro-batch leaving the last stage, on its device; the cotangent goes back.
        done = events["loss"]

        def loss() -> Any:
            h_out = vary(from_stage(p - 1, out), (axis,))  # varying: the cotangent stays this device's
            owner = s == jnp.maximum(done, 0) // q
            part = jnp.maximum(done, 0) % q
            value, post_vjp, (n, sums) = jax.vjp(lambda p_, h: post(p_, h, part), params, h_out, has_aux=True)
            g_post, ct_out = post_vjp(vary(jnp.where(owner, 1.0, 0.0).astype(value.dtype), every))
            ct_last = from_stage(jnp.maximum(done, 0) // q, ct_out)
            masked = lambda t: jax.tree.map(lambda a: jnp.where(owner, a, jnp.zeros_like(a)), t)
            return ct_last, g_post, masked(sums), jnp.where(owner, n, 0.0)

        no_loss = lambda: (jnp.zeros_like(x0), zeros(params), zeros(metric_shapes), jnp.zeros((), jnp.float32))
        ct_last, g_post, sums, n = cond(done >= 0, loss, no_loss)
        grads = jax.tree.map(jnp.add, grads, g_post)
        metrics = jax.tree.map(jnp.add, metrics, sums)
        # What this unit sent reaches the neighbours' inboxes: activations from the left, cotangents from the right.
        sent_f, sent_b = lax.ppermute(out, axis, right), lax.ppermute(out, axis, left)
        inbox_f = inbox_f.at[recv_f].set(jnp.where(recv_f >= 0, sent_f, inbox_f[recv_f]))
        inbox_b = inbox_b.at[recv_b].set(jnp.where(recv_b >= 0, sent_b, inbox_b[recv_b]))
        inbox_b = inbox_b.at[recv_loss].set(jnp.where(recv_loss >= 0, ct_last, inbox_b[recv_loss]))
        # Stage 0's input cotangent goes to the rows' device, back through its layers before the stack.
        back = events["back"]

        def embed_grad() -> Any:
            owner = s == jnp.maximum(back, 0) // q
            ct_x = from_stage(0, out)
            _, pre_vjp = jax.vjp(lambda p_: pre(p_, jnp.maximum(back, 0) % q)[0], params)
            return pre_vjp(jnp.where(owner, ct_x, jnp.zeros_like(ct_x)))[0]

        grads = jax.tree.map(jnp.add, grads, cond(back >= 0, embed_grad, lambda: zeros(params)))
        return (inbox_f, inbox_b, ring, cts, stack_grads, grads, metrics, count + n), None

    carry = vary(
        (inbox_f, inbox_b, ring, cts, zeros(chunks), zeros(params), zeros(metric_shapes), jnp.zeros((), jnp.float32)),
        every,
    )
    columns = tuple(jnp.asarray(plan.columns[name]) for name in tables.COLUMNS)
    events = {name: jnp.asarray(e) for name, e in plan.events.items()}
    carry, _ = lax.scan(unit, carry, (columns, events))
    *_, stack_grads, grads, metrics, count = carry
    # The stack's gradient, summed over the units, goes back to the parameters once (through the pre piece).
    _, to_params = jax.vjp(lambda p_: pre(p_, 0)[1], params)
    (g_stack,) = to_params(jax.tree.map(lambda a: a.reshape((local,) + a.shape[2:]), stack_grads))
    return jax.tree.map(jnp.add, grads, g_stack), metrics, count


class _Layers:
    """A stage's chunks of layers and the actions on one of them: the forward pass keeping each layer's residuals
    (``jax.vjp`` per layer), the backward pass from them, and its two halves (input and weight gradient)."""

    def __init__(self, layer_fn: LayerFn, chunks: Any, stage: jax.Array, stages: int, k: int, x: jax.Array) -> None:
        self.layer_fn, self.chunks, self.stage, self.stages, self.k, self.x = layer_fn, chunks, stage, stages, k, x

    def chunk(self, r: Any) -> Any:
        """Chunk ``r``'s parameters (its ``k`` layers on dimension 0)."""
        return jax.tree.map(lambda a: a[r], self.chunks)

    def forward(self, r: Any, h: jax.Array, row: Any) -> tuple[jax.Array, list[jax.Array]]:
        """Chunk ``r`` on ``h``: its output and the residuals of its layers (stacked ``[k, ...]``), but the
        parameters, which the stage holds anyway."""

        def one(h: jax.Array, xs: Any) -> Any:
            w, index = xs
            out, vjp_fn = jax.vjp(lambda w, h: self.layer_fn(w, {}, h, index, row)[0], w, h)
            return out, [a for a, keep in zip(*_residuals(vjp_fn, w), strict=True) if keep]

        return lax.scan(one, h, (self.chunk(r), self._indices(r)))

    def backward(self, r: Any, res: list[jax.Array], ct: jax.Array, row: Any) -> tuple[jax.Array, Any]:
        """The cotangent of chunk ``r``'s input and its weight gradient, from its residuals."""

        def one(ct: jax.Array, xs: Any) -> Any:
            w, res, index = xs
            g_w, g_h = self._vjp(w, res, index, row)(ct)
            return g_h, g_w

        return lax.scan(one, ct, (self.chunk(r), res, self._indices(r)), reverse=True)

    def input_grad(self, r: Any, res: list[jax.Array], ct: jax.Array, row: Any) -> tuple[jax.Array, jax.Array]:
        """The cotangent of chunk ``r``'s input, and that of each layer's output (for :meth:`weight_grad`)."""

        def one(ct: jax.Array, xs: Any) -> Any:
            w, res, index = xs
            return self._vjp(w, res, index, row)(ct)[1], ct

        return lax.scan(one, ct, (self.chunk(r), res, self._indices(r)), reverse=True)

    def weight_grad(self, r: Any, res: list[jax.Array], cts: jax.Array, row: Any) -> Any:
        """Chunk ``r``'s weight gradient, from its residuals and the cotangents of its layers' outputs."""

        def one(_: Any, xs: Any) -> Any:
            w, res, index, ct = xs
            return None, self._vjp(w, res, index, row)(ct)[0]

        return lax.scan(one, None, (self.chunk(r), res, self._indices(r), cts))[1]

    def _indices(self, r: Any) -> jax.Array:
        # Stage s holds chunks s, s + p, ...: chunk r is virtual stage r p + s, layers from (r p + s) k.
        return (r * self.stages + self.stage) * self.k + jnp.arange(self.k)

    def _vjp(self, w: Any, res: list[jax.Array], index: jax.Array, row: Any) -> Any:
        """One layer's ``vjp_fn`` with the stored residuals: traced on a stand-in for its structure (the stand-in's
        forward pass is unused, and compiled away)."""
        _, vjp_fn = jax.vjp(lambda w, h: self.layer_fn(w, {}, h, index, row)[0], w, jnp.zeros_like(self.x))
        (leaves, kept), structure = _residuals(vjp_fn, w), jax.tree.structure(vjp_fn)
        stored = iter(res)
        leaves = [next(stored) if keep else a for a, keep in zip(leaves, kept, strict=True)]
        return jax.tree.unflatten(structure, leaves)


def _residuals(vjp_fn: Any, weights: Any) -> tuple[list[Any], list[bool]]:
    """The residuals of a layer's ``vjp_fn`` and which of them to keep: all but the layer's parameters, which the
    stage holds anyway."""
    held = jax.tree.leaves(weights)
    leaves = jax.tree.leaves(vjp_fn)
    return leaves, [not any(a is w for w in held) for a in leaves]
