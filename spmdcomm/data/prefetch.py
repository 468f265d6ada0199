"""Host-to-device prefetch: the next batches are already on the mesh when the step wants them.

Batches from any iterable of NumPy pytrees are placed on the mesh as global ``jax.Array``s split along
dimension 0, following :mod:`spmdcomm.data.placement`'s rule for host input (by default each process yields its
own rows). While the loader is effectively free (its ``next()`` returns at once), the training loop's own
thread places each batch when asked, doing exactly what a synchronous ``jax.device_put`` does: thread
hand-offs would cost more than they could hide. Once the loader is seen to take time, two background
threads take over for good: one waits on the loader while the other places the previous batch, up to
``size`` batches ahead of the loop. On GPU and TPU they also take over once a batch of at least
``THREAD_BYTES`` of host data has been placed: there the copy is real work, which the threads overlap with the
step. ``threads="always"`` or ``"never"`` fixes either way instead.

On CPU, ``jax.device_put`` of a 64-byte aligned, contiguous NumPy array does not copy: the device array
aliases the host memory (measured with JAX 0.10: every shard's ``unsafe_buffer_pointer`` lies inside the
host array, and later writes to the host array show in the device array). A leaf that is already aligned
(see :func:`spmdcomm.data.aligned_empty`) is put as it is, exactly as ``jax.device_put`` would treat it. The
placing thread copies any other leaf into an aligned staging buffer of prefetch's own, which the device arrays
then alias.

Staged memory is reused only once nothing can read it (:mod:`spmdcomm.data.staging` has the rule). On GPU and
TPU, the placing thread puts each host leaf into the devices' pinned host memory (``memory_kind="pinned_host"``,
where the devices have it), moves it to device memory from there and waits for the copy, so the copy overlaps the
previous step. The threads and the placing of one batch are in :mod:`spmdcomm.data.prefetch_threads`.

>>> batches = ({"x": np.full((8, 2), float(i))} for i in range(3))
>>> with sc.prefetch_to_device(batches) as it:
...     print([float(b["x"].sum()) for b in it], it.stats.steps)
[0.0, 16.0, 32.0] 3
"""

from __future__ import annotations

import queue
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import numpy as np
from jax.sharding import Mesh, Sharding

from spmdcomm.data.batches import renamed_keyword
from spmdcomm.data.placement import HostInput, check_host_input
from spmdcomm.data.prefetch_threads import (
    POLL_SECONDS,
    SharedState,
    host_bytes,
    place_fetched,
    start_threads,
    stop,
)
from spmdcomm.data.stats import PrefetchStats
from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.mesh import data_sharding, default_mesh

__all__ = ["prefetch_to_device", "Prefetcher", "Threads", "THREADS"]

Threads = Literal["auto", "always", "never"]
THREADS: tuple[str, ...] = ("auto", "always", "never")

# A loader call slower than this (seconds) counts as slow. Under threads="auto" the loop's thread places batches
# itself until slow calls dominate (a decaying count of them passes SLOW_CALLS), then the threads start.
INLINE_LOAD_SECONDS = 2e-4
SLOW_CALLS = 1.5
# Host bytes of one batch from which, on GPU and TPU, threads="auto" starts the threads whatever the loader's speed:
# the copy to the devices then takes a large part of a step, and the threads overlap it with the step. (On CPU a
# copy competes with the step for the same cores, and aligned batches are not copied at all.)
THREAD_BYTES = 1 << 20
# The clock of the wait statistics and of the slow-loader rule (a manual clock makes that rule testable).
clock = time.perf_counter


