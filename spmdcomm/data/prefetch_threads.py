"""The work behind a :class:`~spmdcomm.data.Prefetcher`: the state it shares with its threads, the fetch and place
threads, and the placing of one batch, staged into aligned memory on CPU and into pinned host memory on GPU and TPU
(:mod:`spmdcomm.data.prefetch` has the consumer side and the rule for when the threads start).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from spmdcomm.data.agreement import Agreement
from spmdcomm.data.batches import leading_size, pad_batch
from spmdcomm.data.blocks import blocks
from spmdcomm.data.placement import HostInput, place_leaves
from spmdcomm.data.staging import ALIGNMENT, StagingPool, is_aligned
from spmdcomm.runtime.mesh import platform
from spmdcomm.runtime.transport import Channel

__all__ = [
    "SharedState",
    "start_threads",
    "stop",
    "place_fetched",
    "pinned_sharding",
    "host_bytes",
    "POLL_SECONDS",
    "CLOSE_TIMEOUT",
    "PINNED_HOST",
]

# Seconds between checks of the stop flag (and of the producer's health) while waiting.
POLL_SECONDS = 0.05
# Seconds close() waits for the producer thread to finish (it may be inside a slow next(iterable)).
CLOSE_TIMEOUT = 10.0
# Whether the placing thread stages host leaves through the devices' pinned host memory where they have one (GPU):
# a copy out of pinned memory is a DMA that runs beside the step, while one out of pageable NumPy memory goes
# through the driver's own bounce buffers and holds the thread that asked for it (on an H100 a prefetched 16 MiB
# batch was not hidden at all). Read when a prefetcher is made; False places straight from the NumPy arrays
# (benchmarks/prefetch.py measures both).
PINNED_HOST = True


class SharedState:
    """What the producer thread and the consumer share (the producer must not see the Prefetcher)."""

    def __init__(
        self, source: Iterator[Any], size: int, sharding: Sharding, multiple_of: int | None, host_input: HostInput
    ):
        self.source = source
        self.size = size
        self.sharding = sharding
        self.multiple_of = multiple_of
        self.host_input = host_input
        # New shape signatures are agreed on this prefetcher's own channel (named alike on every process):
        # the placing thread must not take sync points from the main thread's sequence.
        self.agreement = Agreement(Channel(f"prefetch/{next(_PREFETCHERS)}"))
        self.fetched: queue.Queue[tuple[str, Any]] = queue.Queue()  # host batches, not yet placed
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue()  # placed batches
        self.slots = threading.Semaphore(size)  # batches taken from source but not yet handed out
        self.stop = threading.Event()
        self.finished = False
        self.threads: tuple[threading.Thread, ...] = ()
        self.cpu = platform(sharding) == "cpu"
        self.pinned = None if self.cpu else pinned_sharding(sharding)  # where host leaves are staged, if anywhere
        self.plans: dict[tuple[Any, ...], bool] = {}  # (shape, dtype) -> whether staging lets devices alias it
        self.pool = StagingPool(keep=size + 3)


def start_threads(state: SharedState) -> None:
    """Starts the fetch and place threads; from then on they take every batch from the source.

    One thread waits on the source while the other places the previous batch, so a loader that
    waits (on storage, on the network) overlaps with the placement.
    """
    state.threads = tuple(
        threading.Thread(target=target, args=(state,), daemon=True, name="spmdcomm-prefetch")
        for target in (_fetch, _place_all)
    )
    for thread in state.threads:
        thread.start()


def stop(state: SharedState) -> None:
    """Stops the threads, waiting up to ``CLOSE_TIMEOUT`` seconds in all for them to end; without threads, closes
    the source (the fetch thread closes it when it ends)."""
    state.stop.set()
    state.finished = True
    state.slots.release()
    deadline = time.monotonic() + CLOSE_TIMEOUT
    for thread in state.threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    if not state.threads:  # in-line: nobody else is running the source
        _close_source(state)


def place_fetched(state: SharedState, batch: Any, *, stage: bool) -> Any:
    """The batch as global arrays. With ``stage``, host leaves are first staged: on CPU, unaligned leaves are copied
    into aligned staging buffers that the devices then alias; on GPU and TPU, every host leaf goes to pinned host
    memory (``state.pinned``, where there is one) and from there to the devices.

    Without it, this is a plain ``device_put`` (JAX copies unaligned leaves on its own threads).
    """
    if state.multiple_of is not None:
        batch = pad_batch(batch, state.multiple_of)
    else:
        leading_size("prefetch_to_device", batch)
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    leaves = []
    for _, leaf in flat:
        if not isinstance(leaf, jax.Array):
            leaf = np.asarray(leaf)
            if stage and _stageable(state, leaf) and not is_aligned(leaf):
                leaf = state.pool.copy(leaf)
        leaves.append(leaf)

    def names() -> list[str]:  # only called for an error message
        return [jax.tree_util.keystr(path) for path, _ in flat]

    if stage and state.pinned is not None:
        leaves = _to_pinned(state, leaves, names)
    placed = place_leaves(
        "prefetch_to_device",
        leaves,
        [state.sharding] * len(leaves),
        names=names,
        host_input=state.host_input,
        agreement=state.agreement,
    )
    return jax.tree_util.tree_unflatten(treedef, placed)


def pinned_sharding(sharding: Sharding) -> Sharding | None:
    """``sharding`` in its devices' pinned host memory, or ``None`` where prefetch does not stage there.

    ``None`` when :data:`PINNED_HOST` is False, on CPU (whose devices alias aligned host memory instead), when a
    device has no ``pinned_host`` memory, when the sharding spans processes (each process puts only its rows, through
    ``jax.make_array_from_process_local_data``), or when the sharding cannot name a memory kind.
    """
    if not PINNED_HOST or platform(sharding) == "cpu" or not sharding.is_fully_addressable:
        return None
    devices: list[Any] = list(sharding.device_set)  # jaxlib has no stubs: a Device's methods are unknown to mypy
    try:
        if not all(any(m.kind == "pinned_host" for m in d.addressable_memories()) for d in devices):
            return None
        return sharding.with_memory_kind("pinned_host")
    except (AttributeError, NotImplementedError, ValueError):  # a Sharding class or device without memory kinds
        return None


def host_bytes(batch: Any) -> int:
    """Bytes of ``batch``'s host leaves (everything but ``jax.Array`` s): what placing it copies to the devices."""
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(batch) if not isinstance(x, jax.Array))


