"""What the train and eval steps share: the in-flight window, state checks, batch handling, compilation.

Private to the package; the public step objects are in :mod:`spmdcomm.train.train_step` and
:mod:`spmdcomm.train.eval_step`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm import _compile_watch
from spmdcomm._cache import Cache
from spmdcomm.data import placement
from spmdcomm.errors import BackendError, ShapeError, SpmdError, check_not_deleted, describe
from spmdcomm.parallel.roles import active
from spmdcomm.train.state import TrainState
from spmdcomm.train.weighted import Weighted

#: How many calls back a train/eval step waits for before dispatching another. XLA:CPU allows about 32
#: queued executions containing collectives per device; beyond that the collectives stall and XLA
#: aborts the whole process after about 40 s (SIGABRT, no Python exception). The window lives in the
#: step object: a step compiled by hand (``step.lower(...).compile()``) bypasses it.
DEFAULT_MAX_IN_FLIGHT = 8
_MAX_IN_FLIGHT_LIMIT = 16


class Window:
    """The bounded queue of dispatched calls: at most ``size`` results not yet waited for."""

    def __init__(self, size: int):
        self.size = size
        self._pending: collections.deque[Any] = collections.deque()

    def wait_for_room(self) -> None:
        while len(self._pending) >= self.size:
            self._pending.popleft().block_until_ready()

    def add(self, result: jax.Array) -> None:
        self._pending.append(result)


class StepCache:
    """Per-step memory of compiled programs (by state tree, which includes mesh and strategy) and of the
    state placements that passed the full mesh check."""

    def __init__(self, fn: str, compile_fn: Callable[[TrainState], jax.stages.Wrapped]):
        self.fn = fn
        self._compile = compile_fn
        self._compiled = Cache(limit=64)  # state tree (mesh, strategy, shapes) -> the compiled program
        self._placements_ok = Cache(limit=64)  # placements of state.step that passed the full mesh check

    def program(self, state: Any) -> jax.stages.Wrapped:
        """The compiled program for ``state``, after the checks every call makes on it."""
        if not isinstance(state, TrainState):
            raise SpmdError(
                describe(
                    self.fn,
                    f"state is a {type(state).__name__}, not a TrainState.",
                    fix="build it with spmdcomm.TrainState.create(...).",
                )
            )
        leaves, treedef = jax.tree.flatten(state)
        # A consumed (donated) state would reach XLA as deleted buffers, which kills the process on CPU;
        # a state moved to another mesh would get JAX's raw device error.
        check_not_deleted(self.fn, state, arg="state", fix=_CONSUMED_STATE_FIX, leaves=leaves)
        self._check_mesh(state)
        return self._compiled.get_or_make(treedef, lambda: self._compile(state))

    def _check_mesh(self, state: TrainState) -> None:
        # Cheap on the hot path: the state a step returns is on the state's mesh object itself, so one
        # identity comparison on state.step settles it; other placements of state.step that passed the
        # full check once are remembered. A single other leaf placed elsewhere is caught when JAX refuses
        # the call (dispatch).
        sharding = getattr(state.step, "sharding", None)
        where = getattr(sharding, "mesh", sharding)
        if where is state.mesh or (where is not None and where in self._placements_ok):
            return
        raise_if_misplaced(self.fn, state)
        if where is not None:
            self._placements_ok.put(where, True)


def dispatch(fn: str, program: Callable[..., Any], state: TrainState, batch: tuple[Any, Any]) -> Any:
    """Runs ``program(state, data, mask)``, replacing JAX's device error for a misplaced state leaf; a call that
    compiles is reported as the ``"compile"`` phase of the calling thread's :class:`~spmdcomm.PhaseTimer`."""
    try:
        with _compile_watch.call():
            return program(state, *batch)
    except ValueError as e:
        raise_if_misplaced(fn, state, cause=e)
        raise


def raise_if_misplaced(fn: str, state: TrainState, *, cause: Exception | None = None) -> None:
    """Raises :class:`SpmdError` naming the first leaf of ``state`` that is not on ``state.mesh``."""
    # JAX's own message ("Received incompatible devices ... body") names neither mesh nor the fix.
    want = tuple(state.mesh.devices.flat)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        sharding = leaf.sharding
        other = getattr(sharding, "mesh", None)
        if other is state.mesh:
            continue
        devices = getattr(other, "devices", None)
        same = (
            tuple(devices.flat) == want  # same devices in the same order: JAX accepts any axis names
            if devices is not None
            else sharding.device_set == set(want)
        )
        if not same:
            message = (
                f"the state lives on {_describe_placement(sharding)}, but it was created for (and the step "
                f"runs on) {_describe_mesh(state.mesh)}."
            )
            raise SpmdError(
                describe(fn, message, leaf=f"state{jax.tree_util.keystr(path)}", fix=_MISPLACED_FIX)
            ) from cause


