"""A loader over any iterable of host batches: Grain's loaders and datasets, tf.data, a torch ``DataLoader``, a
generator. What ``fit`` saves of such a source, and how a checkpoint puts it back where it was.

A Grain iterator (``iter(grain.DataLoader(...))``, ``iter(grain.MapDataset/IterDataset ...)``, any
``DatasetIterator``) carries its own position: ``get_state()`` / ``set_state()``. :class:`IteratorLoader` records
that state as each batch reaches the loop (not as prefetch fetches it), so a checkpoint names exactly the batches
its state has not trained on, and restoring it puts the iterator back there. An iterator without them cannot be
put back; with ``resume="skip"`` a restart reads and drops the batches already trained on, which is exact only when
the script builds the same stream of batches on every start.

>>> class Counter:  # stands in for a Grain iterator: get_state / set_state
...     def __init__(self): self.i = 0
...     def __iter__(self): return self
...     def __next__(self):
...         if self.i == 5: raise StopIteration
...         self.i += 1; return {"x": np.full(2, float(self.i))}
...     def get_state(self): return {"i": self.i}
...     def set_state(self, state): self.i = state["i"]
>>> loader = sc.IteratorLoader(Counter())
>>> it = iter(loader); _ = next(it); _ = next(it)
>>> loader.state_dict()
{'batches': 2, 'iterator': {'i': 2}}
>>> again = sc.IteratorLoader(Counter())
>>> again.load_state_dict(loader.state_dict())
>>> [float(b["x"][0]) for b in again]
[3.0, 4.0, 5.0]
"""

from __future__ import annotations

import collections
import copy
import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from jax.sharding import Mesh

from spmdcomm.data.placement import HostInput, check_host_input
from spmdcomm.data.prefetch import Threads, prefetch_to_device
from spmdcomm.data.stats import PrefetchStats
from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import exchange

__all__ = ["IteratorLoader", "Resume", "as_resumable", "saved_position", "restore_position"]

Resume = Literal["state", "skip"]
RESUMES: tuple[str, ...] = ("state", "skip")


