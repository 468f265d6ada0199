"""Saves that write in the background (``save_checkpoint(..., asynchronous=True)``): orbax's asynchronous
checkpoint manager behind a :class:`CheckpointSave` handle, at most one save in flight per process, and a process
that never exits with a save still unreported.

Orbax writes the step into a temporary directory and renames it in its background thread once every process has
committed its data, so "latest complete checkpoint" keeps meaning what it means for a synchronous save: a step
directory without the temporary suffix. A save that fails, or a process killed mid-save, leaves the previous one as
the latest; the next writing save removes the temporary directory.

In a job of several processes, orbax's background threads meet at barriers (every process has written its data;
process 0 has renamed the checkpoint; the save is over). Orbax's own barriers wait 20 minutes for a process whose
write failed, since that process never comes. :class:`CommitBarrier` replaces them for each save (orbax's
``AsyncOptions.barrier_sync_fn``): a process whose background save fails records its error in the job's key-value
store, and every process waiting at a barrier of that save raises it at once, naming that process; a process that
has not arrived within the save's timeout is named by the others' error. Either way, the save's later barriers no
longer wait, so each process's :meth:`CheckpointSave.wait` raises within the timeout."""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import thread as _futures_thread  # noqa: F401  (see the end of this module)
from functools import partial
from typing import Any

from spmdcomm.checkpoint._disk import innermost
from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import attempt, coordination_client, key_process

__all__ = [
    "CheckpointSave",
    "CommitBarrier",
    "DEFAULT_SAVE_TIMEOUT",
    "checked_timeout",
    "wait_for_save_in_flight",
    "started",
]

# Seconds an asynchronous save may take in the background, by default: orbax's own default, so that a save that
# completes today still completes; a process whose save fails is reported at once, whatever the timeout.
DEFAULT_SAVE_TIMEOUT = 1200.0


class CheckpointSave:
    """A checkpoint being written in the background, returned by ``save_checkpoint(..., asynchronous=True)``.

    The state's arrays were copied (or, on CPU, referenced: a donating step then allocates new buffers instead of
    reusing them) before :func:`~spmdcomm.save_checkpoint` returned, so training may go on and change the state at
    once. The checkpoint becomes the latest only once every process has written it. As with ``torch.distributed
    .checkpoint.async_save``'s future, an error of the background write is raised by :meth:`wait`, and by the next
    :func:`~spmdcomm.save_checkpoint` of the process; a process that exits with the save still running waits for
    it, and prints its error if it failed.

    Attributes:
      step: the checkpoint's step.
      directory: the checkpoint directory.
    """

    def __init__(
        self, manager: Any, directory: str | os.PathLike[str], step: int, barrier: CommitBarrier | None = None
    ):
        self.step = step
        self.directory = os.fspath(directory)
        self._manager: Any = manager  # None once finished and closed
        self._barrier = barrier  # with several processes: the save's barriers, which know who failed
        self._error: SpmdError | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the background write has ended (completed or failed); never blocks.

        Returns:
          True once :meth:`wait` would return or raise at once.
        """
        manager = self._manager
        return manager is None or not manager.is_saving_in_progress()

    def wait(self) -> int:
        """Blocks until the checkpoint is complete on every process.

        In a job of several processes, a save that fails on one process fails on every process: each one's
        ``wait`` raises, at once when the failing process's background write raised, and at most the save's
        ``timeout`` (``save_checkpoint(..., timeout=)``) after the background write began when a process does not
        finish (a stalled disk, a process that died).

        Returns:
          The step saved.

        Raises:
          SpmdError: naming the step, the directory and the cause, when the background write failed (on every
            call); the previous complete checkpoint then stays the latest. With several processes it names the
            process whose write failed, or those that had not finished within the timeout.
        """
        with self._lock:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                try:
                    manager.wait_until_finished()
                except Exception as e:  # orbax re-raises the background thread's error: OSError, TimeoutError, ...
                    self._error = self._failed(e)
                    self._error.__cause__ = e
                finally:
                    _close(manager)
            if self._error is not None:
                raise self._error
        return self.step

    def _failed(self, e: BaseException) -> SpmdError:
        """The error of a background save that raised ``e``."""
        if self._barrier is None:  # one process
            return _failed(self.directory, self.step, f"failed in the background: {innermost(e)}")
        raised = self._barrier.raised
        if raised is not None and _in_chain(raised, e):  # another process failed, or was late
            return raised
        return self._barrier.failed_here(e)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "writing"
        return f"CheckpointSave(step={self.step}, directory={self.directory!r}, {state})"


def started(save: CheckpointSave) -> CheckpointSave:
    """Records ``save`` as this process's save in flight (the caller waited for the previous one first)."""
    global _in_flight
    with _registry_lock:
        _in_flight = save
    return save


