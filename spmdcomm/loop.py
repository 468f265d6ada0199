"""The training loop: runs a train step over batches with a bounded number of steps in flight."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import jax

from spmdcomm.train_state import TrainState
from spmdcomm.train_step import TrainStep

__all__ = ["fit"]


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