class IteratorLoader:
    """A loader over any iterable of host batches (Grain, tf.data, torch, a generator), resumable where it can be.

    Iterating yields the source's batches, placed on the mesh ``prefetch`` batches ahead (as
    :func:`spmdcomm.prefetch_to_device` places them) or, with ``prefetch=0``, as they come (the train step places
    them). The source is iterated once: a later pass goes on where the previous one stopped (for an iterator with
    ``set_state``, at the first batch not handed out; otherwise batches prefetched ahead and not handed out are
    lost). ``state_dict()`` is the position of the next batch the loop has not received: the number of batches
    handed out and, when the source's iterator has ``get_state()`` and ``set_state()`` (every Grain iterator), its
    state after the last of them. :func:`spmdcomm.fit` with a ``checkpoint_dir`` saves it beside the train state
    (every process's: with ``grain.sharding.ShardByJaxProcess`` each process reads its own shard) and restores it.

    What resumes: with ``resume="state"`` (default) a source whose iterator has ``get_state`` / ``set_state``,
    exactly, mid-epoch included; any other source only from its start (``fit`` with a ``checkpoint_dir`` refuses
    it, and :meth:`load_state_dict` of a position past batch 0 raises). With ``resume="skip"``, any source: a
    restart reads and drops the batches already handed out, which gives exactly the saved run's next batches
    only if the script builds the same stream on every start (a fixed seed, the same files and order) and costs
    reading them again.

    Args:
      source: an iterable of host batches (pytrees of arrays with a common leading size): a
        ``grain.DataLoader``, ``grain.MapDataset``, ``grain.IterDataset``, a Grain ``DatasetIterator``, a
        ``tf.data`` dataset's ``as_numpy_iterator()``, a torch ``DataLoader`` yielding NumPy arrays, a generator.
      prefetch: ``k >= 1`` places batches ``k`` ahead through :func:`spmdcomm.prefetch_to_device`; 0 (default)
        yields host batches (the train step places them).
      mesh: the mesh batches are placed on (default :func:`spmdcomm.default_mesh`); used with ``prefetch >= 1``.
      axis: the mesh axis (or axes) dimension 0 is split over (default ``"data"``).
      host_input: ``"local"`` (default): each process's source yields its own rows (its shard); ``"global"``:
        every process yields the whole global batch. Needs ``prefetch >= 1`` (else pass it to the train step).
      threads: who fetches and places the batches, passed to :func:`spmdcomm.prefetch_to_device` (default
        ``"auto"``).
      resume: how a saved position is restored: ``"state"`` (default) through the iterator's own
        ``set_state``; ``"skip"`` by reading and dropping the batches already handed out.

    Raises:
      SpmdError: when ``source`` is not iterable, ``prefetch`` is not an int >= 0, ``resume`` is not ``"state"``
        or ``"skip"``, or ``host_input="global"`` comes with ``prefetch=0``.

    Examples:
      >>> loader = sc.IteratorLoader(({"x": np.arange(4.0)} for _ in range(3)), resume="skip")
      >>> [b["x"].shape for b in loader], loader.state_dict()
      ([(4,), (4,), (4,)], {'batches': 3, 'iterator': None})
    """

    def __init__(
        self,
        source: Iterable[Any],
        *,
        prefetch: int = 0,
        mesh: Mesh | None = None,
        axis: str | tuple[str, ...] = "data",
        host_input: HostInput = "local",
        threads: Threads = "auto",
        resume: Resume = "state",
    ):
        if not callable(getattr(source, "__iter__", None)):
            raise SpmdError(describe("IteratorLoader", f"source is a {type(source).__name__}, which is not iterable."))
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise SpmdError(describe("IteratorLoader", f"prefetch={prefetch!r} must be an int >= 0."))
        if resume not in RESUMES:
            raise SpmdError(describe("IteratorLoader", f"resume={resume!r} is not one of {RESUMES}."))
        if check_host_input("IteratorLoader", host_input) != "local" and not prefetch:
            raise SpmdError(
                describe(
                    "IteratorLoader",
                    f"host_input={host_input!r} with prefetch=0: the loader places nothing.",
                    fix=f"pass prefetch=2, or host_input={host_input!r} to make_train_step.",
                )
            )
        self.source = source
        self.prefetch = prefetch
        self.mesh = mesh
        self.axis = axis
        self.host_input = host_input
        self.threads = threads
        self.resume = resume
        self.stats: PrefetchStats | None = None  # the latest pass's waits for data (None without prefetch)
        self._iterator: Iterator[Any] | None = None  # made on first use: a Grain loader starts its workers then
        self._batches = 0  # batches handed out
        self._state: Any = None  # the iterator's state after the last of them (None: not recorded yet)
        self._rewind = False  # whether the iterator has moved past _state (prefetched batches not handed out)

    @property
    def resumable(self) -> bool:
        """Whether a saved position can be restored.

        True with ``resume="skip"``, or for an iterator with ``get_state`` and ``set_state``. Makes the source's
        iterator when there is none yet.
        """
        return self.resume == "skip" or _has_state(self._source_iterator())

    def __iter__(self) -> Iterator[Any]:
        source = self._source_iterator()
        keeps_state = _has_state(source)
        if keeps_state and self._rewind:  # the last pass prefetched batches it never handed out: back to the position
            source.set_state(copy.deepcopy(self._state))  # type: ignore[attr-defined]
        elif keeps_state and self._state is None:
            self._state = copy.deepcopy(source.get_state())  # type: ignore[attr-defined]
        self._rewind = False
        states: collections.deque[Any] = collections.deque()  # appended as batches are fetched, read as they arrive
        batches: Iterator[Any] = _recorded(source, states if keeps_state else None)
        if self.prefetch:
            placed = prefetch_to_device(
                batches, self.prefetch, mesh=self.mesh, axis=self.axis, host_input=self.host_input, threads=self.threads
            )
            self.stats, batches = placed.stats, placed
        try:
            for item in batches:
                # Moved before the hand-over: from here on the caller holds this batch.
                self._batches += 1
                if keeps_state:
                    self._state = states.popleft()
                yield item
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # closes the wrapper around the source, not the source: a later pass goes on from here
            self._rewind = bool(states)

    def state_dict(self) -> dict[str, Any]:
        """This process's position: the batches handed out, and the iterator's state after the last of them.

        Returns:
          A new JSON-serialisable dict ``{"batches": n, "iterator": state}``; ``state`` is what the iterator's
          ``get_state()`` returned (bytes, as a Grain ``DataLoader``'s iterator returns them, become
          ``{"bytes": text}``), or ``None`` for an iterator without ``get_state``.

        Raises:
          SpmdError: when the iterator's state is neither bytes nor something JSON stores unchanged.
        """
        return {"batches": self._batches, "iterator": _encoded(self._state)}

    def load_state_dict(self, state: Any) -> None:
        """Moves the source to ``state`` (as :meth:`state_dict` returns it).

        With ``resume="state"`` the iterator's ``set_state`` gets the saved state; with ``resume="skip"`` the
        batches already handed out are read and dropped (on a loader that has handed out none).

        Args:
          state: a dict ``{"batches", "iterator"}`` that :meth:`state_dict` returned.

        Raises:
          SpmdError: when ``state`` is not such a dict; with ``resume="state"``, when the iterator has no
            ``set_state`` and ``state`` is past batch 0, or has no iterator state; with ``resume="skip"``, when
            this loader has already handed out batches or the source ends before the saved position.
        """
        batches = _checked_position(state)
        source = self._source_iterator()
        if self.resume == "skip":
            self._skip(source, batches)
        elif _has_state(source) and state["iterator"] is not None:
            decoded = _decoded(state["iterator"])
            source.set_state(decoded)  # type: ignore[attr-defined]
            self._state, self._rewind = copy.deepcopy(decoded), False
        elif batches:
            raise SpmdError(
                describe(
                    "IteratorLoader.load_state_dict",
                    f"the position is {batches} batches in, but the source's iterator (a "
                    f"{type(source).__name__}) has no get_state() / set_state(), so it cannot be moved there; "
                    "starting it from the beginning would train on those batches twice.",
                    fix="use a source that keeps its state (a Grain DataLoader or dataset, or sc.Loader), or pass "
                    "resume='skip' if the script builds the same batches in the same order on every start.",
                )
            )
        self._batches = batches

    def _source_iterator(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self.source)
        return self._iterator

    def _skip(self, source: Iterator[Any], batches: int) -> None:
        if self._batches:
            raise SpmdError(
                describe(
                    "IteratorLoader.load_state_dict",
                    f"resume='skip' restores a position by reading the source from its start, but this loader has "
                    f"already handed out {self._batches} batches.",
                    fix="call load_state_dict on a new IteratorLoader over a new source.",
                )
            )
        got = sum(1 for _ in itertools.islice(source, batches))
        if got < batches:
            raise SpmdError(
                describe(
                    "IteratorLoader.load_state_dict",
                    f"the position is {batches} batches in, but the source ended after {got}: it yields other "
                    "batches than the run that saved the position.",
                    fix="build the same source as that run (the same data, seed and epochs).",
                )
            )


