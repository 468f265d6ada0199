"""One device's block of a train step: its micro-batches in the loop of the state's schedule (sequential: gradient
accumulation), each one's loss, gradient and metric sums. :func:`accumulate` is called once per step, inside the
``shard_map``; the step body around it is :mod:`spmdcomm.train._train_body`."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._jax_compat import vary
from spmdcomm.data.placement import HostInput
from spmdcomm.parallel.data.strategy import ReduceContext
from spmdcomm.parallel.pipeline.schedule import MicroPieces, check_model_state
from spmdcomm.parallel.real_rows import rows_of
from spmdcomm.parallel.rng import per_example_key
from spmdcomm.train._model_call import differentiable_loss
from spmdcomm.train._step import sum_dtype, summable
from spmdcomm.train.state import TrainState
from spmdcomm.train.weighted import Weighted, loss_weight, token_share

__all__ = ["StepOptions", "accumulate", "full_mask"]


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


def accumulate(
    o: StepOptions, ctx: ReduceContext, state: TrainState, data: Any, mask: Any, reserved: set[str]
) -> tuple[Any, ...]:
    """Runs loss_fn over the micro-batches, in the loop of the state's schedule (sequential: gradient accumulation).

    Returns the sums over micro-batches of gradients (in the strategy's accumulated form) and metrics
    (weighted by real-example count when the batch is masked), the last model state and this device's
    real-example count.
    """
    axis, k, masked = state.data_axes, o.accum_steps, mask is not None
    strategy, layout, schedule, manual = state.strategy, state.layout, state.schedule, state.roles.manual
    rows = jax.tree.leaves(data)[0].shape[0] // k  # of one micro-batch
    micro_rng = _micro_rng(o, state, rows)
    extra = {"step": state.step} if _takes_keyword(o.loss_fn, "step") else {}
    parts = schedule.parts(rows)
    # Replicated parameters are marked varying so that each device differentiates its own loss; the model state and
    # the global sums (a loss's weight, see spmdcomm.train.weighted) vary over every manual axis.
    mask = full_mask(data, state.roles.batch) if mask is None else mask
    params = vary(state.params, axis)
    first_state = vary(state.model_state, manual)
    global_sum = lambda x: lax.psum(vary(x, manual), manual)
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), (data, mask))
    # A masked block's weight (its real-example count) is applied to the loss before differentiating, never to the
    # gradient after: a device's gradient also holds the other devices' losses wherever the model couples them
    # (synchronised BatchNorm statistics: the transpose of their all-reduce), and split parameters (FSDP) come out
    # summed over the axis by the transpose of the gather; each of those terms must carry its own device's weight.
    loss_fn, contexts = differentiable_loss(o.loss_fn, ctx, state, masked, reserved)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    weight = loss_weight(state, mask, masked, k, global_sum)

    def call(
        fn: Callable[..., Any], p: Any, model_state: Any, batch: Any, m: jax.Array, j: Any, share: Any, part: Any = 0
    ) -> Any:
        c = jnp.sum(m, dtype=jnp.float32)  # a part (of `parts`) of micro-batch j: an unmasked mean weighs 1 / parts
        kwargs = dict(apply_fn=state.apply_fn, model_state=model_state, rng=micro_rng(j, part), mask=m, **extra)
        # Layers that couple the rows (a mixture of experts) leave the padding rows out too.
        with rows_of(m if masked else None):
            return c, fn(p, batch, count=c, weight=weight(c) if masked else weight(c) / parts, share=share, **kwargs)

    forward = lambda b, m, j: call(loss_fn, params, state.model_state, b, m, j, 1.0)
    share = token_share(state, micro, forward, global_sum)

    def metric_sums(c: jax.Array, loss: Any, aux: dict[str, Any]) -> dict[str, Any]:
        # Masked, a block without real examples may give a NaN mean: its weight is zero, and so is
        # its contribution. Unmasked, every block has the same count: plain sums, divided once by
        # the number of blocks after the reduction. A token-weighted value carries its own weight (a part's, under
        # a schedule that cuts micro-batches into parts: the totals and weights add up to the micro-batch's).
        weigh = (lambda v: jnp.where(c > 0, c * v, jnp.zeros_like(v))) if masked else (lambda v: v / parts)
        return {
            name: summable(v) if isinstance(v, Weighted) else weigh(v.astype(sum_dtype(v.dtype)))
            for name, v in {"loss": loss, **aux}.items()
        }

    def one(model_state: Any, batch: Any, m: jax.Array, j: Any) -> tuple[Any, ...]:
        c, ((_, (loss, aux)), grads) = call(grad_fn, params, model_state, batch, m, j, share)
        new_model_state = aux.pop("model_state", model_state)
        check_model_state(model_state, new_model_state)
        metrics = metric_sums(c, loss, aux)
        if masked and strategy.local_grads:
            # A block without real examples has weight 0, but its backward pass may still give 0 * NaN = NaN: a
            # gradient is kept when any row it depends on is real (the schedule says which rows those are). The
            # rows, not the tokens: a real row without tokens is one device's too, NaN and all.
            seen = schedule.rows_seen(c)
            # Autodiff summed a replicated parameter's gradient over the other axes that split the batch (an expert
            # or context axis; the schedule counts its own stage axis): it depends on their rows too.
            rest = tuple(a for a in manual[len(state.data_axes) :] if a != state.roles.stage)
            seen = lax.psum(vary(seen, rest), rest) if rest else seen
            grads = jax.tree.map(lambda g: jnp.where(seen > 0, g, jnp.zeros_like(g)), grads)
        return strategy.micro_grads(ctx, layout, grads), metrics, new_model_state, c

    pieces = MicroPieces(
        params=params,
        loss=lambda p, model_state, batch, m, j, part: call(loss_fn, p, model_state, batch, m, j, share, part),
        metrics=metric_sums,
        grads=lambda grads: strategy.micro_grads(ctx, layout, grads),
        context=contexts,
    )
    return schedule.loop(one, first_state, micro, axis, pieces=pieces)


def full_mask(data: Any, axes: tuple[str, ...]) -> jax.Array:
    """An all-True mask of the block's length, typed varying over the batch axes ``axes`` as a MaskedBatch's mask is:
    a constant would be replicated, and ``sc.psum(jnp.sum(mask), "data")`` inside ``loss_fn`` (the global row count)
    would then warn that it multiplies a replicated value by the axis size, although that product is what is meant."""
    return vary(jnp.ones((jax.tree.leaves(data)[0].shape[0],), dtype=bool), axes)


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


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` names the keyword parameter ``name``. A ``**kwargs`` catch-all does not count: such functions
    often forward their keywords to one that takes only the contract's."""
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # no signature to read (a builtin): pass only the contract's arguments
        return False
    return parameter is not None and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
