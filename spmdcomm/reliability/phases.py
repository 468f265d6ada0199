"""Where each step's time goes: seconds per phase (waiting for data, dispatching, waiting for devices, ...).

A :class:`PhaseTimer` is driven by the training loop: ``with timer.phase("data"):`` around each part of a step,
then ``timer.end_step(step)``, which returns the seconds each phase took in that step. Time spent outside any
phase counts as ``"other"``, so a step's phases add up to its wall time. The timer is also what
:class:`spmdcomm.Watchdog` watches: the current phase, when it began and the last completed step.

>>> import spmdcomm as sc
>>> timer = sc.PhaseTimer()
>>> with timer.phase("data"):
...     batch = list(range(4))
>>> with timer.phase("dispatch"):
...     total = sum(batch)
>>> times = timer.end_step(0)
>>> sorted(times) == sorted(sc.reliability.PHASES)
True
>>> timer.snapshot().step
0
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from spmdcomm import _compile_watch
from spmdcomm.errors import SpmdError, describe

__all__ = [
    "PhaseTimer",
    "Progress",
    "PHASES",
    "PHASE_DESCRIPTIONS",
    "WAITING_PHASES",
    "COMPILE_PHASE",
]

# The phases of a training step, in the order a step passes through them, and what each one means. A loop may
# time other phases too (any name); these are the ones the training loop and the watchdog know.
PHASE_DESCRIPTIONS: dict[str, str] = {
    "data": "waiting for data",
    "compile": "compiling",
    "dispatch": "dispatching",
    "devices": "waiting for devices",
    "sync": "in a barrier",
    "save": "saving",
    "hooks": "in a hook (evaluation, logging)",
    "other": "outside any phase",
}
PHASES: tuple[str, ...] = tuple(PHASE_DESCRIPTIONS)
# Phases in which a process waits for the other processes: when a job hangs, a process in one of these is
# more likely a victim than the cause (the watchdog names the others first). A checkpoint save is one: every
# process saves the same step and meets the others at the save's barriers.
WAITING_PHASES: frozenset[str] = frozenset({"devices", "sync", "save"})
# The phase of a call that traces and compiles its program. The train and eval steps and spmd functions report
# it themselves (inside whichever phase their call is in); a loop may time its own compilations as this phase too.
COMPILE_PHASE = "compile"

_OTHER = "other"


class Progress(NamedTuple):
    """What a :class:`PhaseTimer` last saw, as one immutable record (safe to read from another thread)."""

    step: int | None  # the last completed step (None before the first)
    phase: str  # the phase the loop is in now
    phase_start: float  # when it entered that phase, on the timer's clock
    phase_start_wall: float  # the same moment as time.time(), comparable across processes
    step_start: float  # when the last step completed (or the timer started), on the timer's clock
    thread: int  # threading.get_ident() of the thread that drives the timer
    compile_end: float | None = None  # when the last compile phase ended, on the timer's clock (None: none yet)
    compile_end_wall: float | None = None  # the same moment as time.time()


class PhaseTimer:
    """Seconds per phase of each step, for the metrics and for the watchdog.

    One thread, the training loop, drives a timer; any thread may call :meth:`snapshot`. Cost: two clock reads
    and a few attribute writes per phase change (about a microsecond).

    Compilation is a phase of its own, ``"compile"``: a train or eval step, or an ``sc.spmd`` function, called
    inside a phase block of this timer and compiling its program (its first call, a new batch shape, ...) counts
    the time from the start of its trace to the end of that call as ``"compile"``, then the block's phase
    resumes. :class:`~spmdcomm.Watchdog` gives that phase its own allowance.

    Args:
      clock: the monotonic clock in seconds, also the clock of :meth:`snapshot`'s times (``time.monotonic`` by
        default; tests pass a manual one).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # the clock of snapshot()'s times
        now = clock()
        self._compiling_in = _OTHER  # the phase a compilation interrupted
        self._seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._progress = Progress(None, _OTHER, now, time.time(), now, threading.get_ident())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Counts the time inside the block as phase ``name`` (nested blocks count for the innermost phase).

        Args:
          name: one of :data:`PHASES` or a non-empty name of your own (e.g. ``"eval"``), which becomes a key of
            :meth:`end_step`'s result.

        Raises:
          SpmdError: when ``name`` is not a non-empty str.
        """
        if not isinstance(name, str) or not name:
            raise SpmdError(
                describe(
                    "PhaseTimer.phase",
                    f"name={name!r} is not a phase name.",
                    fix=f"pass one of {list(PHASES)} or a non-empty name of your own, e.g. 'eval'.",
                )
            )
        outer = self._progress.phase
        self._switch(name)
        try:
            with _compile_watch.listening(self):
                yield
        finally:
            self._switch(outer)

    def end_step(self, step: int) -> dict[str, float]:
        """Marks step ``step`` as completed and returns the seconds each phase took since the previous step.

        Args:
          step: the index of the step that just completed, an int >= 0.

        Returns:
          Phase name to seconds: every phase of :data:`PHASES` is a key (0.0 when unused), plus the names of
          your own phases used in this step; the values add up to the step's wall time.

        Raises:
          SpmdError: when ``step`` is not an int >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SpmdError(
                describe(
                    "PhaseTimer.end_step",
                    f"step={step!r} is not a step number.",
                    fix="pass the index of the step that just completed, an int >= 0.",
                )
            )
        self._switch(self._progress.phase)  # books the current phase's time up to now into this step
        times, self._seconds = self._seconds, dict.fromkeys(PHASES, 0.0)
        self._progress = self._progress._replace(step=step, step_start=self._progress.phase_start)
        return times

    def snapshot(self) -> Progress:
        """The last completed step, the current phase and when it began (callable from any thread).

        Returns:
          An immutable ``Progress`` record: ``step`` (None before the first), ``phase``, ``phase_start`` and
          ``step_start`` on the timer's clock, ``phase_start_wall`` as ``time.time()``, ``thread``, the id
          of the thread that drives the timer, and ``compile_end`` / ``compile_end_wall``, when the last
          ``"compile"`` phase ended (None before one did).
        """
        return self._progress

    def compile_started(self) -> None:
        """A call inside one of this timer's phase blocks began compiling: the ``"compile"`` phase starts."""
        self._compiling_in = self._progress.phase
        self._switch(COMPILE_PHASE)

    def compile_ended(self) -> None:
        """That call returned: the phase it was called in resumes."""
        self._switch(self._compiling_in)

    def _switch(self, name: str) -> None:
        now, wall = self.clock(), time.time()
        p = self._progress
        self._seconds[p.phase] = self._seconds.get(p.phase, 0.0) + (now - p.phase_start)
        ended = (
            (now, wall) if p.phase == COMPILE_PHASE and name != COMPILE_PHASE else (p.compile_end, p.compile_end_wall)
        )
        # One assignment of an immutable record: a reader in another thread sees the old or the new state,
        # never a mix.
        self._progress = Progress(p.step, name, now, wall, p.step_start, threading.get_ident(), *ended)