def as_resumable(data: Any) -> Any:
    """``data`` itself when it has ``state_dict`` and ``load_state_dict``; an :class:`IteratorLoader` (no prefetch)
    over it when its iterator has ``get_state`` and ``set_state`` (a Grain loader, dataset or iterator); else
    ``None``.

    Args:
      data: what ``fit`` was given to train on.

    Returns:
      A source ``fit`` can save and restore the position of, or ``None``.
    """
    if all(callable(getattr(data, name, None)) for name in ("state_dict", "load_state_dict")):
        return data
    if not callable(getattr(data, "__iter__", None)) or isinstance(data, (list, tuple)):
        return None
    loader = IteratorLoader(data)
    return loader if loader.resumable else None


def saved_position(data: Any) -> dict[str, Any]:
    """The data position ``fit`` saves with a checkpoint: ``data.state_dict()``, or for an :class:`IteratorLoader`
    every process's, gathered (each process reads its own shard). Every process must call it alike.

    Args:
      data: the source ``fit`` trains on (from :func:`as_resumable`).

    Returns:
      ``data.state_dict()``, or ``{"processes": [position of process 0, ...]}`` for an :class:`IteratorLoader`.
    """
    mine = data.state_dict()
    if not isinstance(data, IteratorLoader):
        return mine
    if process_count() == 1:
        return {"processes": [mine]}
    gathered = exchange("fit", "fit: the processes' data positions", json.dumps(mine).encode())
    return {"processes": [json.loads(p) for p in gathered]}


