"""The body of the compiled train step: micro-batches, the loss and its gradient, the strategy's reduction, the
optimizer update and the step's metrics. The public step object is :mod:`spmdcomm.train.train_step`."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from spmdcomm._jax_compat import vary
from spmdcomm.data.placement import HostInput
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.data._flat import all_finite
from spmdcomm.parallel.data.strategy import ReduceContext
from spmdcomm.parallel.pipeline.schedule import MicroPieces
from spmdcomm.parallel.rng import is_key_leaf, per_example_key
from spmdcomm.train._hyperparams import injected_hyperparams
from spmdcomm.train._step import (
    call_model_fn,
    check_scalars,
    compile_global_step,
    full_mask,
    sum_dtype,
    summable,
    zero_masked_rows,
)
from spmdcomm.train.loss_scale import next_loss_scale
from spmdcomm.train.state import TrainState
from spmdcomm.train.weighted import Weighted, token_share


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The options of :func:`make_train_step`, validated."""

    loss_fn: Callable[..., Any]
    accum_steps: int
    reduce_dtype: Any
    skip_nonfinite: bool
    donate: bool
    rng: str
    host_input: HostInput


def split_loss_output(out: Any, fn: str) -> tuple[Any, dict[str, Any]]:
    """``(loss, aux dict)`` from a ``loss_fn`` result (``loss`` or ``(loss, aux)``)."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise SpmdError(
                describe(
                    fn,
                    f"loss_fn returned a tuple of {len(out)} items; expected loss or (loss, aux dict).",
                    fix='return the scalar mean loss, or (loss, {"metric": value, "model_state": new_state}).',
                )
            )
        return out[0], dict(out[1])
    return out, {}


# --------------------------------------------------------------------------------------------------


def compile_train_step(o: StepOptions, state: TrainState) -> jax.stages.Wrapped:
    """The compiled ``step(state, data, mask) -> (state, metrics)`` for ``state``'s mesh, strategy and shapes."""
    strategy, layout, axis = state.strategy, state.layout, state.data_axes
    scaled = state.loss_scale is not None
    ctx = ReduceContext(axis, state.data_size, o.reduce_dtype, o.skip_nonfinite or scaled)
    blocks = state.roles.blocks  # one per device of the data, stage and context axes
    # What the step itself reports: aux metrics of these names would silently replace them.
    hyperparams = injected_hyperparams(state.opt_state)
    reserved = {"loss", "examples", "model_state", *jax.eval_shape(hyperparams, state.opt_state)}
    reserved |= {"skipped"} if o.skip_nonfinite or scaled else set()
    reserved |= {"loss_scale"} if scaled else set()

    def denominator(total: jax.Array, masked: bool) -> jax.Array | float:
        # Masked: sums of count-weighted means over the real-example count. Unmasked: sums of means
        # over the number of (equal) blocks, which needs no per-gradient multiplication.
        return jnp.maximum(total, 1.0) if masked else float(blocks * o.accum_steps)

    def reduce(state: TrainState, data: Any, mask: Any) -> tuple[Any, ...]:
        """Per device (manual over the axis): the gradient summed over the axis, each leaf whole or as this
        device's block (``layout.grad_specs``), the real-example total, the metric sums and the new model state."""
        data = data if mask is None else zero_masked_rows(data, mask)
        grad_sum, metric_sums, model_state, count = _accumulate(o, ctx, state, data, mask, reserved)
        # The example count, the metrics and the model state travel in one f32 vector (XLA:CPU pays
        # per buffer); XLA fuses its all-reduce with the gradients' into one collective.
        masked = mask is not None
        weighted_state = _float_leaves(model_state)
        if masked:
            weighted_state = jax.tree.map(lambda v: jnp.where(count > 0, count * v, jnp.zeros_like(v)), weighted_state)
        vec, unravel = ravel_pytree((count, metric_sums, weighted_state))
        # The stage and context axes split the batch too: their devices saw other rows, or other tokens of them.
        others = state.roles.manual[len(state.data_axes) :]
        if others:
            vec = lax.psum(vec, others)
        vec, reduced = strategy.reduce(ctx, layout, grad_sum, vec)
        total, metric_sums, stats = unravel(vec)
        # Each device sent its last model state once, not once per micro-batch: unmasked, the average is over the
        # blocks alone (dividing by blocks * accum_steps shrank the running statistics accum_steps times).
        state_denom = jnp.maximum(total, 1.0) if masked else float(blocks)
        new_model_state = _merge_model_state(
            model_state, jax.tree.map(lambda v: v / state_denom, stats), state.roles.manual, state.model_state
        )
        return reduced, total, metric_sums, new_model_state

    def update(
        state: TrainState, masked: bool, reduced: Any, total: jax.Array, metric_sums: Any, new_model_state: Any
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """The optimizer step on the model's tree, in the global view: each leaf is a sharded array and XLA adds the
        reductions a global norm or a per-leaf statistic needs. The optimizer sees every leaf at its own shape:
        padded leaves are cut to it before and padded again after (see spmdcomm.parallel.data.layout)."""
        denom = denominator(total, masked)
        loss_sums = metric_sums["loss"]
        tokens = loss_sums.weight if isinstance(loss_sums, Weighted) else None
        # A token-weighted loss's gradient is the sum of its totals' gradients: divided once by the global weight.
        grad_denom = denom if tokens is None else jnp.where(tokens > 0, tokens, 1.0)
        reduced = layout.unpadded(reduced, "grads", state.mesh)
        stored_params, stored_opt_state = state.params, state.opt_state
        state = state.replace(
            params=layout.unpadded(state.params, "params", state.mesh),
            opt_state=layout.unpadded(state.opt_state, "opt", state.mesh),
        )
        if scaled:
            # Each device's loss was weighed by its share of the global batch before differentiating (see
            # _loss_weight), so the reduced gradient is already the global mean's, times the scale: unscaled in
            # float32 at least (a float16 gradient divided by 65536 underflows), as Flax's DynamicScale.
            grads = jax.tree.map(lambda g: g.astype(sum_dtype(g.dtype)) / state.loss_scale.scale, reduced)
        else:
            grads = jax.tree.map(lambda g: (g / grad_denom).astype(g.dtype), reduced)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = strategy.store_params(layout, state.mesh, optax.apply_updates(state.params, updates))
        params = layout.stored(params, "params", state.mesh)
        # Keep the old state where nothing real was seen (all padding, or no token of weight) or a gradient was not
        # finite.
        apply = total > 0 if masked else None
        if tokens is not None:
            apply = tokens > 0 if apply is None else apply & (tokens > 0)
        finite = all_finite(grads) if o.skip_nonfinite or scaled else None
        if finite is not None:
            apply = finite if apply is None else apply & finite
        keep = (
            (lambda new, old: new)
            if apply is None
            else (lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old))
        )
        new_state = state.replace(
            step=state.step + 1,
            params=keep(params, stored_params),
            opt_state=keep(layout.stored(opt_state, "opt", state.mesh), stored_opt_state),
            model_state=keep(new_model_state, state.model_state),
        )
        metrics = {k: v.mean() if isinstance(v, Weighted) else v / denom for k, v in metric_sums.items()}
        metrics["examples"] = total / state.roles.size(state.roles.tokens)  # every token device counted its rows
        if tokens is not None:
            metrics["tokens"] = tokens  # every context device weighed its own tokens
        if finite is not None:
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        if scaled:
            metrics["loss_scale"] = state.loss_scale.scale.astype(jnp.float32)  # the scale this step used
            assert finite is not None  # a scaled step always checks its gradient (above)
            new_state = new_state.replace(loss_scale=next_loss_scale(state.loss_scale, finite))
        metrics.update(hyperparams(opt_state))
        return new_state, metrics

    reduced_specs = (layout.manual_specs("grads"), P(), P(), P())
    return compile_global_step(
        "make_train_step",
        reduce,
        reduced_specs,
        lambda state, data, mask, out: update(state, mask is not None, *out),
        state,
        donate=o.donate,
    )