def wait_for_save_in_flight() -> None:
    """Waits for this process's save in flight, if any, and raises its error (once here: it is no longer in flight
    afterwards; its handle's :meth:`CheckpointSave.wait` raises it again).

    Raises:
      SpmdError: when that save failed.
    """
    global _in_flight
    with _registry_lock:
        save, _in_flight = _in_flight, None
    if save is not None:
        save.wait()


def checked_timeout(
    fn: str, timeout: Any, *, asynchronous: bool, names: tuple[str, str] = ("timeout", "asynchronous")
) -> float:
    """``timeout`` (``None``: :data:`DEFAULT_SAVE_TIMEOUT`) once it is a number of seconds > 0 given with
    ``asynchronous``; ``names`` are the two arguments as ``fn`` calls them."""
    arg, flag = names
    if timeout is None:
        return DEFAULT_SAVE_TIMEOUT
    if not asynchronous:
        problem, fix = f"bounds the background part of asynchronous saves, and {flag} is False", f"pass {flag}=True too"
    elif isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        problem, fix = "must be a number of seconds > 0", f"pass e.g. {arg}=600"
    else:
        return float(timeout)
    raise SpmdError(describe(fn, f"{arg}={timeout!r} {problem}.", fix=f"{fix}, or leave {arg} out."))


class CommitBarrier:
    """The barriers of one asynchronous save in a job of several processes: orbax's ``barrier_sync_fn``.

    Orbax calls it from its threads as ``barrier(key=..., timeout_ms=...)``, with the same keys in the same order on
    every process. Each call is a barrier of the job's key-value store, under a prefix of this save's own (the
    processes number their asynchronous saves alike, as they call ``save_checkpoint`` alike). A process whose
    background save fails records its error there: orbax's thread then reaches its next barrier while it handles
    that error (the save's last barriers run in a ``finally``), which is how a failure of any part of the
    background save is seen. Every process waiting at a barrier of the save raises the recorded error; a barrier
    that times out raises naming the processes that did not arrive, and records that too, so that a late process
    raises when it arrives. Once this process has raised or recorded an error, the save's later barriers return at
    once: no process waits for a save that has failed.

    Attributes:
      raised: the error this process's barriers raised (another process failed, or was late), or ``None``.
    """

    def __init__(self, directory: str | os.PathLike[str], step: int, timeout: float):
        self.directory, self.step, self.timeout = os.fspath(directory), step, timeout
        self.prefix = f"spmdcomm/checkpoint/{next(_SAVES)}-{step}/"
        self.raised: SpmdError | None = None
        self._caller = threading.current_thread()  # the thread of save_checkpoint, not one of orbax's
        self._calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._over = False  # this process has raised or recorded an error: the later barriers do not wait

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        failing = sys.exc_info()[1]
        if failing is not None and threading.current_thread() is not self._caller:
            # One of orbax's threads, handling this save's error: this process's background save failed.
            self.fail(failing)
        with self._lock:
            if self._over:
                return
            n = self._calls[key]
            self._calls[key] += 1
        client = coordination_client("save_checkpoint")
        base = f"{self.prefix}barrier/{key.replace('/', '|')}/{n}/"
        me, count = process_index(), process_count()
        client.key_value_set(f"{base}arrived/{me}", "")
        if client.key_value_increment(f"{base}count", 1) == count:
            client.key_value_set(f"{base}done", "")
        deadline, pause, closed = time.monotonic() + timeout_ms / 1000, 0.005, False
        while True:
            if attempt(partial(client.key_value_try_get, f"{base}done"))[0] is not None:
                _forget(client, self.prefix)
                return
            failed = client.key_value_dir_get(f"{self.prefix}failed/")
            if failed:
                break
            if not closed and time.monotonic() >= deadline:
                # Closes the barrier: the count can no longer reach the number of processes, so a process that
                # arrives from now on finds the save failed (and process 0 never renames it complete).
                closed = True
                before = client.key_value_increment(f"{base}count", count + 1) - (count + 1)
                if before < count:  # else every process had arrived (or another one closed it): look again
                    arrived = {key_process(k) for k, _ in client.key_value_dir_get(f"{base}arrived/")}
                    failure = {"missing": [p for p in range(count) if p not in arrived], "barrier": key}
                    self._record(client, failure)
                    failed = [(f"{self.prefix}failed/{me}", json.dumps(failure))]
                    break
            time.sleep(pause)
            pause = min(2 * pause, _POLL)
        with self._lock:
            self._over = True
        self.raised = self.error(failed)
        raise self.raised

    def fail(self, e: BaseException) -> None:
        """Records that this process's save failed with ``e`` (unless it has raised or recorded an error already):
        the processes waiting at a barrier of the save raise it, and this process's later barriers do not wait."""
        with self._lock:
            if self._over:
                return
            self._over = True
        self._record(coordination_client("save_checkpoint"), {"error": innermost(e)})

    def failed_here(self, e: BaseException) -> SpmdError:
        """The error of this process, whose background save raised ``e``: ``e``, and what the other processes
        recorded (a process that waited for this one and timed out names it)."""
        mine = f"{self.prefix}failed/{process_index()}"
        found, _ = attempt(lambda: coordination_client("save_checkpoint").key_value_dir_get(f"{self.prefix}failed/"))
        failed = dict(found or [])
        failed[mine] = json.dumps({"error": innermost(e)})
        return self.error(list(failed.items()))

    def _record(self, client: Any, failure: dict[str, Any]) -> None:
        client.key_value_set(f"{self.prefix}failed/{process_index()}", json.dumps(failure), allow_overwrite=True)

    def error(self, failed: list[tuple[str, str]]) -> SpmdError:
        """The error for the failures ``failed`` (``(key, JSON record)`` pairs) recorded by the processes: each
        one's error, or the processes that had not arrived when one of them timed out."""
        parts = []
        for key, value in sorted(failed, key=lambda kv: key_process(kv[0])):
            failure = json.loads(value)
            if "missing" in failure:
                parts.append(
                    f"did not complete within its timeout of {self.timeout:g} s: process(es) {failure['missing']} "
                    f"had not finished it (process {key_process(key)} waited for them at orbax's barrier "
                    f"{failure['barrier']!r})"
                )
            else:
                parts.append(f"failed in the background on process {key_process(key)}: {failure['error']}")
        return _failed(self.directory, self.step, "; ".join(parts) + f" (seen on process {process_index()})")


