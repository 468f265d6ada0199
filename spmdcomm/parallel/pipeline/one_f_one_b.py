"""The schedules that run each micro-batch's backward pass while others go forward: 1F1B (``schedule="1f1b"``;
PipeDream-flush, torch's ``Schedule1F1B``), interleaved 1F1B (``"1f1b"`` with ``repeats=v``, torch's
``ScheduleInterleaved1F1B``) and ZB-H1 (``"zb-h1"``, Qi et al. 2023, torch's ``ScheduleInterleavedZeroBubble``). A
stage keeps a bounded number of micro-batches' activations, whatever ``m``, and recomputes none of them.

What each stage runs when is a table (:mod:`spmdcomm.parallel.pipeline.tables`), computed in NumPy before tracing;
this module's loop runs any table. The step's loop hands it the pieces of a micro-batch
(:class:`~spmdcomm.parallel.pipeline.schedule.MicroPieces`): the user's loss on a part of the device's rows. The
stack splits it (:mod:`~spmdcomm.parallel.pipeline.pieces`): run in the *pre* piece, the stack hands over its input
and its parameters (what follows it is unused); run in the *post* piece, it returns the output the pipeline computed
and what the layers sowed for the micro-batch (gathered from the stages when its loss runs; their cotangents go
back to each stage's layers with the output's). The layers outside the stack (embedding, head, loss) run on the
rows' own device, once per micro-batch, moving their state on in micro-batch order (``pieces.OutsideState``).
Device ``s`` of a data replica owns micro-batches ``[s m/p, (s+1) m/p)``, a part each of its rows.

One loop over the table's units. At each unit every stage runs its action on one chunk of its layers (a
``lax.switch``: a stage without one computes nothing). With the batch split over a context or expert axis the
layers run collectives over it, which every device of a group must run at the same point: the loop then runs a
lockstep table, every stage running each unit's action, on its work item or masked (results dropped):

- ``F``: the chunk's forward pass, one ``jax.vjp`` per layer; the residuals (every layer's activations, but the
  parameters) go to the ring slot the table names, and the layers' state (BatchNorm's running statistics) moves
  on: a stage runs each chunk's forward passes in micro-batch order, so the state updates as GPipe's does (each
  stage keeps its rows of the stack's state, gathered over the stage axis after the loop). Stage 0's chunk 0 takes
  its input from the rows' device (its pre piece); other inputs come from the inbox of activations the left
  neighbour sent;
- ``B``: the chunk's backward pass from its residuals and the cotangent in the inbox the right neighbour (or the
  loss) filled: the cotangent of its input, sent left, and its weight gradient;
- ``I`` and ``W`` (ZB-H1): the same backward pass cut in two (:mod:`~spmdcomm.parallel.pipeline.split`): the input
  gradient, keeping what each layer's weight gradient needs of it (the cotangents at the outputs of the layer's
  matmuls with its weights), and later the weight gradient from those and the residuals: between them they run
  each part of the backward pass once, so ZB-H1 computes what 1F1B does (the actions are in
  :mod:`~spmdcomm.parallel.pipeline.actions`).

The output of every action moves one stage right and one stage left (two ``ppermute`` s; cyclic with ``v > 1``:
the last stage's chunk ``r`` feeds stage 0's chunk ``r + 1``); the receivers' inbox slots are in the table. Three
events are the same on every device (a ``lax.cond`` on the table): stage 0 takes a micro-batch from its device;
the last stage's chunk ``v - 1`` finished one, whose device's post piece gives the loss and the cotangent; stage 0
finished a backward pass, whose cotangent goes through its device's pre piece. Moves between a stage and the rows'
device are all-reduces over the stage axis of one micro-batch's activations (one device sends, the others add
zeros); the pre and post pieces run on the rows' device only (a ``lax.cond``), or, in a lockstep table, on every
device, only the rows' device's counting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.pipeline import gpipe, tables
from spmdcomm.parallel.pipeline.actions import Layers, typed_zeros
from spmdcomm.parallel.pipeline.pieces import OutsideState, Post, traced_piece
from spmdcomm.parallel.pipeline.schedule import PIPELINED, MicroPieces
from spmdcomm.parallel.real_rows import rows_of

if TYPE_CHECKING:
    from spmdcomm.parallel.pipeline.pipeline import Pipeline

__all__ = ["ROWS_DEVICE", "loop"]

#: The ``jax.named_scope`` of each ``lax.cond`` that runs a micro-batch's layers outside the stack on the device that
#: holds its rows (true on one device of the stage axis's ``p``).
ROWS_DEVICE = "rows_device"


def loop(pipeline: Pipeline, pieces: MicroPieces, model_state: Any, micro: Any, axes: tuple[str, ...]) -> Any:
    """The step's loop under a table's schedule (module docstring): each group of ``micro`` (the step's
    ``accum_steps``) as one pipeline. Returns ``(grad_sum, metric_sums, model_state, count)``, as
    :meth:`~spmdcomm.parallel.pipeline.schedule.Schedule.loop`."""
    axis = pipeline.axis
    # Each piece differentiates this device's own use of the parameters; the parameters every stage holds whole
    # have their gradients summed over the stage axis once, after the loop.
    whole = [axis not in varying_axes(a) for a in jax.tree.leaves(pieces.params)]
    params = vary(pieces.params, (axis,))
    # The batch split over axes besides the data and stage axes (context, expert): the layers run collectives over
    # them, which every device of a group must run at the same point; a stage then runs every unit's action, on
    # a work item or masked (a lockstep table), never a branch of its own.
    others = set().union(*(varying_axes(a) for a in jax.tree.leaves(micro))) - set(axes) - {axis}
    every = tuple(sorted(set(axes) | {axis} | others))
    lockstep = bool(others)

    groups = micro[1].shape[0]

    def group(j: Any, model_state: Any, batch: Any, mask: jax.Array) -> tuple[Any, ...]:
        return _group(pipeline, pieces, params, every, lockstep, (j, groups), model_state, batch, mask)

    # The groups run in turn, the model state threaded through them (as the sequential loop's micro-batches).
    grads, metrics, count, model_state = group(0, model_state, *jax.tree.map(lambda a: a[0], micro))
    if groups > 1:

        def body(carry: Any, xs: Any) -> Any:
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            (b, m), j = xs
            *sums, state = carry
            *new, state = group(j, state, b, m)
            return (*(add(c, n) for c, n in zip(sums, new, strict=True)), state), None

        rest = jax.tree.map(lambda a: a[1:], micro)
        carry = (grads, metrics, count, model_state)
        (grads, metrics, count, model_state), _ = lax.scan(body, carry, (rest, jnp.arange(1, groups)))
    treedef = jax.tree.structure(grads)
    leaves = [lax.psum(g, axis) if w else g for g, w in zip(jax.tree.leaves(grads), whole, strict=True)]
    return pieces.grads(jax.tree.unflatten(treedef, leaves)), metrics, model_state, count


def _group(
    pipeline: Pipeline,
    pieces: MicroPieces,
    params: Any,
    every: tuple[str, ...],
    lockstep: bool,
    group: Any,
    model_state: Any,
    batch: Any,
    mask: Any,
) -> tuple[Any, ...]:
    """One pipeline of the schedule's table over this device's rows ``batch`` of group ``group = (j, groups)``,
    from ``model_state``: ``(grads, metric sums, count, model state)``."""

    axis, m, v = pipeline.axis, pipeline.microbatches, pipeline.repeats
    p, s = lax.axis_size(axis), lax.axis_index(axis)
    plan = tables.table(pipeline.schedule, stages=p, microbatches=m, repeats=v, lockstep=lockstep)
    j, groups = group
    q = m // p
    rows = mask.shape[0]
    mb = rows // q
    parts = jax.tree.map(lambda a: a.reshape((q, mb) + a.shape[1:]), (batch, mask))

    def pre(p_: Any, part: Any, state: Any = model_state, tag: Any = None) -> dict[str, Any]:
        """The stack's input, parameters, layer function and state, and the model state the loss returns (``tag``:
        added to the stack's output, to find what depends on it)."""
        b, mk = jax.tree.map(lambda a: a[part], parts)
        captured: dict[str, Any] = {"stages": p} if tag is None else {"stages": p, "tag": tag}
        with traced_piece(captured):
            _, (_, (_, aux)) = pieces.loss(p_, state, b, mk, j, part)
        if "x" in captured:
            return {**captured, "returned": aux.get("model_state", state)}
        raise SpmdError(
            describe(
                "make_train_step",
                f"schedule={pipeline.schedule!r} but the loss never ran a PipelineStack (or run_stack).",
                fix="build the pipelined layers with sc.PipelineStack, or use schedule='gpipe'.",
            )
        )

    def post(p_: Any, h: jax.Array, part: Any, sown: Any, state: Any = model_state) -> tuple[jax.Array, Any]:
        b, mk = jax.tree.map(lambda a: a[part], parts)
        with traced_piece(Post(h, sown, first["like"])):  # the stack's state is what it was given: the loop's is kept
            count, (value, (loss, aux)) = pieces.loss(p_, state, b, mk, j, part)
        new_state = aux.get("model_state", state)
        aux = {k: v for k, v in aux.items() if k != "model_state"}
        return value, (count, pieces.metrics(count, loss, aux), new_state)

    # The stack's layers and layer function, traced once (part 0's: a micro-batch's rows are keyed from there).
    first = pre(params, 0)
    x0, weights0 = first["x"], first["params"]

    def layer_fn(*args: Any) -> Any:
        # The loop runs the layers outside the user's function: in the contexts the step runs that in, on one
        # micro-batch of the stage group's (a MoE layer's tokens: those of the other axes, not the stage axis).
        token = PIPELINED.set(axis)
        try:
            with pieces.context():
                return first["layer_fn"](*args)
        finally:
            PIPELINED.reset(token)

    # The real rows of each micro-batch (a MoE layer routes those only), as GPipe's loop finds them: from this
    # device's mask when the stack's input is the batch's rows (what the pre piece saw), None for an unmasked batch.
    given = first["rows"]
    held = x0.shape[0] * q  # the stack's input rows on this device, q parts
    rows_of_item = gpipe.micro_batch_rows(mask if isinstance(given, jax.Array) else given, held, q, mb, axis)
    micro_rows = lambda item: rows_of_item(jnp.maximum(item, 0))

    local = jax.tree.leaves(weights0)[0].shape[0]  # this stage's layers: v chunks of k
    k = local // v
    chunks = jax.tree.map(lambda a: a.reshape((v, k) + a.shape[1:]), weights0)
    # The stack's state (BatchNorm's statistics: whole on every device, canonical order): this stage's rows as its
    # chunks, each moved on by its forward passes, which run in micro-batch order.
    stack_state = first["state"]
    own = gpipe.stage_rows(stack_state, local, p, v, s)
    layer_state = vary(jax.tree.map(lambda a: a.reshape((v, k) + a.shape[1:]), own), every)
    one_state = jax.tree.map(lambda a: a[0, 0], layer_state)
    layers = Layers(layer_fn, chunks, s, p, k, x0, one_state, axis, sown=tuple(first["sown"]), axes=every)

    def row_of(item: jax.Array) -> jax.Array:
        # The first row of micro-batch `item` relative to this device's part 0, whose key the layers draw from:
        # device d's rows of group j begin at (d groups + j) rows.
        return (item // q - s) * (groups * rows) + (item % q) * mb

    zb = plan.kind == "zb-h1"
    # The residuals keep the types the forward pass gives them (a BatchNorm's statistics, summed over the data
    # axes, do not vary over them): the backward pass, traced on a stand-in, expects exactly those.
    chunk_state = jax.tree.map(lambda a: a[0], layer_state)
    with rows_of(micro_rows(0)):
        forward_shapes = jax.eval_shape(lambda h, st: layers.forward(0, h, 0, st), vary(x0, every), chunk_state)
    _, res_shapes, _, sown_shapes = forward_shapes
    # What the layers sow, per micro-batch and chunk ([m, v, k, ...]), and the loss's cotangents of it.
    sown_buf = jax.tree.map(lambda a: typed_zeros(a, m, v), sown_shapes)
    ct_buf = jax.tree.map(lambda a: typed_zeros(a, m, v), sown_shapes)
    sown_zeros = lambda: jax.tree.map(typed_zeros, sown_shapes)
    ring = [typed_zeros(a, plan.slots["res"]) for a in res_shapes]
    if zb:
        with rows_of(micro_rows(0)):  # the rows' mask only types the trace: the residuals carry its values
            layers.split_backward(res_shapes, vary(x0, every), jax.tree.map(lambda a: typed_zeros(a)[0], sown_shapes))
    # ZB-H1: what each layer's input gradient keeps for its weight gradient, k layers of a chunk per slot.
    kept_types = layers.cut.kept if zb else []
    cts = [typed_zeros(a, plan.slots["grad"], k) for a in kept_types]
    inbox_f, inbox_b = (jnp.zeros((plan.slots[n], *x0.shape), x0.dtype) for n in ("inbox_f", "inbox_b"))
    sown_whole = lambda tree: jax.tree.map(lambda a: jnp.zeros((v * p * k, 1, *a.shape[1:]), a.dtype), tree)
    # The model state outside the stack (a BatchNorm in the embedding or the head): the leaves the layers before the
    # stack update move on at the input events, those after it at the loss events, both in micro-batch order.
    pre_piece = (first["returned"], lambda t: pre(params, 0, tag=t)["returned"])
    post_piece = lambda: post(params, x0, 0, sown_whole(sown_shapes))[1][1:]
    outside, metric_shapes = OutsideState.trace(model_state, pre_piece, post_piece, stack_state, x0, pipeline.schedule)
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    cyclic = v > 1  # the last stage's chunk r feeds stage 0's chunk r + 1
    right = [(i, (i + 1) % p) for i in range(p if cyclic else p - 1)]
    left = [((i + 1) % p, i) for i in range(p if cyclic else p - 1)]
    from_stage = lambda src, x: lax.psum(jnp.where(s == src, x, jnp.zeros_like(x)), axis)
    from_owner = lambda src, values: [from_stage(src, a) for a in values]
    nothing = lambda: jnp.zeros_like(x0)
    # Every branch's results vary over the manual axes, as the loop's carry does (shard_map's typing); the
    # residuals keep their own types, and gradients their parameters' (summed over the axes they do not vary over,
    # a context axis, by the transpose inside each vjp).
    like = lambda tree, ref: jax.tree.map(lambda a, b: vary(a, tuple(sorted(varying_axes(b)))), tree, ref)
    varied = lambda f: lambda *a: vary(f(*a), every)
    cond = lambda pred, yes, no, typing=varied: lax.cond(pred, typing(yes), typing(no))

    def on_owner(pred: Any, f: Any, typing: Any) -> Any:
        # The layers outside the stack (embedding, head, loss) for one micro-batch run on the device that holds its
        # rows only, the others giving zeros. A lockstep table runs them on every device, masked: their collectives
        # over a context or expert axis must not run in a branch that differs by stage.
        if lockstep:
            return typing(f)()
        with jax.named_scope(ROWS_DEVICE):  # explain's work count weighs its branches by this name
            return lax.cond(pred, typing(f), typing(lambda: zeros(jax.eval_shape(f))))

    chunk0 = layers.chunk(0)

    def typed(f: Any) -> Any:
        def branch(r: Any, item: Any, *rest: Any) -> Any:
            with rows_of(micro_rows(item)):  # the real rows of the micro-batch the layers run on
                o = f(r, item, *rest)
            return vary(o[0], every), o[1], like(o[2], chunk0), o[3], vary(o[4], every), vary(o[5], every)

        return branch

    # The switch's branches, by action; what an action does not give is zeros (the state: unchanged).
    blank = lambda st: (
        nothing(),
        [typed_zeros(a) for a in res_shapes],
        zeros(chunk0),
        [typed_zeros(a, k) for a in kept_types],
        st,
        sown_zeros(),
    )
    branches, branch_of = layers.branches(row_of, blank, zb)

    def unit(carry: Any, xs: Any) -> tuple[Any, None]:
        inbox_f, inbox_b, ring, cts, sown_buf, ct_buf, layer_state, stack_grads, grads, metrics, count, *rest = carry
        before, after, used = rest
        columns, events, kind = xs
        op, r, item, res_slot, inbox, grad_slot, recv_f, recv_b, recv_loss = (c[s] for c in columns)
        # In a lockstep table a stage without a work item runs the unit's action masked: its results are dropped.
        real, r, at = op != tables.IDLE, jnp.maximum(r, 0), jnp.maximum(item, 0)
        # (A table's idle branch leaves the state and gives zero gradients: nothing to mask.)
        kept_if_real = (lambda new, old: jnp.where(real, new, old)) if lockstep else (lambda new, old: new)
        # Stage 0's chunk 0 takes the micro-batch from the device that holds its rows (its layers before the stack).
        # It runs from the model state the micro-batches before left (kept, for its backward pass).
        first = events["input"]
        i = jnp.maximum(first, 0)

        def take() -> Any:
            def run() -> Any:
                got = pre(params, i % q, outside.build(before))
                return got["x"], outside.take(got["returned"], outside.before)

            x, moved = on_owner(s == i // q, run, varied)
            return from_stage(i // q, x), from_owner(i // q, moved)

        used = [u.at[i].set(jnp.where(first >= 0, a, u[i])) for u, a in zip(used, before, strict=True)]
        x_in, before = cond(first >= 0, take, lambda: (nothing(), before))
        slot = jnp.maximum(inbox, 0)
        h = jnp.where(inbox < 0, x_in, inbox_f[slot])
        res = [a[jnp.maximum(res_slot, 0)] for a in ring]
        kept = [a[jnp.maximum(grad_slot, 0)] for a in cts]
        action = jnp.asarray(branch_of)[kind if lockstep else op]
        st = jax.tree.map(lambda a: a[r], layer_state)
        cs = jax.tree.map(lambda a: a[at, r], ct_buf)
        out, new, g, c, st, sown = lax.switch(
            action, [typed(b) for b in branches], r, item, h, inbox_b[slot], cs, res, kept, st
        )
        layer_state = jax.tree.map(lambda a, n: a.at[r].set(kept_if_real(n, a[r])), layer_state, st)
        is_f = op == tables.F
        sown_buf = jax.tree.map(lambda a, n: a.at[at, r].set(jnp.where(is_f, n, a[at, r])), sown_buf, sown)
        ring = [a.at[res_slot].set(jnp.where(is_f, n, a[res_slot])) for a, n in zip(ring, new, strict=True)]
        if zb:
            cts = [a.at[grad_slot].set(jnp.where(op == tables.I, n, a[grad_slot])) for a, n in zip(cts, c, strict=True)]
        stack_grads = jax.tree.map(lambda a, g_: a.at[r].add(kept_if_real(g_, jnp.zeros_like(g_))), stack_grads, g)
        # The loss of the micro-batch leaving the last stage, on its device; the cotangent goes back.
        done = events["loss"]

        d = jnp.maximum(done, 0)

        def loss() -> Any:
            h_out = vary(from_stage(p - 1, out), (axis,))  # varying: the cotangent stays this device's
            owner, part = s == d // q, d % q
            # What every layer sowed for the micro-batch, in layer order (layer (r p + s) k + j: [v, p, k]).
            gathered = jax.tree.map(lambda a: lax.all_gather(a[d], axis, axis=1), sown_buf)
            sown = jax.tree.map(lambda a: a.reshape((v * p * k, 1, *a.shape[3:])), gathered)
            state = outside.build([a[d] for a in used], after)

            def run() -> Any:
                value, post_vjp, (n, sums, new_state) = jax.vjp(
                    lambda p_, h, sown: post(p_, h, part, sown, state), params, h_out, sown, has_aux=True
                )
                g_post, ct_out, ct_sown = post_vjp(vary(jnp.where(owner, 1.0, 0.0).astype(value.dtype), every))
                masked = lambda t: jax.tree.map(lambda a: jnp.where(owner, a, jnp.zeros_like(a)), t)
                moved = outside.take(new_state, outside.after)
                return g_post, ct_out, ct_sown, masked(sums), jnp.where(owner, n, 0.0), moved

            typing = lambda f: lambda: (lambda o: (like(o[0], params), *vary(o[1:], every)))(f())
            g_post, ct_out, ct_sown, sums, n, moved = on_owner(owner, run, typing)
            # This stage's layers' share of the sown values' cotangents, [v, k, ...], from the rows' device.
            mine = lambda a: from_stage(d // q, a).reshape((v, p, k, *a.shape[2:]))[:, s]
            moved = from_owner(d // q, moved)
            return from_stage(d // q, ct_out), g_post, sums, n, jax.tree.map(mine, ct_sown), moved

        no_loss = lambda: (
            jnp.zeros_like(x0),
            zeros(params),
            zeros(metric_shapes),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda a: a[0], zeros(ct_buf)),
            after,
        )
        loss_typing = lambda f: lambda: (lambda o: (vary(o[0], every), like(o[1], params), *vary(o[2:], every)))(f())
        ct_last, g_post, sums, n, ct_sown, after = cond(done >= 0, loss, no_loss, loss_typing)
        ct_buf = jax.tree.map(
            lambda a, c: a.at[d].set(jnp.where(done >= 0, c, a[d])),
            ct_buf,
            ct_sown,
        )
        grads = jax.tree.map(jnp.add, grads, g_post)
        metrics = jax.tree.map(jnp.add, metrics, sums)
        # What this unit sent reaches the neighbours' inboxes: activations from the left, cotangents from the right.
        sent_f, sent_b = lax.ppermute(out, axis, right), lax.ppermute(out, axis, left)
        inbox_f = inbox_f.at[recv_f].set(jnp.where(recv_f >= 0, sent_f, inbox_f[recv_f]))
        inbox_b = inbox_b.at[recv_b].set(jnp.where(recv_b >= 0, sent_b, inbox_b[recv_b]))
        inbox_b = inbox_b.at[recv_loss].set(jnp.where(recv_loss >= 0, ct_last, inbox_b[recv_loss]))
        # Stage 0's input cotangent goes to the rows' device, back through its layers before the stack.
        back = events["back"]

        params_typing = lambda f: lambda: like(f(), params)

        def embed_grad() -> Any:
            owner = s == jnp.maximum(back, 0) // q
            ct_x = from_stage(0, out)
            state = outside.build([a[jnp.maximum(back, 0)] for a in used])

            def run() -> Any:
                _, pre_vjp = jax.vjp(lambda p_: pre(p_, jnp.maximum(back, 0) % q, state)["x"], params)
                return pre_vjp(jnp.where(owner, ct_x, jnp.zeros_like(ct_x)))[0]

            return on_owner(owner, run, params_typing)

        grads = jax.tree.map(jnp.add, grads, cond(back >= 0, embed_grad, lambda: zeros(params), params_typing))
        sums = (layer_state, stack_grads, grads, metrics, count + n)
        return (inbox_f, inbox_b, ring, cts, sown_buf, ct_buf, *sums, before, after, used), None

    sums = (
        like(zeros(chunks), chunks),
        like(zeros(params), params),
        *vary((zeros(metric_shapes), jnp.zeros(())), every),
    )
    inboxes, sown_bufs = vary((inbox_f, inbox_b), every), vary((sown_buf, ct_buf), every)
    threaded = vary((outside.take(model_state, outside.before), outside.take(model_state, outside.after)), every)
    used = [jnp.zeros((m, *a.shape), a.dtype) for a in threaded[0]]
    carry = (*inboxes, ring, cts, *sown_bufs, vary(layer_state, every), *sums, *threaded, vary(used, every))
    columns = tuple(jnp.asarray(plan.columns[name]) for name in tables.COLUMNS)
    events = {name: jnp.asarray(e) for name, e in plan.events.items()}
    kinds = jnp.asarray(plan.kinds if plan.kinds is not None else np.zeros(plan.units, np.int32))
    carry, _ = lax.scan(unit, carry, (columns, events, kinds))
    *_, layer_state, stack_grads, grads, metrics, count, before, after, _ = carry
    # The stack's gradient, summed over the units, goes back to the parameters once (through the pre piece).
    _, to_params = jax.vjp(lambda p_: pre(p_, 0)["params"], params)
    (g_stack,) = to_params(jax.tree.map(lambda a: a.reshape((local,) + a.shape[2:]), stack_grads))
    # Every stage's rows of the stack's state, gathered: the whole state on every device, as GPipe leaves it.
    new_state = outside.build(before, after, gpipe.whole_state(layer_state, local, p, v, axis))
    return jax.tree.map(jnp.add, grads, g_stack), metrics, count, new_state
