"""Schedules: how a train step runs one device's block of the global batch.

A :class:`Schedule` owns two things: the loop over the block's micro-batches (:meth:`Schedule.loop`, given the
gradient of one micro-batch) and the way a stack of layers runs inside one micro-batch's forward pass
(:meth:`Schedule.stack`, which :func:`run_stack`, and so :class:`~spmdcomm.PipelineStack`, calls). The base class is
the sequential schedule: gradient accumulation runs the ``accum_steps`` micro-batches one after the other and sums
their gradients, and a layer stack is a ``lax.scan`` over its layers. :class:`~spmdcomm.Pipeline` keeps that loop
and runs each stack as a pipeline over the stage axis (GPipe, circular). A schedule that interleaves the forward and
backward passes of different micro-batches (the pipeline's 1F1B: activation memory bounded by the stage count)
overrides both hooks: ``loop`` differentiates the micro-batches itself, from the :class:`MicroPieces` the step
hands it, with ``jax.vjp`` in its own order, and ``stack`` splits the user's forward pass where the stages' work
begins and ends; the state, the step and the strategies stay as they are.

The train and eval steps make their state's schedule active while they trace the user's function
(:func:`schedule_context`); outside a step the sequential schedule is.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._jax_compat import vary
from spmdcomm.errors import SpmdError, describe

__all__ = [
    "Schedule",
    "MicroStep",
    "MicroPieces",
    "LayerFn",
    "SEQUENTIAL",
    "run_stack",
    "active_schedule",
    "schedule_context",
    "PIPELINED",
    "check_model_state",
]

#: ``step(model_state, batch, mask, j) -> (grads, metrics, model_state, count)``: micro-batch ``j``'s gradient (in
#: the strategy's accumulated form), its metric sums, the model state after it and its real-example count.
MicroStep = Callable[[Any, Any, Any, Any], tuple[Any, Any, Any, jax.Array]]


@dataclasses.dataclass(frozen=True)
class MicroPieces:
    """What a schedule that differentiates a micro-batch in pieces of its own (1F1B) needs besides the step.

    Attributes:
      params: the parameters the step differentiates (typed varying over the data axes).
      loss: ``loss(params, model_state, batch, mask, j, part) -> (count, (value, (loss, aux)))``: the
        differentiable value of part ``part`` (of :meth:`Schedule.parts`) of micro-batch ``j`` from ``model_state``,
        its real-example count, and the user's loss and aux (the model state the loss returns in ``aux``).
      metrics: ``metrics(count, loss, aux) -> metric sums`` of one part, as the step sums them.
      grads: the strategy's form of a gradient sum (what ``step`` returns its gradient in).
      context: ``context()``: a context manager for the model's layers run outside ``loss`` (the contexts the step
        runs the user's function in: logical axis rules, the parallelisms' contexts, such as context parallelism's).
    """

    params: Any
    loss: Callable[..., Any]
    metrics: Callable[..., Any]
    grads: Callable[[Any], Any]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


#: ``layer_fn(layer_params, layer_state, h, index, row) -> (h, layer_state)``: one layer of a stack. A key of the
#: returned state that the given one lacks is a collection the layer sowed (a MoE layer's statistics): the schedule
#: hands it out per layer and per micro-batch, ``[L, m, ...]`` (``m = 1`` in a plain scan).
LayerFn = Callable[[Any, Any, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


class Schedule:
    """How a step runs a device's block of the batch (module docstring). This base class is the sequential
    schedule (gradient accumulation; a layer stack is a scan); subclasses override what they schedule otherwise."""

    #: Whether the strategy's rematerialisation policy (FSDP's: keep what the forward pass computed, gather the
    #: parameters again) may wrap the forward pass. A schedule that rematerialises its own ticks says no: the
    #: outer policy would override it.
    strategy_remat: ClassVar[bool] = True

    def loop(
        self, step: MicroStep, model_state: Any, micro: Any, axes: tuple[str, ...], *, pieces: MicroPieces | None = None
    ) -> tuple[Any, ...]:
        """Runs ``step`` over the micro-batches in order, the model state threaded through.

        Args:
          step: the gradient of one micro-batch (:data:`MicroStep`).
          model_state: the model state before the first micro-batch.
          micro: ``(batch, mask)``, every leaf with the micro-batches on dimension 0.
          axes: the manual axes the sums vary over (the loop's carry is typed so).
          pieces: the micro-batch's pieces, for a schedule that differentiates them itself (unused here).

        Returns:
          ``(grad_sum, metric_sums, model_state, count)``: sums over the micro-batches, the last model state.
        """
        batch, mask = jax.tree.map(lambda x: x[0], micro)
        first = step(model_state, batch, mask, 0)
        count = jax.tree.leaves(micro)[0].shape[0]
        if count == 1:
            return first

        def body(carry: Any, xs: Any) -> Any:
            grad_sum, metric_sums, model_state, total = carry
            (batch, mask), j = xs
            grads, metrics, model_state, c = step(model_state, batch, mask, j)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            return (add(grad_sum, grads), add(metric_sums, metrics), model_state, total + c), None

        rest = jax.tree.map(lambda x: x[1:], micro)
        carry, _ = lax.scan(body, vary(first, axes), (rest, jnp.arange(1, count)))
        return carry

    def parts(self, rows: int) -> int:
        """Into how many equal parts the schedule's loop cuts a micro-batch of ``rows`` rows, each differentiated
        through :attr:`MicroPieces.loss` (1: the micro-batch is one piece, through ``step``)."""
        return 1

    def rows_seen(self, count: jax.Array) -> jax.Array:
        """The real-example count of the rows one micro-batch's gradient on this device depends on.

        A gradient that depends on no real row is dropped (a masked block's may be ``0 * NaN``).

        Args:
          count: this device's real-example count in the micro-batch.

        Returns:
          ``count``: sequentially, a gradient depends on this device's rows only.
        """
        return count

    def stack(self, layer_fn: LayerFn, params: Any, state: Any, x: jax.Array, *, remat: bool) -> tuple[jax.Array, Any]:
        """Runs a layer stack inside one micro-batch's forward pass: a scan over the layers.

        Args:
          layer_fn: one layer, as :func:`run_stack` takes it.
          params: the stacked parameters (all layers on dimension 0).
          state: the stacked mutable state (``{}``: none).
          x: the input rows.
          remat: rematerialise each layer in the backward pass.

        Returns:
          ``(h, new_state)``, as :func:`run_stack`.
        """
        h, new_state = scan_layers(layer_fn, params, state, x, offset=0, row=0, remat=remat)
        # What the layers sowed: one micro-batch, the whole input.
        sown = {c: jax.tree.map(lambda a: a[:, None], v) for c, v in new_state.items() if c not in state}
        return h, {**new_state, **sown}


SEQUENTIAL = Schedule()

#: The stage axis while a pipeline's loop runs a stack's layers (None elsewhere): the devices along it then hold
#: different micro-batches and layers, so a layer's statistics are over the other axes only (one micro-batch).
PIPELINED: contextvars.ContextVar[str | None] = contextvars.ContextVar("spmdcomm_pipelined", default=None)

_ACTIVE: contextvars.ContextVar[Schedule] = contextvars.ContextVar("spmdcomm_schedule", default=SEQUENTIAL)


def active_schedule() -> Schedule:
    """The schedule of the step being traced (:data:`SEQUENTIAL` outside a step)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def schedule_context(schedule: Schedule | None) -> Iterator[None]:
    """Within the block, layer stacks run as ``schedule`` says (``None``: sequentially)."""
    token = _ACTIVE.set(SEQUENTIAL if schedule is None else schedule)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def run_stack(
    layer_fn: LayerFn, params: Any, x: jax.Array, *, state: Any = None, remat: bool = True
) -> tuple[jax.Array, Any]:
    """Applies a stack of layers to ``x``: ``layer_fn(layer_params, layer_state, h, index, row) -> (h, layer_state)``.

    ``params`` and ``state`` are trees whose leaves have the layers on dimension 0: ``params`` the trained ones,
    ``state`` the mutable ones (BatchNorm's running statistics; ``None``: none), always all ``L`` layers in canonical
    order. ``index`` is the layer's canonical index and ``row`` the position of ``h``'s first row relative to ``x``'s
    first row on this device (0 in a scan; in a pipeline the micro-batch may hold another stage's rows): with
    :func:`spmdcomm.parallel.rng.sub_block_key` they give every example and layer its own random bits, whatever the
    split.

    The active schedule runs the stack (:meth:`Schedule.stack`): a plain ``lax.scan`` over all layers (``remat``:
    each layer rematerialised in the backward pass) outside a step and in a sequential step; in the steps of a state
    with a :class:`~spmdcomm.Pipeline`, ``params`` holds this stage's layers and the stack runs as a pipeline
    (:mod:`spmdcomm.parallel.pipeline`), a layer's state updated once per micro-batch, in order, never in a bubble, and
    whole on every stage device after it.

    Returns:
      ``(h, new_state)``: the last layer's output and the layers' state after it (``{}`` for ``state=None``), with
      each collection the layers sowed, ``[L, m, ...]``: per layer and per micro-batch (:data:`LayerFn`).
    """
    return active_schedule().stack(layer_fn, params, {} if state is None else state, x, remat=remat)


def scan_layers(
    layer_fn: LayerFn, params: Any, state: Any, x: jax.Array, *, offset: Any, row: Any, remat: bool
) -> tuple[jax.Array, Any]:
    """A ``lax.scan`` of ``layer_fn`` over the layers on dimension 0 of ``params`` and ``state``, the first of them
    layer ``offset`` of the stack, ``x``'s rows beginning at ``row``."""

    def one(h: jax.Array, inputs: Any) -> tuple[jax.Array, Any]:
        layer, layer_state, index = inputs
        return layer_fn(layer, layer_state, h, index, row)

    body = jax.checkpoint(one) if remat else one
    count = jax.tree.leaves(params)[0].shape[0]
    return lax.scan(body, x, (params, state, offset + jnp.arange(count)))


def check_model_state(old: Any, new: Any) -> None:
    """Raises :class:`SpmdError` unless the model state ``new`` the loss returned has ``old``'s tree, shapes and
    dtypes: every schedule threads it from one micro-batch to the next."""
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