def _in_chain(error: BaseException, e: BaseException | None) -> bool:
    """Whether ``error`` is ``e`` or one of its causes or contexts."""
    for _ in range(10):
        if e is None:
            return False
        if e is error:
            return True
        e = e.__cause__ or e.__context__
    return False


def _forget(client: Any, prefix: str) -> None:
    """Deletes the previous asynchronous save's keys, once every process has reached a barrier of the next one (none
    reads them any more); process 0 does it."""
    global _previous
    with _registry_lock:
        previous, _previous = _previous, prefix
    if previous not in (None, prefix) and process_index() == 0:
        attempt(lambda: client.key_value_delete(previous))


def _failed(directory: str, step: int, what: str) -> SpmdError:
    return SpmdError(
        describe(
            "save_checkpoint",
            f"the asynchronous save of checkpoint {step} in {directory!r} {what}. The checkpoint is not complete: the "
            "previous complete "
            "checkpoint stays the latest (the next save removes the unfinished one's temporary directory).",
            fix="check that the directory is writable on every process and the disk has room, and that no process "
            "is stalled (or raise save_checkpoint's timeout for a slow disk); then save again.",
        )
    )


def _close(manager: Any) -> None:
    """Closes an orbax manager whose save has ended; a failure to close is not the save's and is left out."""
    try:
        manager.close()
    except Exception:  # the save's own error, if any, was raised by wait_until_finished already
        pass


def _wait_at_exit() -> None:
    """At interpreter exit: waits for a save still in flight and reports its error, so that it is neither cut short
    nor lost silently."""
    try:
        wait_for_save_in_flight()
    except SpmdError as e:
        print(f"{e} The process exits without this checkpoint.", file=sys.stderr, flush=True)


_registry_lock = threading.Lock()
_in_flight: CheckpointSave | None = None
_SAVES = itertools.count(1)  # this process's asynchronous saves of several processes, numbered alike on every one
_previous: str | None = None  # the key prefix of the latest save whose barriers this process reached
_POLL = 0.25  # seconds between a waiting process's looks at its barrier, at most
# Run where Python's exit runs concurrent.futures' thread pools' exit handler, in reverse order of registration, so
# before it (that module is imported above, so that it registers first): once that has run, orbax's writing threads
# cannot start their tasks and the save fails. Plain atexit handlers run too late, after those threads are joined.
# Both run for a normal exit and an uncaught exception; os._exit and a fatal signal skip them, and leave the previous
# complete checkpoint as the latest.
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_wait_at_exit)