def check_step_backend(fn: str, backend: str) -> None:
    """Raises :class:`BackendError` (naming ``fn``) unless ``backend`` is ``"shard_map"``, the steps' one backend."""
    if backend == "shard_map":
        return
    if backend == "pmap":
        raise BackendError(
            describe(
                fn,
                "backend='pmap': the pmap step backend was retired. Since JAX 0.10 jax.pmap is "
                "jax.jit(jax.shard_map(...)), and the shard_map step computes the same step (spmdcomm's "
                "collectives still run inside your own jax.pmap and sc.spmd(..., backend='pmap')).",
                fix=_BACKEND_FIX,
            )
        )
    raise BackendError(
        describe(fn, f"unknown backend {backend!r}; the steps run on 'shard_map' only.", fix=_BACKEND_FIX)
    )


def compile_local_step(body: Callable[..., Any], state: TrainState, out_specs: Any) -> jax.stages.Wrapped:
    """The compiled ``body(state, data, mask)`` per device (manual over the data axes only, model axes left to XLA),
    the batch split over the data axes and the outputs laid out as ``out_specs``."""
    # The state is already placed (by TrainState.create and the previous step), the batch by place_batch.
    local = _local(body, state, out_specs)

    @functools.wraps(local)
    def traced(state: TrainState, data: Any, mask: Any) -> Any:
        _compile_watch.tracing()
        return local(state, data, mask)

    return jax.jit(traced)


def compile_global_step(
    fn: str,
    local: Callable[..., Any],
    local_specs: Any,
    finish: Callable[..., Any],
    state: TrainState,
    *,
    donate: bool,
) -> jax.stages.Wrapped:
    """The compiled step ``finish(state, data, mask, local(state, data, mask))`` on the state's mesh.

    ``local`` runs per device (``shard_map``, manual over the state's data axes, the batch split over them; model
    axes left to XLA) and returns arrays laid out as ``local_specs`` (over the data axes); ``finish`` runs in the
    global view on the sharded arrays (XLA inserts whatever collectives it needs). The new state keeps the input
    state's shardings.
    """
    mapped = _local(local, state, local_specs)
    replicated = NamedSharding(state.mesh, P())

    def traced(state: TrainState, data: Any, mask: Any) -> Any:
        _compile_watch.tracing()
        return finish(state, data, mask, mapped(state, data, mask))

    return jax.jit(
        traced,
        out_shardings=(state.shardings(), replicated),
        donate_argnums=(0,) if donate else (),
    )


def _local(body: Callable[..., Any], state: TrainState, out_specs: Any) -> Callable[..., Any]:
    """``body(state, data, mask)`` per device: ``shard_map`` manual over the batch axes and the token axes
    (partial-manual when the mesh has model axes). With a parallelism that splits tokens (the context axis),
    dimension 1 (the tokens) of every data leaf of two or more dimensions is put in its config's order and split
    over its axis (the rows arrive split over the batch axes and whole over that axis, so each device keeps its own
    tokens)."""
    roles, rows = state.roles, P(state.roles.batch)
    # One parallelism at most splits the tokens (mesh_roles checks): dimension 1 has one order.
    split_tokens = next((config for entry, config in active(state.configs) if not entry.rows), None)

    def split(state: TrainState, data: Any, mask: Any) -> Any:
        specs = jax.tree.map(lambda _: rows, data)
        if split_tokens is not None:
            size, tokens = roles.size((split_tokens.axis,)), lambda x: np.ndim(x) >= 2
            order = lambda x: jnp.take(x, split_tokens.order(x.shape[1], size), axis=1) if tokens(x) else x
            data = jax.tree.map(order, data)
            specs = jax.tree.map(lambda x: P(roles.batch, split_tokens.axis) if tokens(x) else rows, data)
        return jax.shard_map(
            body,
            mesh=state.mesh,
            in_specs=(state.manual_specs(), specs, rows),
            out_specs=out_specs,
            axis_names=set(roles.manual),
            check_vma=True,
        )(state, data, mask)

    return split