def _accumulate(
    o: StepOptions, ctx: ReduceContext, state: TrainState, data: Any, mask: Any, reserved: set[str]
) -> tuple[Any, ...]:
    """Runs loss_fn over the micro-batches, in the loop of the state's schedule (sequential: gradient accumulation).

    Returns the sums over micro-batches of gradients (in the strategy's accumulated form) and metrics
    (weighted by real-example count when the batch is masked), the last model state and this device's
    real-example count.
    """
    axis, k, masked = state.data_axes, o.accum_steps, mask is not None
    strategy, layout, schedule = state.strategy, state.layout, state.schedule
    mask = full_mask(data, state.roles.batch) if mask is None else mask
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), (data, mask))
    micro_rng = _micro_rng(o, state, mask.shape[0] // k)
    # Replicated parameters are marked varying so that each device differentiates its own loss. A masked block's
    # weight (its real-example count) is applied to the loss before differentiating, never to the gradient after:
    # a device's gradient also holds the other devices' losses wherever the model couples them (synchronised
    # BatchNorm statistics: the transpose of their all-reduce), and split parameters (FSDP) come out summed over
    # the axis by the transpose of the gather; each of those terms must carry its own device's weight.
    params = vary(state.params, axis)
    weight = _loss_weight(state, mask, masked, k)
    loss_fn = _differentiable_loss(o, ctx, state, masked, reserved)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    extra = {"step": state.step} if _takes_keyword(o.loss_fn, "step") else {}

    def call(
        fn: Callable[..., Any], p: Any, model_state: Any, batch: Any, m: jax.Array, j: Any, share: Any, part: Any = 0
    ) -> Any:
        c = jnp.sum(m, dtype=jnp.float32)  # a part (of `parts`) of micro-batch j: an unmasked mean weighs 1 / parts
        kwargs = dict(apply_fn=state.apply_fn, model_state=model_state, rng=micro_rng(j, part), mask=m, **extra)
        return c, fn(p, batch, count=c, weight=weight(c) if masked else weight(c) / parts, share=share, **kwargs)

    parts = schedule.parts(mask.shape[0] // k)
    share = token_share(state, micro, lambda b, m, j: call(loss_fn, params, state.model_state, b, m, j, 1.0))

    def metric_sums(c: jax.Array, loss: Any, aux: dict[str, Any]) -> dict[str, Any]:
        # Masked, a block without real examples may give a NaN mean: its weight is zero, and so is
        # its contribution. Unmasked, every block has the same count: plain sums, divided once by
        # the number of blocks after the reduction. A token-weighted value carries its own weight.
        if parts > 1 and isinstance(loss, Weighted):  # its share is of the whole micro-batch's weight
            fix = "use a per-row mean loss, or schedule='gpipe'."
            raise SpmdError(describe("make_train_step", f"a token-weighted loss with {schedule!r}.", fix=fix))
        weigh = (lambda v: jnp.where(c > 0, c * v, jnp.zeros_like(v))) if masked else (lambda v: v / parts)
        return {
            name: summable(v) if isinstance(v, Weighted) else weigh(v.astype(sum_dtype(v.dtype)))
            for name, v in {"loss": loss, **aux}.items()
        }

    def one(model_state: Any, batch: Any, m: jax.Array, j: Any) -> tuple[Any, ...]:
        c, ((_, (loss, aux)), grads) = call(grad_fn, params, model_state, batch, m, j, share)
        new_model_state = aux.pop("model_state", model_state)
        _check_same_tree(model_state, new_model_state)
        metrics = metric_sums(c, loss, aux)
        if masked and strategy.local_grads:
            # A block without real examples has weight 0, but its backward pass may still give 0 * NaN = NaN: a
            # gradient is kept when any row it depends on is real (the schedule says which rows those are). The
            # rows, not the tokens: a real row without tokens is one device's too, NaN and all.
            seen = schedule.rows_seen(c)
            grads = jax.tree.map(lambda g: jnp.where(seen > 0, g, jnp.zeros_like(g)), grads)
        return strategy.micro_grads(ctx, layout, grads), metrics, new_model_state, c

    pieces = MicroPieces(
        params=params,
        loss=lambda p, batch, m, j, part: call(loss_fn, p, state.model_state, batch, m, j, share, part),
        metrics=metric_sums,
        grads=lambda grads: strategy.micro_grads(ctx, layout, grads),
    )
    return schedule.loop(one, vary(state.model_state, state.roles.manual), micro, axis, pieces=pieces)


def _micro_rng(o: StepOptions, state: TrainState, rows: int) -> Callable[..., jax.Array]:
    """``f(j, part=0)``: the ``rng`` of micro-batch ``j`` (``rows`` examples) on this device, or of its part
    ``part`` of the schedule's ``parts(rows)`` equal parts."""
    step_rng = jax.random.fold_in(state.rng, state.step)
    device = lax.axis_index(state.roles.batch)  # row-major over the batch axes, as the batch is split
    parts = state.schedule.parts(rows)
    if o.rng == "per_example":
        # Device d's block holds global rows [d * k * rows, (d + 1) * k * rows); micro-batch j of it
        # starts j * rows further, its part i another i * rows / parts. Every device shares step_rng: only the
        # row offset differs.
        first = device * (o.accum_steps * rows)
        size = rows // parts
        return lambda j, part=0: per_example_key(step_rng, offset=first + j * rows + part * size, rows=size)
    device_rng = jax.random.fold_in(step_rng, device)
    if parts == 1:
        return lambda j, part=0: jax.random.fold_in(device_rng, j)
    return lambda j, part=0: jax.random.fold_in(jax.random.fold_in(device_rng, j), part)


def _loss_weight(state: TrainState, mask: jax.Array, masked: bool, k: int) -> Callable[[jax.Array], Any]:
    """``f(count) -> weight``: what a micro-batch's mean loss is multiplied by before differentiating, given its
    real-example ``count`` (``mask`` is this device's block of the step's mask, ``k`` micro-batches of it, one block
    per device of the batch axes).

    Without loss scaling: the count when the batch is masked (the sum over devices is then divided by the total
    count), else 1 (divided by the number of blocks). With loss scaling the weight is the micro-batch's share of the
    global batch (count / global count, or 1 / blocks), so the backward pass runs on the values one device's
    ``scale * global mean`` gives each example: float16 overflows, skipped steps and scales are one device's
    whatever the mask and device count (weighing by the count alone overflowed up to count times sooner)."""
    if state.loss_scale is None:
        return (lambda c: c) if masked else (lambda c: 1.0)
    if not masked:
        return lambda c: 1.0 / (state.roles.blocks * k)
    # The mask is per row: the same on every context device, so typed varying before summing over them too.
    total = jnp.maximum(lax.psum(vary(jnp.sum(mask, dtype=jnp.float32), state.roles.manual), state.roles.manual), 1.0)
    return lambda c: c / total


def _differentiable_loss(
    o: StepOptions, ctx: ReduceContext, state: TrainState, masked: bool, reserved: set[str]
) -> Callable[..., Any]:
    """``f(params, batch, ..., count, weight, share) -> (differentiated value, (loss, aux))`` for
    ``jax.value_and_grad``: a mean loss times ``weight`` (see :func:`_loss_weight`; zero for a masked block without
    real examples, whose mean may be NaN), a token-weighted loss's total times ``share`` (see
    :func:`~spmdcomm.train.weighted.token_share`; zero without weight), times the loss scale."""
    strategy, layout = state.strategy, state.layout
    # A pipeline gathers each stage's layers once per step and keeps them (MaxText's fsdp_ag_once), and
    # rematerialises its ticks itself: its schedule turns the strategy's policy off.
    policy = strategy.remat_policy if state.schedule.strategy_remat else None

    def wrapped(
        params: Any, batch: Any, *, count: jax.Array, weight: Any, share: Any, **kwargs: Any
    ) -> tuple[jax.Array, Any]:
        def forward(p: Any) -> Any:
            return call_model_fn(
                "make_train_step", "loss_fn", state, o.loss_fn, strategy.compute_params(ctx, layout, p), batch, **kwargs
            )

        if policy is not None:
            # The strategy's policy says which forward values the backward pass recomputes instead of keeping
            # (FSDP's resharding: the gathered parameters, gathered again).
            forward = jax.checkpoint(forward, policy=policy)
        loss, aux = split_loss_output(forward(params), "make_train_step")
        _check_aux_names(aux, reserved | ({"tokens"} if isinstance(loss, Weighted) else set()))
        scalars = {"loss": loss, **{k: v for k, v in aux.items() if k != "model_state"}}
        check_scalars("make_train_step", scalars, "loss_fn")
        if isinstance(loss, Weighted):
            # The unnormalised total: each micro-batch's backward pass needs nothing of the others.
            total = loss.total
            value = (share if state.loss_scale is None else jnp.asarray(share, total.dtype)) * total
            value = jnp.where(loss.weight > 0, value, jnp.zeros_like(value))
        else:
            # In the loss's dtype, as one device's ``scale * loss`` differentiates a float16 loss in float16.
            value = (weight if state.loss_scale is None else jnp.asarray(weight, loss.dtype)) * loss
            value = jnp.where(count > 0, value, jnp.zeros_like(loss)) if masked else value
        if state.loss_scale is not None:
            # Not cast to the loss's dtype: 65536 is Inf in float16. A float16 loss is promoted, as in Flax.
            value = value * state.loss_scale.scale
        return value, (loss, dict(aux))

    return wrapped


def _check_aux_names(aux: dict[str, Any], reserved: set[str]) -> None:
    taken = sorted(k for k in aux if k in reserved and k != "model_state")
    if taken:
        raise SpmdError(
            describe(
                "make_train_step",
                f"loss_fn's aux holds {taken}, which the step reports itself (its metrics are "
                f"{sorted(reserved - {'model_state'})}); the aux value would silently replace the step's.",
                fix=f"rename the aux metric(s), e.g. {taken[0]!r} -> 'aux/{taken[0]}'.",
            )
        )


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` names the keyword parameter ``name``. A ``**kwargs`` catch-all does not count: such functions
    often forward their keywords to one that takes only the contract's."""
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # no signature to read (a builtin): pass only the contract's arguments
        return False
    return parameter is not None and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)


def _check_same_tree(old: Any, new: Any) -> None:
    # jax.tree_util.PyTreeDef: jaxlib ships no type stubs, so mypy knows a treedef's methods only through this name
    old_def: jax.tree_util.PyTreeDef = jax.tree.structure(old)
    new_def: jax.tree_util.PyTreeDef = jax.tree.structure(new)
    old_shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(old)]
    new_shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(new)]
    if old_def != new_def or old_shapes != new_shapes:
        raise SpmdError(
            describe(
                "make_train_step",
                f"loss_fn returned a model_state whose tree or shapes differ from "
                f"state.model_state: expected {old_def} {old_shapes}, got {new_def} {new_shapes}.",
                fix="return the updated model state with the same structure (or leave 'model_state' out of aux).",
            )
        )


def _float_leaves(tree: Any) -> Any:
    # The float leaves in the dtype they are summed in; other leaves become empty (not averaged).
    return jax.tree.map(
        lambda x: (
            x.astype(sum_dtype(x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros((0,), jnp.float32)
        ),
        tree,
    )


def _merge_model_state(local: Any, averaged: Any, axis: str | tuple[str, ...], stored: Any) -> Any:
    # Float leaves take their weighted average over the axis; integer leaves (counters, e.g. NNX
    # RngCount) must agree on every replica and take the maximum. RNG keys are never averaged: the
    # stored key stays (a model's streams only advance their counts), identical on every replica.
    def merge(x: jax.Array, avg: jax.Array, old: jax.Array) -> jax.Array:
        if is_key_leaf(x):
            return old
        return avg.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else lax.pmax(x, axis)

    return jax.tree.map(merge, local, averaged, stored)