# ---------------------------------------------------------------------------------------------------------


def _to_pinned(state: SharedState, leaves: list[Any], names: Any) -> list[Any]:
    """``leaves`` with every host leaf placed in pinned host memory (``state.pinned``), checked and split as
    :func:`~spmdcomm.data.placement.place_leaves` does; ``jax.Array`` leaves are left as they are."""
    host = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.Array)]
    target = state.pinned
    if not host or target is None:
        return leaves
    pinned = place_leaves(
        "prefetch_to_device",
        [leaves[i] for i in host],
        [target] * len(host),
        names=lambda: [names()[i] for i in host],
        host_input=state.host_input,
        agreement=state.agreement,
    )
    out = list(leaves)
    for i, leaf in zip(host, pinned, strict=True):
        out[i] = leaf
    return out


# Numbers the prefetchers of this process; each one's channel has the same name on every process.
_PREFETCHERS = itertools.count()


def _fetch(state: SharedState) -> None:
    """Takes batches from the source, at most ``size`` ahead of the consumer, into ``state.fetched``."""
    try:
        while True:
            while not state.slots.acquire(timeout=POLL_SECONDS):
                if state.stop.is_set():
                    return
            if state.stop.is_set():
                return
            try:
                item = next(state.source)
            except StopIteration:
                state.fetched.put(("done", None))
                return
            state.fetched.put(("item", item))
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
        state.fetched.put(("error", e))
    finally:
        _close_source(state)


def _close_source(state: SharedState) -> None:
    close = getattr(state.source, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - a failing close must not hide the real outcome
            pass


def _place_all(state: SharedState) -> None:
    """Places fetched batches on the mesh, in order, into ``state.queue``."""
    while not state.stop.is_set():
        try:
            kind, value = state.fetched.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        if kind == "item":
            try:
                value = place_fetched(state, value, stage=True)
                if not state.cpu:  # the copy overlaps the loop's step, not the loop's next wait
                    jax.block_until_ready(value)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                kind, value = "error", e
        state.queue.put((kind, value))
        if kind != "item":
            return


def _stageable(state: SharedState, leaf: np.ndarray) -> bool:
    """Whether a staged copy of ``leaf`` lets every device block alias it: on CPU, with each block a
    contiguous run of a multiple of ``ALIGNMENT`` bytes of the host array."""
    key = (leaf.shape, leaf.dtype)
    hit = state.plans.get(key)
    if hit is None:
        hit = state.plans[key] = _plan(state, leaf)
    return hit


def _plan(state: SharedState, leaf: np.ndarray) -> bool:
    if not state.cpu or leaf.ndim == 0 or leaf.nbytes == 0:
        return False
    if state.host_input == "global" and not state.sharding.is_fully_addressable:
        return False  # each process puts only its part of the global value: copying all of it would not pay
    total, mine, _ = blocks(state.sharding, leaf.ndim)
    if any(t != 1 for t in total[1:]) or leaf.shape[0] % mine[0]:
        return False  # a split beyond dimension 0 makes blocks non-contiguous; uneven rows raise when placed
    return (leaf.nbytes // mine[0]) % ALIGNMENT == 0
