"""The user's function inside a step: :func:`call_model_fn` runs it with the rules and the parallelisms' contexts in
force (both steps), and :func:`differentiable_loss` wraps the train step's ``loss_fn`` into the value its micro-batch
differentiates."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp

from spmdcomm._jax_compat import collective_axes_in_traceback
from spmdcomm.errors import AxisError, SpmdError, describe
from spmdcomm.parallel._logical_rules import step_axis_rules
from spmdcomm.parallel.data.strategy import ReduceContext
from spmdcomm.parallel.registry import registered
from spmdcomm.train._step import check_scalars
from spmdcomm.train.state import TrainState
from spmdcomm.train.weighted import Weighted

__all__ = ["differentiable_loss", "call_model_fn", "model_contexts", "split_loss_output"]


def differentiable_loss(
    loss_fn: Callable[..., Any], ctx: ReduceContext, state: TrainState, masked: bool, reserved: set[str]
) -> tuple[Callable[..., Any], Callable[[], AbstractContextManager[None]]]:
    """``(f, contexts)``: ``contexts()`` enters what is in force while ``loss_fn`` runs (:func:`model_contexts`), for a
    schedule that runs the model's layers outside it; ``f(params, batch, ..., count, weight, share) ->
    (differentiated value, (loss, aux))`` for
    ``jax.value_and_grad``: a mean loss times ``weight`` (see :func:`~spmdcomm.train.weighted.loss_weight`; zero for
    a masked block without real examples, whose mean may be NaN), a token-weighted loss's total times ``share`` (see
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
                "make_train_step", "loss_fn", state, loss_fn, strategy.compute_params(ctx, layout, p), batch, **kwargs
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

    return wrapped, functools.partial(model_contexts, state)


def call_model_fn(fn: str, who: str, state: TrainState, model_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``model_fn(*args, **kwargs)`` (the user's ``loss_fn`` or ``metric_fn``), with a collective over an axis the
    step does not run over (e.g. Flax ``BatchNorm(axis_name="batch")`` under a state on ``"data"``) reported as an
    :class:`~spmdcomm.errors.AxisError` naming both, instead of JAX's bare error from inside the model. The
    state's logical axis rules (or the active ``nn.logical_axis_rules`` context) are in force, without the axes the
    step maps by hand, so that the model's ``nn.with_logical_constraint`` calls constrain only the model axes; and
    every registered parallelism's context is (with its config, or ``None`` when the state has none)."""
    try:
        with model_contexts(state):
            return model_fn(*args, **kwargs)
    except (AssertionError, NameError) as e:
        bound = state.data_axes
        asked = collective_axes_in_traceback(e.__traceback__)
        missing = [a for a in asked if a not in bound]
        if not missing:
            raise
        raise AxisError(
            describe(
                fn,
                f"{who} runs a collective over axis {missing[0]!r} (e.g. a BatchNorm's axis_name), but the step "
                f"runs over the data axes {bound} of the state's mesh {dict(state.mesh.shape)}.",
                fix=f"build the model with axis_name={state.axis!r}, or create the state on a mesh with that axis: "
                f"sc.TrainState.create(..., mesh=sc.make_mesh({{{missing[0]!r}: n}}), axis={missing[0]!r}).",
            )
        ) from e


@contextlib.contextmanager
def model_contexts(state: TrainState) -> Iterator[None]:
    """What is in force while the user's model runs in a step: the state's logical axis rules without the manual
    axes, and every registered parallelism's context (with its config, or ``None`` when the state has none). A
    schedule that runs the model's layers outside the user's function (the pipeline's table schedules) enters it
    again around them."""
    roles, configs = state.roles, state.configs
    with contextlib.ExitStack() as contexts:
        contexts.enter_context(step_axis_rules(state.logical_axis_rules, roles.manual))
        for entry in registered():
            contexts.enter_context(entry.enter(configs.get(entry.keyword), roles))
        yield


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
