"""A data-parallel evaluation step: exact means over the real examples (or tokens) of the global batch."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from spmdcomm._jax_compat import vary
from spmdcomm.data.placement import HostInput, check_host_input
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.data.strategy import ReduceContext
from spmdcomm.parallel.real_rows import rows_of
from spmdcomm.train._micro import full_mask
from spmdcomm.train._model_call import call_model_fn
from spmdcomm.train._step import (
    DEFAULT_MAX_IN_FLIGHT,
    StepCache,
    Window,
    check_in_flight,
    check_scalars,
    check_step_backend,
    compile_local_step,
    dispatch,
    place_batch,
    sum_dtype,
    summable,
    zero_masked_rows,
)
from spmdcomm.train.state import TrainState
from spmdcomm.train.weighted import Weighted

__all__ = ["EvalStep", "evaluate", "make_eval_step"]


def make_eval_step(
    metric_fn: Callable[..., Any],
    *,
    backend: Literal["shard_map"] = "shard_map",
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    host_input: HostInput = "local",
) -> EvalStep:
    """Returns ``evaluate(state, batch) -> metrics``: exact means over the real examples of the global batch.

    It runs on the state's mesh and data axis. A mean metric is weighted by the block's real-example count, so
    padded rows of a :class:`~spmdcomm.MaskedBatch` never count; a :func:`~spmdcomm.weighted` metric carries its
    own weight, and the step reports ``sum(total) / sum(weight)`` over the global batch (e.g. a mean over real
    tokens).

    Args:
      metric_fn: ``metric_fn(params, batch, *, apply_fn, model_state, mask)`` returns a dict of scalars, each a
        mean over the real examples of this device's block or a :func:`~spmdcomm.weighted` ``(total, weight)``
        over its tokens (or one such scalar, reported as ``"loss"``).
      backend: ``"shard_map"``, the one backend, as in :func:`~spmdcomm.make_train_step`.
      max_in_flight: as in :func:`~spmdcomm.make_train_step`.
      host_input: as in :func:`~spmdcomm.make_train_step`.

    Returns:
      The :class:`~spmdcomm.train.EvalStep` ``evaluate``; ``evaluate(state, batch)`` returns a dict of scalar
      arrays: ``metric_fn``'s means over the real examples of the global batch (a weighted metric's over its
      weight), ``"examples"``, the number of real examples, and, when the ``"loss"`` is weighted, ``"tokens"``,
      its weight summed over the global batch.

    Raises:
      BackendError: when ``backend`` is not ``"shard_map"`` (``"pmap"`` names its retirement).
      SpmdError: when ``max_in_flight`` is not an int in 1..16 or ``host_input`` not one of its values.

    Examples:
      >>> import optax
      >>> state = sc.TrainState.create(params={"w": np.float32(2.0)}, tx=optax.sgd(0.1))
      >>> def metric_fn(params, batch, *, apply_fn, model_state, mask):
      ...     return {"mean_pred": sc.masked_mean(batch * params["w"], mask)}
      >>> evaluate = sc.make_eval_step(metric_fn)
      >>> float(evaluate(state, sc.pad_batch(np.arange(5.0, dtype=np.float32), 8))["mean_pred"])
      4.0
    """
    check_step_backend("make_eval_step", backend)
    return EvalStep(
        metric_fn,
        max_in_flight=check_in_flight("make_eval_step", max_in_flight),
        host_input=check_host_input("make_eval_step", host_input),
    )


def evaluate(eval_step: EvalStep, state: TrainState, batches: Iterable[Any]) -> dict[str, float]:
    """Exact means of ``eval_step``'s metrics over every real example of ``batches`` (an evaluation set).

    Each batch's mean metrics are weighted by its real-example count (``metrics["examples"]``), and each
    :func:`~spmdcomm.weighted` metric by its own global weight in that batch, so a padded last batch
    (:func:`~spmdcomm.pad_batch`, a :class:`~spmdcomm.Loader` over the eval set) counts only its real rows (and
    tokens), and the result equals the metrics of one batch holding the whole set. A metric whose weight over the
    whole set is 0 is reported as 0.0. The sums are taken on the host in float64, one
    in-flight window behind the devices. Every process passes its own batches (as to the eval step); the result is
    the same on all.

    Args:
      eval_step: a step made by :func:`~spmdcomm.make_eval_step`.
      state: the :class:`~spmdcomm.TrainState` to evaluate.
      batches: an iterable of batches, each as the eval step takes it.

    Returns:
      A dict of Python floats: each metric's mean over the real examples (a weighted metric's mean over its
      weight: ``sum(total) / sum(weight)`` over the set, a mean, not a sum), ``"examples"``, the number of real
      examples seen, and, when ``metric_fn``'s ``"loss"`` is weighted, ``"tokens"``, its weight summed over the
      set.

    Raises:
      SpmdError: when ``eval_step`` is not an evaluation step.

    Examples:
      >>> import optax
      >>> state = sc.TrainState.create(params={"w": np.float32(1.0)}, tx=optax.sgd(0.1))
      >>> mean_x = sc.make_eval_step(lambda p, b, *, apply_fn, model_state, mask: sc.masked_mean(b * p["w"], mask))
      >>> data = np.arange(10.0, dtype=np.float32)
      >>> sc.evaluate(mean_x, state, [sc.pad_batch(data[:8], 8), sc.pad_batch(data[8:], 8)])
      {'loss': 4.5, 'examples': 10.0}

      A token-weighted loss is the mean over the set's weight (here its 10 real tokens), with ``"tokens"``:

      >>> token_mean = sc.make_eval_step(
      ...     lambda p, b, *, apply_fn, model_state, mask: sc.weighted(jnp.sum(b["x"] * b["w"]), jnp.sum(b["w"]))
      ... )
      >>> x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
      >>> w = (x < 5).astype(np.float32)  # 5 real tokens per batch
      >>> sc.evaluate(token_mean, state, [{"x": x, "w": w}, {"x": x + 1, "w": w}])
      {'loss': 2.5, 'examples': 16.0, 'tokens': 10.0}
    """
    if not isinstance(eval_step, EvalStep):
        raise SpmdError(
            describe(
                "evaluate",
                f"eval_step is a {type(eval_step).__name__}, not an evaluation step.",
                fix="pass sc.make_eval_step(metric_fn).",
            )
        )
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}  # each metric's weight: real examples for a mean, its own for sc.weighted
    seen: dict[str, float] = {}  # "examples", and "tokens" when metric_fn's loss is token-weighted
    pending: collections.deque[Any] = collections.deque()

    def add(keep: int) -> None:
        while len(pending) > keep:
            metrics, own = jax.tree.map(float, jax.device_get(pending.popleft()))
            counts = {k: metrics.pop(k) for k in ("examples", "tokens") if k in metrics}
            for k, v in counts.items():
                seen[k] = seen.get(k, 0.0) + v
            for k, v in metrics.items():
                w = own.get(k, counts["examples"])
                sums[k] = sums.get(k, 0.0) + (w * v if w else 0.0)
                weights[k] = weights.get(k, 0.0) + w

    for batch in batches:
        pending.append(eval_step.weighed(state, batch))
        add(eval_step.max_in_flight)
    add(0)
    means = {k: v / weights[k] if weights[k] else 0.0 for k, v in sums.items()}
    return {**means, **seen}


class EvalStep:
    """An evaluation step, made by :func:`make_eval_step`.

    Annotate with ``spmdcomm.train.EvalStep`` (not an ``sc`` name). Call it as ``evaluate(state, batch)``; it
    compiles once per state structure (mesh, strategy, shapes).

    Args:
      metric_fn: the user's metric function, as :func:`make_eval_step` describes it.
      max_in_flight: how many calls back a call waits for before dispatching (checked, 1..16).
      host_input: what a host (NumPy) batch means with several processes, ``"local"`` or ``"global"``.
    """

    def __init__(self, metric_fn: Callable[..., Any], *, max_in_flight: int, host_input: HostInput):
        self.metric_fn = metric_fn
        self.host_input = host_input
        self.max_in_flight = max_in_flight
        self._window = Window(max_in_flight)
        self._cache = StepCache("make_eval_step", self._compile)

    def __call__(self, state: TrainState, batch: Any) -> dict[str, jax.Array]:
        """Evaluates ``metric_fn`` on ``batch``: see :func:`make_eval_step`.

        Args:
          state: the :class:`~spmdcomm.TrainState`, on the mesh it was created on (not consumed).
          batch: a pytree of arrays whose dimension 0 is the global batch, or a :class:`~spmdcomm.MaskedBatch`.

        Returns:
          The metrics, as :func:`make_eval_step` returns them: means over the batch's real examples (a weighted
          metric's over its weight), ``"examples"``, their number, and ``"tokens"`` with a weighted ``"loss"``.

        Raises:
          SpmdError: when ``state`` is not a :class:`~spmdcomm.TrainState` or lives on other devices than its mesh.
          DeletedArrayError: when ``state`` was consumed by a donating train step.
          ShapeError: when the batch's rows do not split evenly over the data devices, or ``metric_fn`` returns a
            non-scalar metric.
          AxisError: when ``metric_fn`` runs a collective over an axis the step does not run over.
        """
        return self.weighed(state, batch)[0]

    def weighed(self, state: TrainState, batch: Any) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """Evaluates ``metric_fn`` on ``batch``, with the weight of each token-weighted metric.

        Args:
          state: as for a call.
          batch: as for a call.

        Returns:
          ``(metrics, weights)``: the metrics of a call, and the global weight of each metric ``metric_fn``
          returned as :func:`~spmdcomm.weighted` (a mean's weight is ``metrics["examples"]``), which
          :func:`evaluate` sums over batches.
        """
        program = self._cache.program(state)
        self._window.wait_for_room()
        metrics, weights = dispatch(
            "make_eval_step", program, state, place_batch("make_eval_step", batch, state, 1, self.host_input)
        )
        self._window.add(metrics["examples"])
        return metrics, weights

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """Lowers the evaluation for these inputs (``.compile().as_text()`` shows the HLO XLA runs).

        Args:
          state: the :class:`~spmdcomm.TrainState`, as for a call.
          batch: a batch as for a call (placed, not run).

        Returns:
          The ``jax.stages.Lowered`` evaluation program for these inputs.
        """
        return self._cache.program(state).lower(state, *place_batch("make_eval_step", batch, state, 1, self.host_input))

    def _compile(self, state: TrainState) -> jax.stages.Wrapped:
        axis, strategy = state.data_axes, state.strategy
        ctx = ReduceContext(axis, state.data_size, None, False)

        def body(state: TrainState, data: Any, mask: Any) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
            data = data if mask is None else zero_masked_rows(data, mask)
            given, mask = mask, full_mask(data, state.roles.batch) if mask is None else mask
            params = strategy.compute_params(ctx, state.layout, state.params)
            with rows_of(given):  # layers that couple the rows (a mixture of experts) leave the padding out too
                out = call_model_fn(
                    "make_eval_step",
                    "metric_fn",
                    state,
                    self.metric_fn,
                    params,
                    data,
                    apply_fn=state.apply_fn,
                    model_state=state.model_state,
                    mask=mask,
                )
            metrics = out if isinstance(out, dict) else {"loss": out}
            check_scalars("make_eval_step", metrics, "metric_fn")
            # Typed varying over every manual axis: the mask is per row, the same on every context device.
            count = vary(jnp.sum(mask, dtype=jnp.float32), state.roles.manual)
            # A mean weighs by the block's real examples; a token-weighted value carries its own weight.
            weigh = lambda v: jnp.where(count > 0, count * v.astype(sum_dtype(v.dtype)), 0.0)
            sums = {k: summable(v) if isinstance(v, Weighted) else weigh(v) for k, v in metrics.items()}
            total, sums = lax.psum(vary((count, sums), state.roles.manual), state.roles.manual)
            # Every device of a token axis (the context axis) counted its rows (holding other tokens of them).
            examples = total / state.roles.size(state.roles.tokens)
            means = {k: v.mean() if isinstance(v, Weighted) else v / jnp.maximum(total, 1.0) for k, v in sums.items()}
            weights = {k: v.weight for k, v in sums.items() if isinstance(v, Weighted)}
            tokens = {"tokens": weights["loss"]} if "loss" in weights else {}
            return {**means, "examples": examples, **tokens}, weights

        return compile_local_step(body, state, P())