def restore_position(data: Any, position: Any) -> None:
    """Moves ``data`` to ``position`` (as :func:`saved_position` returned it): this process's, for an
    :class:`IteratorLoader`.

    Args:
      data: the source ``fit`` trains on (from :func:`as_resumable`).
      position: the position saved with the checkpoint.

    Raises:
      SpmdError: when ``position`` was saved by another kind of source or by another number of processes.
    """
    if not isinstance(data, IteratorLoader):
        data.load_state_dict(position)
        return
    saved = position.get("processes") if isinstance(position, dict) else None
    if not isinstance(saved, list):
        raise SpmdError(
            describe(
                "fit",
                f"the checkpoint's data position {position!r} was not saved from an IteratorLoader (or a Grain "
                "source), so it cannot move this one.",
                fix="resume with the kind of data source the checkpoint was saved with.",
            )
        )
    if len(saved) != process_count():
        raise SpmdError(
            describe(
                "fit",
                f"the checkpoint's data positions were saved by {len(saved)} processes, and this job has "
                f"{process_count()}: each process's iterator state belongs to its own shard of the data.",
                fix=f"resume with {len(saved)} processes (or from a checkpoint saved with {process_count()}).",
            )
        )
    data.load_state_dict(saved[process_index()])


# ---------------------------------------------------------------------------------------------------------


def _has_state(iterator: Any) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))


def _recorded(source: Any, states: collections.deque[Any] | None) -> Iterator[Any]:
    """``source``'s batches; after fetching each, its iterator state is appended to ``states`` (a copy: the
    iterator may change the object it returned), so that prefetching ahead never moves the saved position. A
    generator of its own, so that closing it leaves ``source`` open for the next pass."""
    for batch in source:
        if states is not None:
            states.append(copy.deepcopy(source.get_state()))
        yield batch


def _encoded(state: Any) -> Any:
    if isinstance(state, bytes):
        return {"bytes": state.decode()}  # a Grain DataLoader's iterator state: UTF-8 JSON text
    try:
        ok = json.loads(json.dumps(state)) == state
    except (TypeError, ValueError):
        ok = False
    if not ok or (isinstance(state, dict) and set(state) == {"bytes"}):
        raise SpmdError(
            describe(
                "IteratorLoader.state_dict",
                f"the iterator's get_state() returned {state!r}, which a checkpoint cannot store as JSON.",
                fix="use an iterator whose state is bytes or JSON data (every Grain iterator's is), or resume='skip'.",
            )
        )
    return state


def _decoded(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {"bytes"}:
        return state["bytes"].encode()
    return state


def _checked_position(state: Any) -> int:
    """The batch count of ``state``, once it is an :class:`IteratorLoader` position."""
    batches = state.get("batches") if isinstance(state, dict) else None
    if set(state if isinstance(state, dict) else ()) != {"batches", "iterator"} or not (
        isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0
    ):
        raise SpmdError(
            describe(
                "IteratorLoader.load_state_dict",
                f"state={state!r} is not an IteratorLoader position.",
                fix='pass what IteratorLoader.state_dict() returned: {"batches": int, "iterator": ...}.',
            )
        )
    return batches