def place_batch(
    fn: str, batch: Any, state: TrainState, multiple_of: int, host_input: placement.HostInput
) -> tuple[Any, Any]:
    """Splits ``batch`` over the state's data axis: ``(data, mask)`` global arrays (``mask`` may be None)."""
    return placement.place_batch(
        fn,
        batch,
        mesh=state.mesh,
        axis=state.roles.batch if state.roles.batch != state.data_axes else state.axis,
        multiple_of=multiple_of,
        multiple_name="accum_steps",
        host_input=host_input,
    )


def check_in_flight(fn: str, k: int) -> int:
    """``k`` as an int, if it is a valid ``max_in_flight``."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= _MAX_IN_FLIGHT_LIMIT:
        raise SpmdError(
            describe(
                fn,
                f"max_in_flight={k!r} must be an int in [1, {_MAX_IN_FLIGHT_LIMIT}].",
                fix="XLA:CPU deadlocks with ~32 queued collective executions; keep the window at 16 or below.",
            )
        )
    return int(k)


def check_scalars(fn: str, values: dict[str, Any], who: str) -> None:
    """Raises unless every value is a float scalar (a mean over the block's real examples) or a
    :class:`~spmdcomm.train.Weighted` of scalars (a sum over the block's tokens and its weight)."""
    for name, v in values.items():
        parts = {"total": v.total, "weight": v.weight} if isinstance(v, Weighted) else {"": v}
        for part, x in parts.items():
            shape = getattr(x, "shape", None)
            if shape != () or not jnp.issubdtype(getattr(x, "dtype", type(x)), jnp.floating):
                raise ShapeError(
                    describe(
                        fn,
                        f"{who} returned {name!r}{' (sc.weighted ' + part + ')' if part else ''} with shape {shape} "
                        f"and dtype {getattr(x, 'dtype', type(x))}; it must be a float scalar (the mean over this "
                        "block's real examples, or sc.weighted(sum over its tokens, their weight)).",
                        leaf=name,
                        fix="reduce per-example values with spmdcomm.masked_mean(values, mask), or per-token values "
                        "with spmdcomm.weighted(jnp.sum(values * weights), jnp.sum(weights)).",
                    )
                )


def sum_dtype(dtype: Any) -> Any:
    """The dtype a mean is summed in over devices: float32 at least, float64 under x64, never narrower."""
    # A bfloat16 sum over devices loses the small terms.
    return jnp.promote_types(dtype, jnp.float32)


def summable(v: Weighted) -> Weighted:
    """A token-weighted value as the steps sum it over micro-batches and devices: in the dtype sums are taken in, and
    a block without weight adds exactly nothing (its total may be NaN)."""
    total = v.total.astype(sum_dtype(v.total.dtype))
    return Weighted(jnp.where(v.weight > 0, total, jnp.zeros_like(total)), v.weight.astype(total.dtype))


def zero_masked_rows(data: Any, mask: jax.Array) -> Any:
    """``data`` with the masked-out rows set to zero."""

    # Masked-out rows reach loss_fn as zeros whatever they held. A NaN/Inf there would otherwise flow
    # through the model although masked_mean drops its loss: into BatchNorm statistics, and into
    # gradients as NaN * 0 (a Dense layer's weight gradient is x.T @ cotangent).
    def one(x: jax.Array) -> jax.Array:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # typed PRNG keys: no zeros to select
            return x
        keep = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, jnp.zeros_like(x))

    return jax.tree.map(one, data)


# --------------------------------------------------------------------------------------------------

_CONSUMED_STATE_FIX = (
    "a train step with donate=True (the default) consumes the state it is given; use the state it "
    "returned. To keep the old state usable, build the step with make_train_step(..., donate=False), "
    "or copy the state first: jax.tree.map(jnp.copy, state)."
)

_BACKEND_FIX = "drop backend=..., or pass backend='shard_map'."

_MISPLACED_FIX = (
    "keep the state where TrainState.create placed it, or create it on the mesh you want "
    "(TrainState.create(..., mesh=...)); to move a trained state, save a checkpoint and restore it into a "
    "state created on the new mesh."
)


def _describe_mesh(mesh: Mesh) -> str:
    return f"mesh {dict(mesh.shape)} over devices {[d.id for d in mesh.devices.flat]}"


def _describe_placement(sharding: Any) -> str:
    other = getattr(sharding, "mesh", None)
    if other is not None and getattr(other, "devices", None) is not None:
        return _describe_mesh(other)
    return f"devices {sorted(d.id for d in sharding.device_set)} ({type(sharding).__name__})"
