"""Saves that write in the background (``save_checkpoint(..., asynchronous=True)``): orbax's asynchronous
checkpoint manager behind a :class:`CheckpointSave` handle, at most one save in flight per process, and a process
that never exits with a save still unreported.

Orbax writes the step into a temporary directory and renames it in its background thread once every process has
committed its data, so "latest complete checkpoint" keeps meaning what it means for a synchronous save: a step
directory without the temporary suffix. A save that fails, or a process killed mid-save, leaves the previous one as
the latest; the next writing save removes the temporary directory."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from concurrent.futures import thread as _futures_thread  # noqa: F401  (see the end of this module)
from typing import Any

from spmdcomm.checkpoint._disk import innermost
from spmdcomm.errors import SpmdError, describe

__all__ = ["CheckpointSave", "wait_for_save_in_flight", "started"]


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

    def __init__(self, manager: Any, directory: str | os.PathLike[str], step: int):
        self.step = step
        self.directory = os.fspath(directory)
        self._manager: Any = manager  # None once finished and closed
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

        Returns:
          The step saved.

        Raises:
          SpmdError: naming the step, the directory and the cause, when the background write failed (on every
            call); the previous complete checkpoint then stays the latest.
        """
        with self._lock:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                try:
                    manager.wait_until_finished()
                except Exception as e:  # orbax re-raises the background thread's error: OSError, TimeoutError, ...
                    self._error = _failed(self.directory, self.step, e)
                    self._error.__cause__ = e
                finally:
                    _close(manager)
            if self._error is not None:
                raise self._error
        return self.step

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


def _failed(directory: str, step: int, e: BaseException) -> SpmdError:
    return SpmdError(
        describe(
            "save_checkpoint",
            f"the asynchronous save of checkpoint {step} in {directory!r} failed in the background: "
            f"{innermost(e)}. The checkpoint is not complete: the previous complete "
            "checkpoint stays the latest (the next save removes the unfinished one's temporary directory).",
            fix="check that the directory is writable on every process and the disk has room; then save again.",
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
# Run where Python's exit runs concurrent.futures' thread pools' exit handler, in reverse order of registration, so
# before it (that module is imported above, so that it registers first): once that has run, orbax's writing threads
# cannot start their tasks and the save fails. Plain atexit handlers run too late, after those threads are joined.
# Both run for a normal exit and an uncaught exception; os._exit and a fatal signal skip them, and leave the previous
# complete checkpoint as the latest.
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_wait_at_exit)
