"""A DDP-style data-parallel train step for Flax and optax.

N devices (in one process or many) train exactly the model that one device trains on the global
batch: every device runs ``loss_fn`` on its block of the batch, the gradients are averaged over the
data axis with weights ``real examples on this device / real examples on all devices``, and every
replica applies the same optax update.

The ``loss_fn`` contract (keyword arguments after the first two)::

    loss_fn(params, batch, *, apply_fn, model_state, rng, mask) -> loss | (loss, aux)

* ``batch`` is this device's block (or micro-batch) of the global batch; ``mask`` is a bool
  vector of its length marking the real examples (all True unless the step got a
  :class:`~spmdcomm.MaskedBatch`).
* ``loss`` is a float scalar: the MEAN over the block's real examples (:func:`masked_mean` helps).
  The step weighs it by the block's real-example count, so the result is the exact global mean,
  padding excluded.
* ``aux`` is a dict of scalar metrics (means over the block's real examples, averaged like the
  loss) and, under the key ``"model_state"``, the new mutable model state (e.g. Flax
  ``batch_stats``), which the step averages over the data axis.
* ``rng`` depends on ``make_train_step(..., rng=...)``. ``"per_device"`` (default): a raw
  ``uint32[2]`` threefry key, ``fold_in(fold_in(fold_in(state.rng, step), device), micro_batch)``,
  different per step, device and micro-batch (the bits an example sees depend on the device count,
  as with torch DDP). ``"per_example"``: a typed key (:func:`spmdcomm.rng.per_example_key`) whose
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
varying before differentiating, so each device gets its own local gradient, which the step then
reduces exactly once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._jax_compat import varying_axes
from spmdcomm.collectives import all_gather, reduce_scatter
from spmdcomm.data import MaskedBatch, leading_size
from spmdcomm.errors import ShapeError, SpmdError, check_not_deleted, describe
from spmdcomm.mesh import check_mesh_axes, default_mesh
from spmdcomm.rng import (
    RNG_MODES,
    data_to_keys,
    is_key_leaf,
    is_per_example_key,
    keys_to_data,
    per_example_key,
    stream_key_for_call,
)
from spmdcomm.spmd import SpmdFunction, check_backend

__all__ = [
    "TrainState",
    "TrainStep",
    "EvalStep",
    "make_train_step",
    "make_eval_step",
    "fit",
    "masked_mean",
    "nnx_loss_fn",
    "nnx_metric_fn",
    "optimizer_state_bytes",
    "DEFAULT_MAX_IN_FLIGHT",
]

#: How many calls back a train/eval step waits for before dispatching another. XLA:CPU allows about 32
#: queued executions containing collectives per device; beyond that the collectives stall and XLA
#: aborts the whole process after about 40 s (SIGABRT, no Python exception). The window lives in the
#: step object: a step compiled by hand (``step.lower(...).compile()``) bypasses it.
DEFAULT_MAX_IN_FLIGHT = 8
_ONE_BUFFER = 2**40  # a bucket size no model reaches: one flat all-reduce buffer per dtype
_MAX_IN_FLIGHT_LIMIT = 16


@flax.struct.dataclass
class TrainState:
    """Everything one training step reads and writes, replicated on the mesh (a pytree).

    ``step`` counts global steps, ``params`` are the trained parameters, ``opt_state`` the optax
    state, ``model_state`` the mutable model state (Flax ``batch_stats``, NNX ``BatchStat``,
    NNX RNG stream keys and counts ...; ``{}`` when none) and ``rng`` a raw ``uint32[2]`` base key. ``apply_fn`` (a Flax
    ``Module.apply``, an NNX ``GraphDef`` or any callable handed to ``loss_fn``) and ``tx`` are
    static. With ``shard_optimizer=True`` at creation, ``opt_state`` holds flat optimizer-state
    vectors split across the data axis (ZeRO-1) and ``zero`` describes that layout.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    apply_fn: Any = flax.struct.field(pytree_node=False, default=None)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False, default=None)
    zero: _ZeroLayout | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        tx: optax.GradientTransformation,
        apply_fn: Any = None,
        model_state: Any = None,
        rng: Any = None,
        mesh: Mesh | None = None,
        axis: str = "data",
        shard_optimizer: bool = False,
        verify: bool = True,
    ) -> TrainState:
        """Builds the state and places it replicated on ``mesh`` (ZeRO-1 optimizer state split over
        ``axis``).

        With several processes, process 0's ``params``, ``model_state`` and ``rng`` are broadcast so
        every replica starts identical (DDP's init-time broadcast); ``verify`` first checks that
        every process passed the same tree structure, shapes and dtypes and raises naming the
        process that differs. ``rng`` is an int seed, a key, or ``None`` (seed 0). Typed key
        leaves (``jax.random.key``, NNX ``RngKey``) stay typed keys; they travel as their key data.

        >>> import optax
        >>> s = sc.TrainState.create(params={"w": np.ones(3, np.float32)}, tx=optax.adam(1e-3))
        >>> int(s.step), s.params["w"].sharding.is_fully_replicated
        (0, True)
        """
        mesh = default_mesh() if mesh is None else mesh
        check_mesh_axes("TrainState.create", mesh, axis)
        model_state = {} if model_state is None else model_state
        rng = _raw_key(rng)
        # Typed key leaves (Flax NNX RngKey) cross the host as their uint32 key data: NumPy and the
        # multi-process broadcast only move plain arrays.
        host, key_impls = keys_to_data((params, model_state, rng))
        if jax.process_count() > 1:
            if verify:
                _check_same_structure_across_processes("TrainState.create", host)
            host = multihost_utils.broadcast_one_to_all(host)
        params, model_state, rng = data_to_keys(_place_replicated(host, mesh), key_impls)
        zero = _ZeroLayout.build(params, tx, axis, mesh.shape[axis]) if shard_optimizer else None
        opt_state = _init_opt_state(tx, params, zero, mesh)
        step = jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, P()))
        return cls(
            step=step,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            apply_fn=apply_fn,
            tx=tx,
            zero=zero,
        )

    @classmethod
    def create_nnx(cls, model: Any, *, tx: optax.GradientTransformation, **kwargs: Any) -> TrainState:
        """Builds the state of a Flax NNX ``model``: ``nnx.split`` into graph, ``nnx.Param`` and the
        rest.

        ``apply_fn`` becomes the ``GraphDef``, ``model_state`` every non-``Param`` variable (e.g.
        ``BatchStat``, and the ``RngKey``/``RngCount`` of ``nnx.Rngs`` streams such as
        ``nnx.Dropout(rate, rngs=rngs)``'s). Pair it with :func:`nnx_loss_fn` and
        :func:`nnx_metric_fn`. ``kwargs`` go to :meth:`create`.

        >>> from flax import nnx
        >>> import optax
        >>> s = sc.TrainState.create_nnx(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx=optax.sgd(0.1))
        >>> sorted(s.params.keys())
        ['bias', 'kernel']
        """
        from flax import nnx

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return cls.create(params=params, tx=tx, apply_fn=graphdef, model_state=rest, **kwargs)


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh | None = None,
    axis: str = "data",
    backend: Literal["shard_map", "pmap"] = "shard_map",
    accum_steps: int = 1,
    reduce_dtype: Any = None,
    bucket_bytes: int | None = None,
    shard_optimizer: bool = False,
    skip_nonfinite: bool = False,
    donate: bool = True,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    rng: Literal["per_device", "per_example"] = "per_device",
) -> TrainStep:
    """Returns ``step(state, batch) -> (state, metrics)``: one data-parallel optimizer step.

    Args:
      loss_fn: see the module docstring for the contract.
      mesh, axis: where the batch is split (default: every device, axis ``"data"``).
      backend: ``"shard_map"`` or ``"pmap"``; both compute the same step.
      accum_steps: split each device's block into this many micro-batches, run them in a
        ``lax.scan`` and reduce the summed gradient ONCE at the end (torch ``no_sync``); one
        optimizer step per call.
      reduce_dtype: e.g. ``jnp.bfloat16``: gradients are cast to it for the all-reduce and back
        after.
      bucket_bytes: an int flattens the gradients into dtype-homogeneous buffers of at most that
        many bytes, one all-reduce buffer each (a huge value gives one flat buffer per dtype, and
        with the metrics riding in it, one buffer per step). ``None`` chooses: one flat buffer when
        the mesh spans several processes (each gloo/NCCL call has a fixed cost; measured 2x faster
        for a small CNN over gloo), leaf by leaf within one process (XLA fuses the leaves into one
        variadic all-reduce, and flattening costs more than it saves there).
      shard_optimizer: ZeRO-1: reduce-scatter the gradients, update this device's slice of the
        flat parameters and optimizer state, all-gather the parameters. The state must come from
        ``TrainState.create(..., shard_optimizer=True)``.
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
        :func:`~spmdcomm.rng.per_example_key` whose draws give each example bits that depend only
        on the seed, the step and its global index in the batch, so training does not depend on the
        device count or ``accum_steps``; every draw must have the block's examples in dimension 0.

    ``state`` must live on ``mesh`` (a state from another mesh raises :class:`SpmdError` naming
    both). Float64 model state and metrics (``jax_enable_x64``) are averaged in float64; narrower
    floats in float32, cast back.

    ``batch`` is a pytree of arrays whose dimension 0 is the global batch (host NumPy, placed by the
    step; or ``jax.Array``), or a :class:`~spmdcomm.MaskedBatch`, whose masked-out rows reach
    ``loss_fn`` as zeros (a NaN there changes nothing). With several processes, host
    arrays are this process's part. ``metrics`` holds the loss, ``aux`` metrics, ``"examples"``
    (real examples in the global batch) and, with ``skip_nonfinite``, ``"skipped"``; all are means
    over the real examples of the global batch.
    """
    mesh = _resolve_mesh("make_train_step", mesh, axis, backend)
    if not isinstance(accum_steps, (int, np.integer)) or accum_steps < 1:
        raise SpmdError(
            describe(
                "make_train_step",
                f"accum_steps={accum_steps!r} must be a positive int.",
                fix="pass 1 (no accumulation) or the number of micro-batches.",
            )
        )
    if bucket_bytes is not None and (not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1):
        raise SpmdError(
            describe(
                "make_train_step",
                f"bucket_bytes={bucket_bytes!r} must be a positive int.",
                fix="pass None (leaf by leaf) or a bucket size in bytes, e.g. 25 * 2**20.",
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
    if shard_optimizer and bucket_bytes is not None:
        raise SpmdError(
            describe(
                "make_train_step",
                "shard_optimizer=True already reduces one flat buffer per dtype; "
                "bucket_bytes cannot be combined with it.",
                fix="drop bucket_bytes.",
            )
        )
    options = _StepOptions(
        loss_fn=loss_fn,
        mesh=mesh,
        axis=axis,
        backend=backend,
        accum_steps=int(accum_steps),
        reduce_dtype=None if reduce_dtype is None else jnp.dtype(reduce_dtype),
        bucket_bytes=_default_buckets(mesh) if bucket_bytes is None and not shard_optimizer else bucket_bytes,
        shard_optimizer=shard_optimizer,
        skip_nonfinite=skip_nonfinite,
        donate=donate,
        rng=rng,
    )
    return TrainStep(options, _check_in_flight("make_train_step", max_in_flight))


def make_eval_step(
    metric_fn: Callable[..., Any],
    *,
    mesh: Mesh | None = None,
    axis: str = "data",
    backend: Literal["shard_map", "pmap"] = "shard_map",
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> EvalStep:
    """Returns ``evaluate(state, batch) -> metrics``: exact means over the real examples of the
    global batch.

    ``metric_fn(params, batch, *, apply_fn, model_state, mask)`` returns a dict of scalar means over
    the real examples of this device's block (or a scalar, reported as ``"loss"``). Each is weighted
    by the block's real-example count, so padded rows of a :class:`~spmdcomm.MaskedBatch` never
    count.

    >>> import optax
    >>> state = sc.TrainState.create(params={"w": np.float32(2.0)}, tx=optax.sgd(0.1))
    >>> def metric_fn(params, batch, *, apply_fn, model_state, mask):
    ...     return {"mean_pred": sc.masked_mean(batch * params["w"], mask)}
    >>> evaluate = sc.make_eval_step(metric_fn)
    >>> float(evaluate(state, sc.pad_batch(np.arange(5.0, dtype=np.float32), 8))["mean_pred"])
    4.0
    """
    mesh = _resolve_mesh("make_eval_step", mesh, axis, backend)
    return EvalStep(metric_fn, mesh, axis, backend, _check_in_flight("make_eval_step", max_in_flight))


def fit(
    step: TrainStep,
    state: TrainState,
    batches: Iterable[Any],
    *,
    callback: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Runs ``step`` over ``batches``; returns the final state and every step's metrics as Python
    floats.

    Metrics are fetched to the host one in-flight window late (the step's ``max_in_flight``), so the
    loop never stalls on the newest step and never queues more executions than XLA:CPU can hold.
    ``callback(step_index, metrics)`` sees each step's metrics in order.

    >>> import optax
    >>> def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    ...     return sc.masked_mean((batch - params["c"]) ** 2, mask)
    >>> state = sc.TrainState.create(params={"c": np.float32(0.0)}, tx=optax.sgd(0.25))
    >>> batches = [np.full(8, 4.0, np.float32)] * 20
    >>> state, history = sc.fit(sc.make_train_step(loss_fn), state, batches)
    >>> len(history), round(float(state.params["c"]), 4)
    (20, 4.0)
    """
    pending: collections.deque[tuple[int, Any]] = collections.deque()
    history: list[dict[str, float]] = []

    def drain(keep: int) -> None:
        while len(pending) > keep:
            i, metrics = pending.popleft()
            host = {k: float(v) for k, v in jax.device_get(metrics).items()}
            history.append(host)
            if callback is not None:
                callback(i, host)

    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        pending.append((i, metrics))
        drain(step.max_in_flight)
    drain(0)
    return state, history


def masked_mean(values: Any, mask: Any) -> jax.Array:
    """Mean of ``values`` over the rows where ``mask`` is True (0.0 when there are none).

    ``values`` has ``mask``'s length in dimension 0; extra dimensions are averaged too. Masked-out
    rows never reach the result or its gradient, even when they hold NaN or Inf. (A value computed
    from a NaN input still has a NaN gradient path upstream; the train and eval steps therefore
    zero the masked-out rows of the batch before calling ``loss_fn``.)

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


def nnx_loss_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts ``fn(model, batch, *, rng, mask) -> loss | (loss, metrics)`` on a Flax NNX model to
    the contract.

    The model is rebuilt with ``nnx.merge(apply_fn, params, model_state)``; variables the call
    changed (e.g. ``BatchStat``, ``RngCount``) come back as the new model state. Use with
    :meth:`TrainState.create_nnx`.

    RNG streams (``nnx.Rngs``, ``nnx.Dropout(rate, rngs=...)``): for the duration of the call,
    every stream's key is replaced by :func:`~spmdcomm.rng.stream_key_for_call` of its stored key and
    the step's ``rng``, so with the default per-device ``rng`` the dropout masks differ between
    devices, micro-batches and steps (like torch DDP's per-rank generators), and with
    ``rng="per_example"`` they depend only on the seed, the step and each example's global index.
    Afterwards the stored keys are put back and the counts keep their increments, so keys and
    counts stay identical on every replica. With ``rng="per_example"`` each call draws from count 0
    (the row offset already tells micro-batches apart), so the bits do not depend on
    ``accum_steps`` either. The model runs in whatever mode it was created in (``nnx.Dropout`` is
    active by default); :func:`nnx_metric_fn` switches to evaluation mode.

    >>> from flax import nnx
    >>> import optax
    >>> state = sc.TrainState.create_nnx(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx=optax.sgd(0.1))
    >>> def mse(model, batch, *, rng, mask):
    ...     return sc.masked_mean((model(batch["x"])[:, 0] - batch["y"]) ** 2, mask)
    >>> step = sc.make_train_step(sc.nnx_loss_fn(mse))
    >>> state, m = step(state, {"x": np.ones((8, 2), np.float32), "y": np.ones(8, np.float32)})
    >>> int(state.step)
    1
    """
    from flax import nnx

    def loss_fn(params: Any, batch: Any, *, apply_fn: Any, model_state: Any, rng: Any, mask: Any) -> Any:
        model = nnx.merge(apply_fn, params, model_state, copy=True)
        streams = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngStream)]
        stored = [(s.key.get_value(), s.count.get_value()) for s in streams]
        per_example = rng is not None and is_per_example_key(rng)
        if rng is not None:
            for s, (key, count) in zip(streams, stored, strict=True):
                s.key.set_value(stream_key_for_call(key, rng))
                if per_example:
                    s.count.set_value(jnp.zeros_like(count))
        loss, aux = _split_loss_output(fn(model, batch, rng=rng, mask=mask), "nnx_loss_fn")
        for s, (key, count) in zip(streams, stored, strict=True):
            s.key.set_value(key)
            if per_example:
                s.count.set_value(count + s.count.get_value())
        _, _, new_state = nnx.split(model, nnx.Param, ...)
        return loss, {**aux, "model_state": new_state}

    return loss_fn


def nnx_metric_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts ``fn(model, batch, *, mask) -> metrics dict | scalar`` on a Flax NNX model to the
    :func:`make_eval_step` contract.

    The model is rebuilt with ``nnx.merge(apply_fn, params, model_state)`` and switched to
    evaluation mode (``model.eval()``: ``nnx.Dropout`` off, ``nnx.BatchNorm`` on its running
    statistics); the state is not changed. Use with :meth:`TrainState.create_nnx`.

    >>> from flax import nnx
    >>> import optax
    >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.9, rngs=nnx.Rngs(1)))
    >>> state = sc.TrainState.create_nnx(model, tx=optax.sgd(0.1))
    >>> def mean_out(model, batch, *, mask):
    ...     return {"out": sc.masked_mean(model(batch).sum(-1), mask)}
    >>> evaluate = sc.make_eval_step(sc.nnx_metric_fn(mean_out))
    >>> x = np.ones((8, 2), np.float32)
    >>> model.eval()  # the same model without dropout, for comparison
    >>> bool(np.isclose(evaluate(state, x)["out"], model(x[:1]).sum()))
    True
    """
    from flax import nnx

    def metric_fn(params: Any, batch: Any, *, apply_fn: Any, model_state: Any, mask: Any) -> Any:
        model = nnx.merge(apply_fn, params, model_state, copy=True)
        model.eval()
        return fn(model, batch, mask=mask)

    return metric_fn


def optimizer_state_bytes(state: TrainState) -> int:
    """Bytes of ``state.opt_state`` held on one device (the largest, when devices differ).

    >>> import optax
    >>> s = sc.TrainState.create(params={"w": np.zeros(1000, np.float32)}, tx=optax.adam(1e-3))
    >>> sc.optimizer_state_bytes(s)  # two float32 moments of 1000 entries, and an int32 count
    8004
    """
    per_device: dict[Any, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(state.opt_state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values(), default=0)


class TrainStep:
    """A compiled data-parallel train step (see :func:`make_train_step`). Call it as ``step(state,
    batch)``."""

    def __init__(self, options: _StepOptions, max_in_flight: int):
        self.options = options
        self.max_in_flight = max_in_flight
        self._window: collections.deque[Any] = collections.deque()
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self._placements_ok: set[Any] = set()

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        fn = self._function(state)
        _wait_for_window(self._window, self.max_in_flight)
        new_state, metrics = _dispatch("make_train_step", fn, state, self.place(batch), self.options.mesh)
        self._window.append(metrics["examples"])
        return new_state, metrics

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """Lowers the step for these inputs (``.compile().as_text()`` shows the HLO XLA runs)."""
        return self._function(state).lower(state, *self.place(batch))

    def place(self, batch: Any) -> tuple[Any, Any]:
        """Splits ``batch`` across the data axis: returns ``(data, mask)`` global arrays (``mask``
        may be None)."""
        o = self.options
        return _place_batch("make_train_step", batch, o.mesh, o.axis, o.accum_steps)

    def _function(self, state: TrainState) -> Callable[..., Any]:
        if not isinstance(state, TrainState):
            raise SpmdError(
                describe(
                    "make_train_step",
                    f"state is a {type(state).__name__}, not a TrainState.",
                    fix="build it with spmdcomm.TrainState.create(...).",
                )
            )
        _check_zero_matches(self.options, state)
        treedef = _check_state("make_train_step", state, self.options.mesh, self._placements_ok)
        key = (treedef, self.options.backend)
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = _compile_train_step(self.options, state)
        return hit


class EvalStep:
    """A compiled evaluation step (see :func:`make_eval_step`). Call it as ``evaluate(state,
    batch)``."""

    def __init__(self, metric_fn: Callable[..., Any], mesh: Mesh, axis: str, backend: str, max_in_flight: int):
        self.metric_fn = metric_fn
        self.mesh = mesh
        self.axis = axis
        self.backend = backend
        self.max_in_flight = max_in_flight
        self._window: collections.deque[Any] = collections.deque()
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self._placements_ok: set[Any] = set()

    def __call__(self, state: TrainState, batch: Any) -> dict[str, jax.Array]:
        key = _check_state("make_eval_step", state, self.mesh, self._placements_ok)
        _wait_for_window(self._window, self.max_in_flight)
        batch = _place_batch("make_eval_step", batch, self.mesh, self.axis, 1)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._compile(state)
        metrics = _dispatch("make_eval_step", fn, state, batch, self.mesh)
        self._window.append(metrics["examples"])
        return metrics

    def _compile(self, state: TrainState) -> Callable[..., Any]:
        axis = self.axis

        def body(state: TrainState, data: Any, mask: Any) -> dict[str, jax.Array]:
            data = data if mask is None else _zero_masked_rows(data, mask)
            mask = _full_mask(data) if mask is None else mask
            out = self.metric_fn(
                state.params,
                data,
                apply_fn=state.apply_fn,
                model_state=state.model_state,
                mask=mask,
            )
            metrics = out if isinstance(out, dict) else {"loss": out}
            _check_scalars("make_eval_step", metrics, "metric_fn")
            count = jnp.sum(mask, dtype=jnp.float32)
            sums = {k: jnp.where(count > 0, count * v.astype(_sum_dtype(v.dtype)), 0.0) for k, v in metrics.items()}
            total, sums = lax.psum((count, sums), axis)
            return {**{k: v / jnp.maximum(total, 1.0) for k, v in sums.items()}, "examples": total}

        return _spmd_compile(body, self.mesh, self.axis, self.backend, _state_specs(state), P(), donate=False)


# --------------------------------------------------------------------------------------------------
# The step body


@dataclasses.dataclass(frozen=True)
class _StepOptions:
    loss_fn: Callable[..., Any]
    mesh: Mesh
    axis: str
    backend: str
    accum_steps: int
    reduce_dtype: Any
    bucket_bytes: int | None
    shard_optimizer: bool
    skip_nonfinite: bool
    donate: bool
    rng: str = "per_device"


def _compile_train_step(o: _StepOptions, state: TrainState) -> Callable[..., Any]:
    axis, varying, n = o.axis, o.backend == "shard_map", o.mesh.shape[o.axis]
    flat = None if o.bucket_bytes is None else _FlatLayout.build(state.params)

    def body(state: TrainState, data: Any, mask: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        data = data if mask is None else _zero_masked_rows(data, mask)
        grad_sum, metric_sums, model_state, count = _accumulate(o, state, data, mask, varying)
        # The example count, the metrics and the model state travel in one f32 vector (XLA:CPU pays
        # per buffer); XLA fuses its all-reduce with the gradients' into one collective.
        masked = mask is not None
        weighted_state = _float_leaves(model_state)
        if masked:
            weighted_state = jax.tree.map(lambda v: jnp.where(count > 0, count * v, jnp.zeros_like(v)), weighted_state)
        vec, unravel = ravel_pytree((count, metric_sums, weighted_state))
        if o.shard_optimizer:
            vec = lax.psum(vec, axis)
        elif flat is not None:
            vec, grads = _bucketed_psum(grad_sum, vec, flat, o.bucket_bytes, o.reduce_dtype, axis)
        else:
            vec, low = lax.psum((vec, _cast(grad_sum, o.reduce_dtype)), axis)
            grads = _cast_like(low, grad_sum)
        total, metric_sums, stats = unravel(vec)
        # Masked: sums of count-weighted means over the real-example count. Unmasked: sums of means
        # over the number of (equal) blocks, which needs no per-gradient multiplication.
        denom = jnp.maximum(total, 1.0) if masked else float(n * o.accum_steps)
        new_model_state = _merge_model_state(
            model_state, jax.tree.map(lambda v: v / denom, stats), axis, state.model_state
        )
        if o.shard_optimizer:
            params, opt_state, finite = _zero_update(o, state, grad_sum, denom, n)
        else:
            grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
            updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            finite = _all_finite(grads) if o.skip_nonfinite else None
        # Keep the old state where nothing real was seen (all padding) or a gradient was not finite.
        apply = total > 0 if mask is not None else None
        if o.skip_nonfinite:
            apply = finite if apply is None else apply & finite
        keep = (
            (lambda new, old: new)
            if apply is None
            else (lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old))
        )
        new_state = state.replace(
            step=state.step + 1,
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            model_state=keep(new_model_state, state.model_state),
        )
        metrics = {k: v / denom for k, v in metric_sums.items()}
        metrics["examples"] = total
        if o.skip_nonfinite:
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return new_state, metrics

    specs = _state_specs(state)
    return _spmd_compile(body, o.mesh, axis, o.backend, specs, (specs, P()), donate=o.donate)


def _accumulate(o: _StepOptions, state: TrainState, data: Any, mask: Any, varying: bool) -> tuple[Any, ...]:
    """Runs loss_fn over the micro-batches.

    Returns the sums over micro-batches of gradients and metrics (weighted by real-example count
    when the batch is masked), the last model state and this device's real-example count.
    """
    axis, k, masked = o.axis, o.accum_steps, mask is not None
    mask = _full_mask(data) if mask is None else mask
    params = _vary(state.params, axis, varying)
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), (data, mask))
    micro_rng = _micro_rng(o, state, mask.shape[0] // k)
    grad_fn = jax.value_and_grad(_loss_with_aux(o.loss_fn), has_aux=True)

    def one(model_state: Any, batch: Any, m: jax.Array, j: Any) -> tuple[Any, ...]:
        (loss, aux), grads = grad_fn(
            params,
            batch,
            apply_fn=state.apply_fn,
            model_state=model_state,
            rng=micro_rng(j),
            mask=m,
        )
        new_model_state = aux.pop("model_state", model_state)
        _check_same_tree(model_state, new_model_state)
        c = jnp.sum(m, dtype=jnp.float32)
        # Masked, a block without real examples may give a NaN mean: its weight is zero, and so is
        # its contribution. Unmasked, every block has the same count: plain sums, divided once by
        # the number of blocks after the reduction.
        weigh = (lambda v: jnp.where(c > 0, c * v, jnp.zeros_like(v))) if masked else (lambda v: v)
        metrics = jax.tree.map(lambda v: weigh(v.astype(_sum_dtype(v.dtype))), {"loss": loss, **aux})
        return jax.tree.map(weigh, grads), metrics, new_model_state, c

    first = one(_vary(state.model_state, axis, varying), *jax.tree.map(lambda x: x[0], micro), 0)
    if k == 1:
        return first

    def body(carry: Any, xs: Any) -> Any:
        grad_sum, metric_sums, model_state, count = carry
        (batch, m), j = xs
        grads, metrics, model_state, c = one(model_state, batch, m, j)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        return (add(grad_sum, grads), add(metric_sums, metrics), model_state, count + c), None

    rest = jax.tree.map(lambda x: x[1:], micro)
    carry, _ = lax.scan(body, _vary(first, axis, varying), (rest, jnp.arange(1, k)))
    return carry


def _micro_rng(o: _StepOptions, state: TrainState, rows: int) -> Callable[[Any], jax.Array]:
    """The ``rng`` of micro-batch ``j`` (``rows`` examples) on this device."""
    step_rng = jax.random.fold_in(state.rng, state.step)
    device = lax.axis_index(o.axis)
    if o.rng == "per_example":
        # Device d's block holds global rows [d * k * rows, (d + 1) * k * rows); micro-batch j of it
        # starts j * rows further. Every device shares step_rng: only the row offset differs.
        first = device * (o.accum_steps * rows)
        return lambda j: per_example_key(step_rng, offset=first + j * rows, rows=rows)
    device_rng = jax.random.fold_in(step_rng, device)
    return lambda j: jax.random.fold_in(device_rng, j)


def _loss_with_aux(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(params: Any, batch: Any, **kwargs: Any) -> tuple[jax.Array, dict[str, Any]]:
        loss, aux = _split_loss_output(loss_fn(params, batch, **kwargs), "make_train_step")
        _check_scalars(
            "make_train_step",
            {"loss": loss, **{k: v for k, v in aux.items() if k != "model_state"}},
            "loss_fn",
        )
        return loss, dict(aux)

    return wrapped


def _split_loss_output(out: Any, fn: str) -> tuple[Any, dict[str, Any]]:
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


def _check_scalars(fn: str, values: dict[str, Any], who: str) -> None:
    for name, v in values.items():
        shape = getattr(v, "shape", None)
        if shape != () or not jnp.issubdtype(v.dtype, jnp.floating):
            raise ShapeError(
                describe(
                    fn,
                    f"{who} returned {name!r} with shape {shape} and dtype "
                    f"{getattr(v, 'dtype', type(v))}; "
                    "it must be a float scalar (the mean over this block's real examples).",
                    leaf=name,
                    fix="reduce per-example values with spmdcomm.masked_mean(values, mask).",
                )
            )


def _check_same_tree(old: Any, new: Any) -> None:
    old_def, new_def = jax.tree.structure(old), jax.tree.structure(new)
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


def _full_mask(data: Any) -> jax.Array:
    return jnp.ones((jax.tree.leaves(data)[0].shape[0],), dtype=bool)


def _vary(tree: Any, axis: str, varying: bool) -> Any:
    # Marks replicated values as varying over `axis` so that jax.grad returns the per-device
    # gradient instead of one already summed over the axis (shard_map with check_vma=True). pmap has
    # no such typing.
    if not varying:
        return tree
    return jax.tree.map(lambda x: x if axis in varying_axes(x) else lax.pcast(x, axis, to="varying"), tree)


def _cast(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(lambda g: g.astype(dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g, tree)


def _cast_like(tree: Any, like: Any) -> Any:
    return jax.tree.map(lambda g, ref: g.astype(ref.dtype), tree, like)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _float_leaves(tree: Any) -> Any:
    # The float leaves in the dtype they are summed in; other leaves become empty (not averaged).
    return jax.tree.map(
        lambda x: (
            x.astype(_sum_dtype(x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros((0,), jnp.float32)
        ),
        tree,
    )


def _sum_dtype(dtype: Any) -> Any:
    # Means of model state and metrics are summed in float32 at least (a bfloat16 sum over devices
    # loses the small terms) and in float64 when the value is float64 (x64): never narrower.
    return jnp.promote_types(dtype, jnp.float32)


def _zero_masked_rows(data: Any, mask: jax.Array) -> Any:
    # Masked-out rows reach loss_fn as zeros whatever they held. A NaN/Inf there would otherwise
    # flow through the model although masked_mean drops its loss: into BatchNorm statistics, and
    # into gradients as NaN * 0 (a Dense layer's weight gradient is x.T @ cotangent).
    def one(x: jax.Array) -> jax.Array:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # typed PRNG keys: no zeros to select
            return x
        keep = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, jnp.zeros_like(x))

    return jax.tree.map(one, data)


def _merge_model_state(local: Any, averaged: Any, axis: str, stored: Any) -> Any:
    # Float leaves take their weighted average over the axis; integer leaves (counters, e.g. NNX
    # RngCount) must agree on every replica and take the maximum. RNG keys are never averaged: the
    # stored key stays (a model's streams only advance their counts), identical on every replica.
    def merge(x: jax.Array, avg: jax.Array, old: jax.Array) -> jax.Array:
        if is_key_leaf(x):
            return old
        return avg.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else lax.pmax(x, axis)

    return jax.tree.map(merge, local, averaged, stored)


def _bucketed_psum(
    grads: Any, stats: jax.Array, flat: _FlatLayout, bucket_bytes: int, reduce_dtype: Any, axis: str
) -> tuple[jax.Array, Any]:
    """Sums ``stats`` and the gradients over ``axis`` in flat buckets; returns both sums.

    Without ``reduce_dtype`` the f32 ``stats`` vector leads the float32 buffer, so a model whose
    gradients fit one bucket needs ONE all-reduce buffer per step (each costs a round trip on gloo).
    """
    vectors = flat.flatten(grads)
    fused = reduce_dtype is None
    stats_key = jnp.dtype(stats.dtype).name  # float64 under x64 when model state or metrics are float64
    if fused:
        vectors[stats_key] = jnp.concatenate([stats, vectors.get(stats_key, stats[:0])])
    else:
        stats = lax.psum(stats, axis)
    out = {}
    for name, vec in vectors.items():
        low = _cast(vec, reduce_dtype)
        step = max(1, bucket_bytes // low.dtype.itemsize)
        chunks = [lax.psum(low[i : i + step], axis) for i in range(0, low.shape[0], step)]
        out[name] = (jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]).astype(vec.dtype)
    if fused:
        stats, out[stats_key] = out[stats_key][: stats.shape[0]], out[stats_key][stats.shape[0] :]
    return stats, flat.unflatten(out)


def _zero_update(o: _StepOptions, state: TrainState, grad_sum: Any, denom: jax.Array, n: int) -> tuple[Any, ...]:
    layout = state.zero
    me = lax.axis_index(o.axis)
    grad_vecs = layout.flat.flatten(grad_sum, pad_to=n)
    grad_shards = {}
    for name, vec in grad_vecs.items():
        low = _cast(vec, o.reduce_dtype)
        grad_shards[name] = (reduce_scatter(low, o.axis).astype(vec.dtype) / denom).astype(vec.dtype)
    param_vecs = layout.flat.flatten(state.params, pad_to=n)
    param_shards = {
        name: lax.dynamic_slice_in_dim(vec, me * (vec.shape[0] // n), vec.shape[0] // n)
        for name, vec in param_vecs.items()
    }
    updates, opt_state = state.tx.update(grad_shards, state.opt_state, param_shards)
    new_shards = optax.apply_updates(param_shards, updates)
    finite = None
    if o.skip_nonfinite:
        bad = sum(jnp.sum(~jnp.isfinite(g)) for g in grad_shards.values())
        finite = lax.psum(bad, o.axis) == 0
    params = layout.flat.unflatten(all_gather(new_shards, o.axis))
    return params, opt_state, finite


def _spmd_compile(
    body: Callable[..., Any],
    mesh: Mesh,
    axis: str,
    backend: str,
    state_specs: Any,
    out_specs: Any,
    *,
    donate: bool,
) -> Callable[..., Any]:
    # The spmd wrapper's compiled function without its per-call placement: the state is already
    # placed by TrainState.create (and by the previous step), and batches by _place_batch.
    sf = SpmdFunction(
        body,
        in_specs=(state_specs, P(axis), P(axis)),
        out_specs=out_specs,
        mesh=mesh,
        backend=backend,
        check_vma=True,
        donate_argnums=(0,) if donate else (),
    )
    return sf._compiled(mesh)


def _state_specs(state: TrainState) -> Any:
    opt_specs = P() if state.zero is None else state.zero.opt_specs
    return state.replace(step=P(), params=P(), opt_state=opt_specs, model_state=P(), rng=P())


# --------------------------------------------------------------------------------------------------
# Flat layouts (buckets, ZeRO-1)


@dataclasses.dataclass(frozen=True)
class _FlatLayout:
    """How a pytree maps to one flat vector per dtype (leaves in tree order)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def build(cls, tree: Any) -> _FlatLayout:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(
            treedef,
            tuple(tuple(x.shape) for x in leaves),
            tuple(jnp.dtype(x.dtype).name for x in leaves),
        )

    def sizes(self, pad_to: int = 1) -> dict[str, int]:
        total: dict[str, int] = collections.defaultdict(int)
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            total[dt] += math.prod(shape)
        return {dt: -(-size // pad_to) * pad_to for dt, size in total.items()}

    def flatten(self, tree: Any, pad_to: int = 1) -> dict[str, jax.Array]:
        leaves = jax.tree.leaves(tree)
        groups: dict[str, list[jax.Array]] = collections.defaultdict(list)
        for leaf, dt in zip(leaves, self.dtypes, strict=True):
            groups[dt].append(jnp.ravel(leaf))
        out = {}
        for dt, size in self.sizes(pad_to).items():
            vec = jnp.concatenate(groups[dt]) if len(groups[dt]) > 1 else groups[dt][0]
            out[dt] = jnp.pad(vec, (0, size - vec.shape[0])) if size > vec.shape[0] else vec
        return out

    def unflatten(self, vectors: dict[str, jax.Array]) -> Any:
        offsets: dict[str, int] = collections.defaultdict(int)
        leaves = []
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            size = math.prod(shape)
            leaves.append(vectors[dt][offsets[dt] : offsets[dt] + size].reshape(shape))
            offsets[dt] += size
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class _ZeroLayout:
    """ZeRO-1: the optimizer works on flat per-dtype parameter vectors split evenly over
    ``axis``."""

    flat: _FlatLayout
    axis: str
    shards: int
    spec_treedef: Any
    spec_leaves: tuple[P, ...]

    @property
    def opt_specs(self) -> Any:
        """The PartitionSpec of every optimizer-state leaf: split vectors ``P(axis)``, scalars
        ``P()``."""
        return jax.tree.unflatten(self.spec_treedef, self.spec_leaves)

    @classmethod
    def build(cls, params: Any, tx: optax.GradientTransformation, axis: str, n: int) -> _ZeroLayout:
        flat = _FlatLayout.build(params)
        _check_elementwise(tx, flat, n)
        shard = {dt: jax.ShapeDtypeStruct((size // n,), dt) for dt, size in flat.sizes(pad_to=n).items()}
        abstract = jax.eval_shape(tx.init, shard)
        shard_shapes = {s.shape for s in shard.values()}
        leaves, treedef = jax.tree.flatten(abstract)
        specs = tuple(P(axis) if a.ndim == 1 and a.shape in shard_shapes else P() for a in leaves)
        return cls(flat, axis, n, treedef, specs)


def _check_elementwise(tx: optax.GradientTransformation, flat: _FlatLayout, n: int) -> None:
    """Raises unless ``tx`` treats every parameter entry independently (its state and its
    updates)."""
    fix = (
        "use shard_optimizer=False, or an element-wise optax transformation (sgd, momentum, adam, "
        "adamw, "
        "rmsprop, lion, ...); global-norm clipping and factored states need the whole gradient."
    )
    dtypes = sorted(set(flat.dtypes))
    rng = np.random.default_rng(0)
    size = 4 * n
    g = [{dt: (rng.standard_normal(size) * 100).astype(dt) for dt in dtypes} for _ in range(2)]
    p = {dt: rng.standard_normal(size).astype(dt) for dt in dtypes}

    def run(grads: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, np.ndarray]:
        state = tx.init(params)
        for gi in grads:
            upd, state = tx.update(gi, state, params)
            params = optax.apply_updates(params, upd)
        return params

    try:
        whole = run(g, p)
        halves = [
            run(
                [{dt: v[sl] for dt, v in gi.items()} for gi in g],
                {dt: v[sl] for dt, v in p.items()},
            )
            for sl in (slice(0, size // 2), slice(size // 2, size))
        ]
    except Exception as e:  # noqa: BLE001 - any failure on flat vectors means the transform is not supported
        raise SpmdError(
            describe(
                "TrainState.create",
                f"shard_optimizer=True: the optax transformation fails "
                f"on flat parameter slices ({type(e).__name__}: {e}).",
                fix=fix,
            )
        ) from e
    for dt in dtypes:
        joined = np.concatenate([np.asarray(h[dt]) for h in halves])
        if not np.allclose(np.asarray(whole[dt]), joined, rtol=1e-4, atol=1e-6):
            raise SpmdError(
                describe(
                    "TrainState.create",
                    "shard_optimizer=True needs an optimizer that updates each parameter "
                    "entry independently, but this one gives different updates on slices of the "
                    "parameters than "
                    "on the whole (e.g. clipping by global norm).",
                    fix=fix,
                )
            )


def _init_opt_state(tx: optax.GradientTransformation, params: Any, zero: _ZeroLayout | None, mesh: Mesh) -> Any:
    if zero is None:
        return jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), zero.opt_specs, is_leaf=lambda x: isinstance(x, P))
    n = zero.shards

    def init(params: Any) -> Any:
        vecs = zero.flat.flatten(params, pad_to=n)
        return tx.init(vecs)

    return jax.jit(init, out_shardings=shardings)(params)


def _check_zero_matches(o: _StepOptions, state: TrainState) -> None:
    if o.shard_optimizer and state.zero is None:
        raise SpmdError(
            describe(
                "make_train_step",
                "shard_optimizer=True, but the state's optimizer state is not sharded.",
                fix="create the state with TrainState.create(..., shard_optimizer=True).",
            )
        )
    if not o.shard_optimizer and state.zero is not None:
        raise SpmdError(
            describe(
                "make_train_step",
                "the state was created with shard_optimizer=True, but the step was not.",
                fix="pass shard_optimizer=True to make_train_step.",
            )
        )
    if state.zero is not None and (state.zero.axis != o.axis or state.zero.shards != o.mesh.shape[o.axis]):
        raise SpmdError(
            describe(
                "make_train_step",
                f"the state's optimizer is sharded {state.zero.shards} ways over axis "
                f"{state.zero.axis!r}, but the step runs on axis {o.axis!r} of size "
                f"{o.mesh.shape[o.axis]}.",
                fix="create the state with the same mesh and axis as the step.",
            )
        )


# --------------------------------------------------------------------------------------------------
# Placement and multi-process helpers


_CONSUMED_STATE_FIX = (
    "a train step with donate=True (the default) consumes the state it is given; use the state it "
    "returned. To keep the old state usable, build the step with make_train_step(..., donate=False), "
    "or copy the state first: jax.tree.map(jnp.copy, state)."
)


def _check_state(fn: str, state: Any, mesh: Mesh, accepted: set[Any]) -> Any:
    """The checks every step call makes on its state before dispatch; returns the state's treedef.

    A consumed (donated) state would reach XLA as deleted buffers, which kills the process on CPU; a
    state on another mesh would get JAX's raw device error. The tree is flattened once: the deleted
    check and the caller's cache key share it.
    """
    leaves, treedef = jax.tree.flatten(state)
    check_not_deleted(fn, state, arg="state", fix=_CONSUMED_STATE_FIX, leaves=leaves)
    _check_state_mesh(fn, state, mesh, accepted)
    return treedef


def _dispatch(fn: str, compiled: Callable[..., Any], state: Any, batch: tuple[Any, Any], mesh: Mesh) -> Any:
    """Runs ``compiled(state, data, mask)``, replacing JAX's device error for a misplaced state leaf."""
    try:
        return compiled(state, *batch)
    except ValueError as e:
        _raise_if_misplaced(fn, state, mesh, e)
        raise


def _check_state_mesh(fn: str, state: Any, mesh: Mesh, accepted: set[Any]) -> None:
    """Raises unless every array of ``state`` is on ``mesh``'s devices, in ``mesh``'s order.

    Cheap on the hot path: the state a step returns is on the step's mesh object itself, so one
    identity comparison on ``state.step`` settles it; other placements of ``state.step`` that
    passed the full check once are remembered in ``accepted``. A single other leaf placed
    elsewhere is caught when JAX refuses the call (:func:`_raise_if_misplaced`).
    """
    sharding = getattr(state.step, "sharding", None) if isinstance(state, TrainState) else None
    where = getattr(sharding, "mesh", sharding)
    if where is mesh or (where is not None and where in accepted):
        return
    message = _misplaced(state, mesh)
    if message:
        raise SpmdError(describe(fn, message[1], leaf=message[0], fix=_MISPLACED_FIX))
    if where is not None:
        accepted.add(where)


def _raise_if_misplaced(fn: str, state: Any, mesh: Mesh, error: ValueError) -> None:
    # JAX's own message ("Received incompatible devices ... _compile_train_step.<locals>.body")
    # names neither mesh nor the fix; replace it when a state leaf is the cause.
    message = _misplaced(state, mesh)
    if message:
        raise SpmdError(describe(fn, message[1], leaf=message[0], fix=_MISPLACED_FIX)) from error


_MISPLACED_FIX = (
    "create the state with the step's mesh (TrainState.create(..., mesh=step_mesh)), or move a "
    "replicated state there: jax.device_put(state, jax.NamedSharding(step_mesh, jax.P())); a ZeRO-1 "
    "state (shard_optimizer=True) must be re-created on the step's mesh (restore a checkpoint into it)."
)


def _misplaced(state: Any, mesh: Mesh) -> tuple[str, str] | None:
    """``(leaf path, message)`` for the first array of ``state`` that the step's mesh cannot take."""
    want = tuple(mesh.devices.flat)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        sharding = leaf.sharding
        other = getattr(sharding, "mesh", None)
        if other is mesh:
            continue
        devices = getattr(other, "devices", None)
        same = (
            tuple(devices.flat) == want  # same devices in the same order: JAX accepts any axis names
            if devices is not None
            else sharding.device_set == set(want)
        )
        if not same:
            return (
                f"state{jax.tree_util.keystr(path)}",
                f"the state lives on {_describe_placement(sharding)}, but the step runs on {_describe_mesh(mesh)}.",
            )
    return None


def _describe_mesh(mesh: Mesh) -> str:
    return f"mesh {dict(mesh.shape)} over devices {[d.id for d in mesh.devices.flat]}"


def _describe_placement(sharding: Any) -> str:
    other = getattr(sharding, "mesh", None)
    if getattr(other, "devices", None) is not None:
        return _describe_mesh(other)
    return f"devices {sorted(d.id for d in sharding.device_set)} ({type(sharding).__name__})"


def _place_batch(fn: str, batch: Any, mesh: Mesh, axis: str, accum_steps: int) -> tuple[Any, Any]:
    data, mask = (batch.data, batch.mask) if isinstance(batch, MaskedBatch) else (batch, None)
    local = leading_size(fn, data)
    n_local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    need = n_local * accum_steps
    if local % need:
        what = f"{mesh.shape[axis]} devices on axis {axis!r}" + (
            f" x accum_steps={accum_steps}" if accum_steps > 1 else ""
        )
        raise ShapeError(
            describe(
                fn,
                f"the batch has {local} "
                f"examples{' in this process' if jax.process_count() > 1 else ''}, "
                f"which does not split evenly over {what} (needs a multiple of {need}).",
                fix=f"pad it with spmdcomm.pad_batch(batch, {need}); the step then averages over real examples only.",
            )
        )
    if mask is not None:
        mask_len = int(np.shape(mask)[0]) if np.ndim(mask) == 1 else -1
        if mask_len != local:
            raise ShapeError(
                describe(
                    fn,
                    f"the mask has shape {np.shape(mask)} but the batch has {local} rows.",
                    leaf="mask",
                    fix="build the batch with spmdcomm.pad_batch.",
                )
            )
    sharding = NamedSharding(mesh, P(axis))
    return _put(data, sharding), None if mask is None else _put(mask, sharding)


def _put(tree: Any, sharding: NamedSharding) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        return x

    tree = jax.tree.map(one, tree)
    host = [x for x in jax.tree.leaves(tree) if not isinstance(x, jax.Array)]
    if not host:
        return tree
    placed = iter(jax.device_put(host, sharding))
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else next(placed), tree)


def _place_replicated(tree: Any, mesh: Mesh) -> Any:
    sharding = NamedSharding(mesh, P())
    if jax.process_count() > 1:
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x, x.shape), tree)
    return jax.device_put(tree, sharding)


def _raw_key(rng: Any) -> np.ndarray:
    if rng is None:
        rng = 0
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return np.asarray(rng, dtype=np.uint32)


def _check_same_structure_across_processes(fn: str, tree: Any) -> None:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    desc = repr((str(treedef), [(jax.tree_util.keystr(p), x.shape, str(x.dtype)) for p, x in flat]))
    digest = np.frombuffer(hashlib.sha256(desc.encode()).digest()[:8], dtype=np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise SpmdError(
            describe(
                fn,
                f"processes {differ} passed parameters whose tree structure, shapes or dtypes "
                f"differ from "
                f"process 0's (this process, {jax.process_index()}, has {desc[:300]}).",
                fix="build the model and optimizer identically in every process.",
            )
        )


def _resolve_mesh(fn: str, mesh: Mesh | None, axis: str, backend: str) -> Mesh:
    mesh = default_mesh() if mesh is None else mesh
    check_mesh_axes(fn, mesh, axis)
    check_backend(fn, backend)
    return mesh


def _default_buckets(mesh: Mesh) -> int | None:
    """One flat buffer (per dtype) when the mesh spans processes; leaf by leaf within one process."""
    processes = {d.process_index for d in mesh.devices.flat}
    return _ONE_BUFFER if len(processes) > 1 else None


def _check_in_flight(fn: str, k: int) -> int:
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= _MAX_IN_FLIGHT_LIMIT:
        raise SpmdError(
            describe(
                fn,
                f"max_in_flight={k!r} must be an int in [1, {_MAX_IN_FLIGHT_LIMIT}].",
                fix="XLA:CPU deadlocks with ~32 queued collective executions; keep the window at 16 or below.",
            )
        )
    return int(k)


def _wait_for_window(window: collections.deque[Any], k: int) -> None:
    while len(window) >= k:
        window.popleft().block_until_ready()