def prefetch_to_device(
    iterable: Iterable[Any],
    size: int = 2,
    *,
    mesh: Mesh | None = None,
    axis: str | tuple[str, ...] = "data",
    sharding: Sharding | None = None,
    multiple_of: int | None = None,
    host_input: HostInput = "local",
    threads: Threads = "auto",
    pad_to_multiple: int | None = None,
) -> Prefetcher:
    """Iterates over ``iterable``'s batches placed on the mesh, prefetched up to ``size`` ahead.

    Each batch is a pytree of arrays (dicts, tuples, NamedTuples, :class:`~spmdcomm.MaskedBatch`) with a
    common leading size. Host leaves follow :mod:`spmdcomm.data.placement`'s rule. At most ``size`` batches
    are taken from ``iterable`` ahead of the one the loop has (none while the loop's thread places batches
    itself). An exception in ``iterable`` is raised in the loop with its original traceback, and so is a
    placement error (those of :func:`spmdcomm.shard_batch`), at the batch that causes it. Stop early with
    ``break`` plus :meth:`Prefetcher.close`, a ``with`` block, or by dropping the iterator: the threads end.
    Time the loop spent waiting for data is in :attr:`Prefetcher.stats`.

    As with ``jax.device_put``, a 64-byte aligned, contiguous NumPy leaf may be aliased on CPU rather
    than copied: the loader must not write into an array after yielding it (allocate a fresh one per
    batch, e.g. with :func:`spmdcomm.data.aligned_empty`). Unaligned leaves are copied, so their memory may be reused.
    ``jax.Array`` leaves are passed on (moved only if their sharding differs).

    Args:
      iterable: the batches, any iterable of pytrees of arrays.
      size: the most batches taken ahead of the loop, an int >= 1 (default 2, double buffering).
      mesh: the mesh to place on (default :func:`spmdcomm.default_mesh`); unused when ``sharding`` is given.
      axis: the mesh axis, or tuple of axes, that dimension 0 is split over (default ``"data"``).
      sharding: one ``Sharding`` for every leaf, in place of ``mesh`` and ``axis`` (default ``None``: split
        dimension 0 over ``axis`` of ``mesh``).
      multiple_of: ``k`` pads every batch to a multiple of ``k`` examples (as :func:`spmdcomm.pad_batch`
        does) and yields :class:`~spmdcomm.MaskedBatch` es (use this process's device count along the axis
        to accept any batch size); ``None`` (default) pads nothing.
      host_input: ``"local"`` (default): each process's loader yields its own rows; ``"global"``: every
        process yields the whole batch.
      threads: who fetches and places: ``"auto"`` (default) the loop's thread while the loader is
        effectively free, two background threads for good once its calls take time (on GPU and TPU, also once a
        batch holds ``THREAD_BYTES`` of host data); ``"always"`` the threads from the start; ``"never"`` the loop's
        thread, always.
      pad_to_multiple: the old spelling of ``multiple_of``, accepted with a ``DeprecationWarning`` until the
        next release.

    Returns:
      A :class:`Prefetcher`: an iterator over the placed batches, and a context manager that stops its
      threads.

    Raises:
      SpmdError: when ``size``, ``multiple_of``, ``host_input`` or ``threads`` is invalid, or both spellings
        of ``multiple_of`` are given.
      AxisError: when ``axis`` names an axis that ``mesh`` does not have.

    Examples:
      >>> batches = ({"x": np.arange(6.0)} for _ in range(2))
      >>> with sc.prefetch_to_device(batches, multiple_of=8) as it:
      ...     print([(b.data["x"].shape, int(b.mask.sum())) for b in it])
      [((8,), 6), ((8,), 6)]
    """
    check_host_input("prefetch_to_device", host_input)
    if threads not in THREADS:
        raise SpmdError(
            describe(
                "prefetch_to_device",
                f"threads={threads!r} is not one of {THREADS}.",
                fix="leave the default 'auto' (threads start once the loader takes time), or force 'always' / 'never'.",
            )
        )
    size = int(size)
    if size < 1:
        raise SpmdError(
            describe(
                "prefetch_to_device",
                f"size={size} must be at least 1.",
                fix="use 2 (double buffering) unless measurements say otherwise.",
            )
        )
    multiple_of = renamed_keyword("prefetch_to_device", "pad_to_multiple", pad_to_multiple, "multiple_of", multiple_of)
    if multiple_of is not None and (
        isinstance(multiple_of, bool) or not isinstance(multiple_of, (int, np.integer)) or multiple_of < 1
    ):
        raise SpmdError(
            describe(
                "prefetch_to_device",
                f"multiple_of={multiple_of!r} must be a positive int.",
                fix="pass the number of devices along the data axis.",
            )
        )
    if sharding is None:
        sharding = data_sharding(mesh=default_mesh() if mesh is None else mesh, axis=axis)
    return Prefetcher(iter(iterable), size, sharding, multiple_of, host_input, threads=threads)


class Prefetcher(Iterator[Any]):
    """The iterator :func:`prefetch_to_device` returns; also a context manager that stops its threads.

    Annotate with ``spmdcomm.data.Prefetcher``: it is not an ``sc`` name, and is built by that function only,
    which checks the arguments. ``stats`` holds the loop's waits for data (:class:`PrefetchStats`).

    Args:
      source: the iterator of host batches.
      size: the most batches taken ahead of the loop, an int >= 1.
      sharding: the ``Sharding`` of every leaf.
      multiple_of: pads every batch to a multiple of this many examples; ``None`` pads nothing.
      host_input: ``"local"`` or ``"global"``, as in :func:`prefetch_to_device`.
      threads: ``"auto"`` (default), ``"always"`` or ``"never"``, as in :func:`prefetch_to_device`.
    """

    def __init__(
        self,
        source: Iterator[Any],
        size: int,
        sharding: Sharding,
        multiple_of: int | None,
        host_input: HostInput,
        *,
        threads: Threads = "auto",
    ):
        self.stats = PrefetchStats()
        self._state = SharedState(source, size, sharding, multiple_of, host_input)
        self._slow_calls = 0.0  # decaying count of slow loader calls while placing in-line
        # The threads hold only the state, never this object, so dropping the iterator stops them.
        self._finalizer = weakref.finalize(self, stop, self._state)
        self._auto = threads == "auto"  # the loop's thread may hand over to the threads
        if threads == "always":
            start_threads(self._state)

    def __next__(self) -> Any:
        if self._state.threads:
            return self._next_from_threads()
        return self._next_inline()

    def close(self) -> None:
        """Stops the producer threads and waits (up to ``CLOSE_TIMEOUT`` s in all) for them to end."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        """Whether a producer thread is still running."""
        return any(thread.is_alive() for thread in self._state.threads)

    @property
    def threaded(self) -> bool:
        """Whether background threads fetch and place the batches (else the loop's thread does)."""
        return bool(self._state.threads)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_inline(self) -> Any:
        state = self._state
        if state.finished:
            raise StopIteration
        start = clock()
        try:
            batch = next(state.source)
            loaded = clock()
            placed = place_fetched(state, batch, stage=False)
        except BaseException:
            self.close()
            raise
        self.stats.record(clock() - start)
        self._slow_calls = 0.75 * self._slow_calls + (loaded - start > INLINE_LOAD_SECONDS)
        if self._auto and (self._slow_calls > SLOW_CALLS or (not state.cpu and host_bytes(batch) >= THREAD_BYTES)):
            start_threads(state)
        return placed

    def _next_from_threads(self) -> Any:
        state = self._state
        start = clock()
        while True:
            if state.finished:
                raise StopIteration
            try:
                kind, value = state.queue.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if not self.alive and state.queue.empty():
                    state.finished = True
        if kind == "item":
            state.slots.release()
            self.stats.record(clock() - start)
            return value
        self.close()
        if kind == "error":
            raise value
        raise StopIteration
