"""The body of the compiled train step: one device's block (:mod:`spmdcomm.train._micro`), the strategy's reduction,
the merged model state, the optimizer update and the step's metrics. The public step object is
:mod:`spmdcomm.train.train_step`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from spmdcomm.parallel.data._flat import all_finite
from spmdcomm.parallel.data.strategy import ReduceContext
from spmdcomm.train._hyperparams import injected_hyperparams
from spmdcomm.train._micro import StepOptions, accumulate
from spmdcomm.train._model_state import float_leaves, merge_model_state
from spmdcomm.train._step import compile_global_step, sum_dtype, zero_masked_rows
from spmdcomm.train.loss_scale import next_loss_scale
from spmdcomm.train.state import TrainState
from spmdcomm.train.weighted import Weighted

__all__ = ["compile_train_step"]


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
        grad_sum, metric_sums, model_state, count = accumulate(o, ctx, state, data, mask, reserved)
        # The example count, the metrics and the model state travel in one f32 vector (XLA:CPU pays
        # per buffer); XLA fuses its all-reduce with the gradients' into one collective.
        masked = mask is not None
        weighted_state = float_leaves(model_state)
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
        new_model_state = merge_model_state(
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
            # spmdcomm.train.weighted.loss_weight), so the reduced gradient is already the global mean's, times the
            # scale: unscaled in float32 at least (a float16 gradient divided by 65536 underflows), as Flax's
            # DynamicScale.
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
