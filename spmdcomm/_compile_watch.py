"""Which calls compile: the steps and ``spmd`` functions tell whoever watches the calling thread when a call of
theirs traces (and so compiles) its program, so that a watchdog can tell compilation from a stall.

A jitted call compiles synchronously in the calling thread, and only after a cache miss, which starts with a
trace of the function's Python body. So the callers of programs wrap each call in :func:`call`, and the traced
bodies call :func:`tracing` first: the thread's :class:`Listener` (the :class:`~spmdcomm.PhaseTimer` whose phase the
thread is in) hears ``compile_started`` at the first trace and ``compile_ended`` when that call returns. A call
that hits the cache costs two thread-local reads.

>>> class Log:
...     def compile_started(self): print("started")
...     def compile_ended(self): print("ended")
>>> with listening(Log()):
...     with call():
...         tracing()      # what a traced body does first
...         tracing()      # a second trace in the same call (a nested program) says nothing more
started
ended
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

__all__ = ["Listener", "listening", "call", "tracing"]


class Listener(Protocol):
    """What hears of a compilation in the thread it listens to."""

    def compile_started(self) -> None: ...

    def compile_ended(self) -> None: ...


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Makes ``listener`` hear of the compilations of the calls this thread makes inside the block."""
    outer = getattr(_LOCAL, "listener", None)
    _LOCAL.listener = listener
    try:
        yield
    finally:
        _LOCAL.listener = outer


class call:  # noqa: N801 - used like a function: ``with call():``
    """Around one call of a jitted program: the thread's listener hears of its compilation, if it compiles.

    A class, not a generator: it sits on every step's and ``spmd`` call's path (about 0.3 us).
    """

    __slots__ = ("_listener", "_outer", "_pending")

    def __enter__(self) -> None:
        listener: Listener | None = getattr(_LOCAL, "listener", None)
        self._outer = outer = getattr(_LOCAL, "pending", None)
        self._pending: list[Listener] | None = None
        # Nobody listens, or a call made while tracing another (its caller already compiles): nothing to say.
        if listener is not None and outer != []:
            self._listener = listener
            self._pending = _LOCAL.pending = [listener]  # emptied by the first trace

    def __exit__(self, *exc: object) -> None:
        if self._pending is None:
            return
        _LOCAL.pending = self._outer
        if not self._pending:  # this call traced: its listener heard compile_started
            self._listener.compile_ended()


def tracing() -> None:
    """Called first in a traced program body: the call around it compiles (once per call, nested traces included)."""
    pending = getattr(_LOCAL, "pending", None)
    if pending:
        pending.pop().compile_started()


# ---------------------------------------------------------------------------------------------------------

_LOCAL = threading.local()
