"""A DDP-style data-parallel train step for Flax and optax.

N devices (in one process or many) train exactly the model that one device trains on the global
batch: every device runs ``loss_fn`` on its block of the batch, the gradients are summed over the
data axis with weights ``real examples on this device / real examples on all devices`` (a token-weighted loss:
``1 / global weight``) by the state's strategy (:mod:`spmdcomm.parallel.data.strategies`), and every replica
applies the same optax update.

The ``loss_fn`` contract (keyword arguments after the first two)::

    loss_fn(params, batch, *, apply_fn, model_state, rng, mask) -> loss | (loss, aux)

* ``batch`` is this device's block (or micro-batch) of the global batch; ``mask`` is a bool
  vector of its length marking the real examples (all True unless the step got a
  :class:`~spmdcomm.MaskedBatch`).
* ``loss`` is either a float scalar, the MEAN over the block's real examples (:func:`~spmdcomm.masked_mean`
  helps), which the step weighs by the block's real-example count; or a token-weighted
  :func:`~spmdcomm.weighted` ``(total, weight)``, a SUM over the block's tokens and its weight, which the step
  divides by the weight summed over the whole global batch. Either way the result is the exact global mean
  (per example, or per unit of weight), padding excluded.
* ``aux`` is a dict of scalar metrics (each a mean over the block's real examples or a
  :func:`~spmdcomm.weighted`, averaged by its own rule) and, under the key ``"model_state"``, the new mutable
  model state (e.g. Flax ``batch_stats``), which the step averages over the data axis. Names the step reports
  itself are refused with :class:`~spmdcomm.errors.SpmdError`: ``"loss"``, ``"examples"``, ``"tokens"`` (with a
  token-weighted loss), ``"skipped"`` (with ``skip_nonfinite`` or a loss scale), ``"loss_scale"`` (with a loss
  scale) and the optimizer's hyperparameters.
* ``step``: if ``loss_fn`` names a keyword parameter ``step``, it also gets the state's step count
  before this update (an int32 scalar), e.g. for a schedule inside the loss.
* With ``TrainState.create(..., loss_scale="dynamic")`` the step multiplies the loss by the state's scale before
  differentiating and divides the reduced gradients by it (float16 training, :mod:`spmdcomm.train.loss_scale`):
  ``loss_fn`` returns the plain loss.
* ``rng`` depends on ``make_train_step(..., rng=...)``. ``"per_device"`` (default): a raw
  ``uint32[2]`` threefry key, ``fold_in(fold_in(fold_in(state.rng, step), device), micro_batch)``,
  different per step, device and micro-batch (the bits an example sees depend on the device count,
  as with torch DDP). ``"per_example"``: a typed key (:func:`spmdcomm.parallel.rng.per_example_key`) whose
  draws give each example bits that depend only on ``state.rng``, the step and the example's global
  index in the batch, so results do not depend on the device count or ``accum_steps``; every draw
  from it must have the block's examples in dimension 0 (other shapes raise ``ShapeError`` when the
  step compiles). Use it as any key (``fold_in``, ``split``, Flax ``rngs={"dropout": rng}``).

>>> import optax
>>> def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
...     err = (batch["x"] @ params["w"] - batch["y"]) ** 2
...     return sc.masked_mean(err, mask)
>>> state = sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.25))
>>> step = sc.make_train_step(loss_fn)
>>> batch = {"x": np.ones((16, 2), np.float32), "y": np.ones(16, np.float32)}
>>> state, metrics = step(state, batch)
>>> float(metrics["loss"]), state.params["w"].tolist(), int(state.step)
(1.0, [0.5, 0.5], 1)

Inside ``shard_map`` (``check_vma=True``) ``jax.grad`` with respect to replicated parameters returns
the gradient already summed over the axis. The step avoids that trap by marking the parameters as
varying before differentiating, so each device gets its own local gradient, which the strategy then
reduces exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from spmdcomm.data.placement import HostInput, check_host_input
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.rng import RNG_MODES
from spmdcomm.train._micro import StepOptions
from spmdcomm.train._step import (
    DEFAULT_MAX_IN_FLIGHT,  # re-exported: the public home of the default window
    StepCache,
    Window,
    check_in_flight,
    check_step_backend,
    dispatch,
    place_batch,
)
from spmdcomm.train._train_body import compile_train_step
from spmdcomm.train.state import TrainState

__all__ = ["TrainStep", "make_train_step", "masked_mean"]


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    backend: Literal["shard_map"] = "shard_map",
    accum_steps: int = 1,
    reduce_dtype: Any = None,
    skip_nonfinite: bool = False,
    donate: bool = True,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    rng: Literal["per_device", "per_example"] = "per_device",
    host_input: HostInput = "local",
) -> TrainStep:
    """Returns ``step(state, batch) -> (state, metrics)``: one data-parallel optimizer step.

    The mesh, the data axis and the strategy (DDP, buckets, ZeRO-1) are the state's: see
    :meth:`TrainState.create <spmdcomm.TrainState.create>`. ``state`` must still live where ``TrainState.create``
    put it (a state moved to other devices raises :class:`SpmdError` naming both meshes). Float64 model state and
    metrics (``jax_enable_x64``) are averaged in float64; narrower floats in float32, cast back.

    ``batch`` is a pytree of arrays whose dimension 0 is the global batch (host NumPy, placed by the step; or
    ``jax.Array``), or a :class:`~spmdcomm.MaskedBatch`, whose masked-out rows reach ``loss_fn`` as zeros (a NaN
    there changes nothing).

    Args:
      loss_fn: see the module docstring for the contract.
      backend: ``"shard_map"``, the one backend (the step is ``jax.jit`` over ``jax.shard_map``); kept so that
        code passing it runs. The pmap step backend was retired: since JAX 0.10 ``jax.pmap`` is
        ``jax.jit(jax.shard_map(...))``, and the collectives still run inside a ``jax.pmap`` of your own.
      accum_steps: split each device's block into this many micro-batches, run them in a
        ``lax.scan`` and reduce the summed gradient ONCE at the end (torch ``no_sync``); one
        optimizer step per call.
      reduce_dtype: e.g. ``jnp.bfloat16``: gradients are cast to it for the reduction and back after.
      skip_nonfinite: if any gradient entry on any replica is NaN/Inf, every replica keeps its
        parameters, optimizer and model state (``metrics["skipped"]`` is 1.0 for that step).
      donate: ``True`` (default): the new state reuses the input state's buffers, so the state
        passed in is consumed; passing it again (to a step, an eval step or ``save_checkpoint``)
        raises :class:`~spmdcomm.errors.DeletedArrayError`. ``False`` keeps the old state usable
        (or copy it first: ``jax.tree.map(jnp.copy, state)``).
      max_in_flight: before dispatching, wait for the result from this many calls back (1..16).
        XLA:CPU allows about 32 queued executions containing collectives per device; more stall
        and abort the process after about 40 s (SIGABRT, not a Python exception). A step compiled
        by hand with ``step.lower(state, batch).compile()`` bypasses this window (and the state
        checks): a loop over it must wait on earlier results itself.
      rng: the key ``loss_fn`` gets. ``"per_device"`` (default): a raw ``uint32[2]`` key that
        differs on every device and micro-batch (like torch DDP's per-rank generators; the bits an
        example sees depend on the device count). ``"per_example"``: a
        :func:`~spmdcomm.parallel.rng.per_example_key` whose draws give each example bits that depend only
        on the seed, the step and its global index in the batch, so training does not depend on the
        device count or ``accum_steps``; every draw must have the block's examples in dimension 0.
      host_input: what a host (NumPy) batch means with several processes: ``"local"`` (default) this
        process's rows, ``"global"`` the whole global batch, passed by every process (see
        :mod:`spmdcomm.data.placement`).

    Returns:
      The :class:`~spmdcomm.train.TrainStep` ``step``; ``step(state, batch)`` returns the new state and
      ``metrics``, a dict of scalar arrays: the loss and ``aux`` metrics (means over the real examples of the
      global batch; a :func:`~spmdcomm.weighted` one, its global ``sum(total) / sum(weight)``), ``"examples"``
      (real examples in the global batch), with a token-weighted loss ``"tokens"`` (the loss's weight summed over
      the global batch), with ``skip_nonfinite`` or a loss scale
      ``"skipped"`` (1.0 for a skipped step), with a loss scale ``"loss_scale"`` (the scale this step used), and
      the scalar hyperparameters of any ``optax.inject_hyperparams`` in ``tx`` as this step used them (e.g.
      ``"learning_rate"``).

    Raises:
      BackendError: when ``backend`` is not ``"shard_map"`` (``"pmap"`` names its retirement).
      SpmdError: when ``accum_steps`` is not a positive int, ``max_in_flight`` not an int in 1..16, or ``rng``
        or ``host_input`` not one of their values.
    """
    check_step_backend("make_train_step", backend)
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, (int, np.integer)) or accum_steps < 1:
        raise SpmdError(
            describe(
                "make_train_step",
                f"accum_steps={accum_steps!r} must be a positive int.",
                fix="pass 1 (no accumulation) or the number of micro-batches.",
            )
        )
    if rng not in RNG_MODES:
        raise SpmdError(
            describe(
                "make_train_step",
                f"rng={rng!r} is not one of {RNG_MODES}.",
                fix='pass rng="per_device" (default) or rng="per_example" (device-count independent).',
            )
        )
    options = StepOptions(
        loss_fn=loss_fn,
        accum_steps=int(accum_steps),
        reduce_dtype=None if reduce_dtype is None else jnp.dtype(reduce_dtype),
        skip_nonfinite=skip_nonfinite,
        donate=donate,
        rng=rng,
        host_input=check_host_input("make_train_step", host_input),
    )
    return TrainStep(options, check_in_flight("make_train_step", max_in_flight))


class TrainStep:
    """A data-parallel train step, made by :func:`make_train_step`.

    Annotate with ``spmdcomm.train.TrainStep`` (not an ``sc`` name). Call it as ``step(state, batch)``; it compiles
    once per state structure (mesh, strategy, shapes).

    Args:
      options: the step's checked options, as :func:`make_train_step` builds them.
      max_in_flight: how many calls back a call waits for before dispatching (checked, 1..16).
    """

    def __init__(self, options: StepOptions, max_in_flight: int):
        self.options = options
        self.max_in_flight = max_in_flight
        self._window = Window(max_in_flight)
        self._cache = StepCache("make_train_step", lambda state: compile_train_step(options, state))

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """Runs one optimizer step on ``batch``: see :func:`make_train_step`.

        Args:
          state: the :class:`~spmdcomm.TrainState`, on the mesh it was created on (consumed when the step
            donates).
          batch: a pytree of arrays whose dimension 0 is the global batch, or a :class:`~spmdcomm.MaskedBatch`.

        Returns:
          ``(new_state, metrics)``, the metrics as :func:`make_train_step` lists them.

        Raises:
          SpmdError: when ``state`` is not a :class:`~spmdcomm.TrainState` or lives on other devices than its mesh.
          DeletedArrayError: when ``state`` was consumed by an earlier donating step.
          ShapeError: when the batch's rows do not split evenly over the data devices (times ``accum_steps``), or
            ``loss_fn`` returns a non-scalar loss or metric.
          AxisError: when ``loss_fn`` runs a collective over an axis the step does not run over.
        """
        program = self._cache.program(state)
        self._window.wait_for_room()
        placed = place_batch("make_train_step", batch, state, self.options.accum_steps, self.options.host_input)
        new_state, metrics = dispatch("make_train_step", program, state, placed)
        self._window.add(metrics["examples"])
        return new_state, metrics

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """Lowers the step for these inputs (``.compile().as_text()`` shows the HLO XLA runs).

        A step compiled by hand with ``step.lower(state, batch).compile()`` bypasses the in-flight window and the
        state checks.

        Args:
          state: the :class:`~spmdcomm.TrainState`, as for a call.
          batch: a batch as for a call (placed, not run).

        Returns:
          The ``jax.stages.Lowered`` step program for these inputs.
        """
        placed = place_batch("make_train_step", batch, state, self.options.accum_steps, self.options.host_input)
        return self._cache.program(state).lower(state, *placed)


def masked_mean(values: Any, mask: Any) -> jax.Array:
    """Mean of ``values`` over the rows where ``mask`` is True (0.0 when there are none).

    Masked-out rows never reach the result or its gradient, even when they hold NaN or Inf. (A value computed
    from a NaN input still has a NaN gradient path upstream; the train and eval steps therefore
    zero the masked-out rows of the batch before calling ``loss_fn``.)

    Args:
      values: an array with ``mask``'s length in dimension 0; extra dimensions are averaged too.
      mask: a bool vector (or one convertible to bool) marking the rows that count.

    Returns:
      A scalar: the mean over every entry of the kept rows.

    Examples:
      >>> float(sc.masked_mean(jnp.array([1.0, 2.0, 9.0]), jnp.array([True, True, False])))
      1.5
    """
    values = jnp.asarray(values)
    mask = jnp.asarray(mask, dtype=bool)
    # Select, never multiply: NaN * 0 is NaN. The select also zeroes the gradient of masked-out rows
    # exactly (its cotangent there is a literal 0, whatever the value was).
    kept = jnp.where(mask.reshape(mask.shape + (1,) * (values.ndim - 1)), values, jnp.zeros_like(values))
    per_row = math.prod(values.shape[1:])
    return jnp.sum(kept) / jnp.maximum(jnp.sum(mask) * per_row, 1)
