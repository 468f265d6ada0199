"""A watchdog that ends a stuck job, naming the process that holds it up, so that it can be restarted.

A multi-process job hangs as a whole: when one process stops making progress (a data loader that never
returns, a deadlock, a lost device), the others wait for it inside a device collective that has no timeout.
:class:`Watchdog` watches the :class:`~spmdcomm.PhaseTimer` of the training loop. When no step completes
within ``timeout`` seconds, every process prints one table - process, host, last completed step, phase and
seconds in that phase - that marks the stuck process(es), and exits with :data:`STUCK_EXIT_CODE`, which
``spmdcomm-launch --max-restarts`` (or the scheduler) answers with a restart from the last checkpoint.

**Why it ends the process.** A training thread blocked inside an XLA collective cannot be unwound from Python
(torch's NCCL watchdog aborts the process for the same reason), so ``on_stuck="exit"``, the default, ends it
through :func:`exit_stuck_process`: the one place spmdcomm ends the interpreter. ``on_stuck="raise"`` instead
raises :class:`StuckStepError` in the training thread (Python's asynchronous exceptions: it arrives when that
thread next runs Python code, so a thread stuck inside a device call never sees it), and a callable receives
the error and decides.

How it works, and what it costs:

- Each process runs two daemon threads. A *monitor* reads the timer's snapshot every ``interval`` seconds and
  needs nothing else, so it acts even when the training thread never returns (blocked in Python, or in a
  device collective: such waits release the GIL) and when the coordination service cannot be reached.
- A *publisher* writes the process's state (last step, phase, when it began) to the coordination service's
  key-value store when it changed, and reads an alarm key, once per ``interval``: at most two small RPCs
  per ``interval``. The training thread itself never waits for the service. (No call blocks for long: a
  daemon thread inside a blocking call when Python exits would abort the process.)
- Compilation is not a stall. The steps report it as the timer's ``"compile"`` phase, timed against
  ``compile_timeout``; a step's timeout counts from the end of its compilation, and a process over its timeout
  first reads the others' states (one directory read per ``interval`` while it is over): while one of them
  compiles, or finished compiling less than ``timeout`` ago, it waits for that process, not for a stall. A job
  resumed after a preemption recompiles for minutes on every process, each at its own speed.
- The first process whose step exceeds the timeout sets the alarm and reads every process's state (one
  directory read); the others see the alarm within ``interval`` and do the same. Each prints the table (with the stack
  of its own training thread), the processes meet at a barrier bounded by a few seconds, and every process
  does what its ``on_stuck`` says (by default it ends with ``os._exit``, which works from any thread). Waits
  for the service are bounded (by ``_SERVICE_SECONDS`` and ``_EXIT_SECONDS``): a process that cannot reach it
  prints its own row only and still acts, within ``timeout + interval + 6`` seconds of its last completed step.

Which processes are stuck (:func:`~spmdcomm.reliability.verdicts.stuck_processes`): those that never reported
their state, then those that stopped in their own work for at least half the timeout: a phase that does not wait
for the others (waiting for data, a hook, your code), or a host callback that has not returned (found in the
process's thread stacks: :mod:`spmdcomm.reliability.threads`); never one that waits for devices, in a barrier, in
a save or in a blocked dispatch. When every process waits, all of them (a hang inside the devices). Each row of
the table says what the process is doing, for how long, and its verdict: why it is stuck, or whom it waits for.

>>> import spmdcomm as sc
>>> timer = sc.PhaseTimer()
>>> with sc.Watchdog(timer, timeout=600):
...     for step in range(3):
...         with timer.phase("dispatch"):
...             pass
...         _ = timer.end_step(step)
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, NoReturn

from spmdcomm.errors import DistributedError, SpmdError, describe
from spmdcomm.reliability.phases import COMPILE_PHASE, PhaseTimer
from spmdcomm.reliability.threads import HostCallbacks, stack_of
from spmdcomm.reliability.verdicts import (
    ProcessState,
    compiling_process,
    describe_stuck,
    format_table,
    overdue,
    seconds_since,
    states_from_entries,
    stuck_processes,
)
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import attempt, coordination_client, milliseconds

__all__ = [
    "Watchdog",
    "StuckStepError",
    "STUCK_EXIT_CODE",
    "DEFAULT_COMPILE_TIMEOUT",
    "exit_stuck_process",
]

# The exit status of every process of a job the watchdog ends: EX_TEMPFAIL of sysexits.h, "a temporary
# failure; retrying may succeed".
STUCK_EXIT_CODE = 75

# Seconds a compilation may take before the watchdog calls it stuck: XLA compiles a large model's step in minutes
# (and again after every restart), so the allowance is far above any step's; it still ends a compiler that hangs.
DEFAULT_COMPILE_TIMEOUT = 1800.0


OnStuck = Literal["exit", "raise"] | Callable[["StuckStepError"], Any]


class StuckStepError(DistributedError):
    """A step took longer than the :class:`Watchdog`'s timeout.

    Raised in the training thread under ``on_stuck="raise"``, and given to an ``on_stuck`` callable. The message
    holds the watchdog's table; ``stuck`` lists the processes it names (empty when the others' state is unknown).
    """

    def __init__(self, message: str, *, stuck: list[int] | None = None):
        super().__init__(message)
        self.stuck = list(stuck or [])


class Watchdog:
    """Ends every process of the job, naming the stuck one(s), when a step takes longer than ``timeout`` s.

    The watchdog runs from creation until :meth:`close` (or the end of the ``with`` block); with several
    processes every process must run one (create them in the same order on every process). Whatever
    ``on_stuck`` says, the watchdog fires once.

    Args:
      timer: the :class:`~spmdcomm.PhaseTimer` the training loop drives: a step is complete at
        ``timer.end_step``.
      timeout: seconds a step may take, from the end of the previous step or of the step's compilation,
        whichever is later.
      first_step_timeout: the same for the first step, from the watchdog's start (default ``timeout``): the
        first batch of a data loader may take longer than the others.
      compile_timeout: seconds a compilation may take (:data:`DEFAULT_COMPILE_TIMEOUT`, 30 minutes). A step that
        compiles (the ``"compile"`` phase of the :class:`~spmdcomm.PhaseTimer`: a train or eval step's first
        call, a new batch shape, the first step after a restart) is timed against it, and while any process of
        the job compiles, or finished compiling less than ``timeout`` ago, no process's wait for it counts as a
        stall.
      interval: the period in seconds of the checks and the most frequent publication of this process's state.
      on_stuck: what a process does once the table is printed: ``"exit"`` (default) ends it with
        :data:`STUCK_EXIT_CODE` (see the module: a thread stuck in a device collective cannot be unwound);
        ``"raise"`` raises :class:`StuckStepError` in the training thread when it next runs Python code; a
        callable is called (in the watchdog's thread) with that error.

    Raises:
      SpmdError: when ``timer`` is not a :class:`~spmdcomm.PhaseTimer`, ``on_stuck`` is not ``"exit"``,
        ``"raise"`` or a callable, or a timeout or ``interval`` is not a positive number.
    """

    def __init__(
        self,
        timer: PhaseTimer,
        *,
        timeout: float,
        first_step_timeout: float | None = None,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
        interval: float = 1.0,
        on_stuck: OnStuck = "exit",
    ):
        if not isinstance(timer, PhaseTimer):
            raise SpmdError(
                describe(
                    "Watchdog",
                    f"timer is a {type(timer).__name__}, not a PhaseTimer.",
                    fix="pass the sc.PhaseTimer() whose phase() and end_step() the training loop calls.",
                )
            )
        if on_stuck not in ("exit", "raise") and not callable(on_stuck):
            raise SpmdError(
                describe(
                    "Watchdog",
                    f"on_stuck={on_stuck!r} is not 'exit', 'raise' or a callable.",
                    fix="pass 'exit' (end the process for a restart), 'raise' (StuckStepError in the training "
                    "thread) or a function that takes the StuckStepError.",
                )
            )
        self._on_stuck = on_stuck
        first_step_timeout = timeout if first_step_timeout is None else first_step_timeout
        settings = {
            "timeout": timeout,
            "first_step_timeout": first_step_timeout,
            "compile_timeout": compile_timeout,
            "interval": interval,
        }
        for name, value in settings.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise SpmdError(
                    describe(
                        "Watchdog",
                        f"{name}={value!r} is not a positive number of seconds.",
                        fix="pass e.g. timeout=600 (longer than the slowest step, saving included) and interval=1.",
                    )
                )
        self._timer = timer
        self._timeouts = (float(first_step_timeout), float(timeout))
        self._compile_timeout = float(compile_timeout)
        self._interval = float(interval)
        self._me, self._n, self._host = process_index(), process_count(), socket.gethostname()
        self._client = coordination_client("Watchdog") if self._n > 1 else None
        self._prefix = f"spmdcomm/watchdog/{next(_INSTANCES)}/"
        self._alarm: dict[str, Any] | None = None
        self._callbacks = HostCallbacks()
        self._wake, self._closed = threading.Event(), threading.Event()
        targets = [self._monitor] + ([self._publish] if self._client is not None else [])
        self._threads = [
            threading.Thread(target=t, name=f"spmdcomm-watchdog{t.__name__}", daemon=True) for t in targets
        ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stops watching; returns when the threads have ended.

        That is at once, unless a call to the coordination service is under way: then within
        ``_SERVICE_SECONDS`` (2 s) per thread.
        """
        self._closed.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(_SERVICE_SECONDS)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _monitor(self) -> None:
        """Thread: fires when this process's step is over its timeout, unless another process compiles, or
        when another process raised the alarm."""
        while True:
            self._wake.wait(self._interval)
            if self._closed.is_set():
                return
            if self._alarm is not None:
                self._fire(f"process {self._alarm['process']} raised the alarm: {self._alarm['why']}")
                return
            self._callbacks.sample()  # every interval, so that a callback's time is known to within one
            p = self._timer.snapshot()
            late = overdue(p, self._timer.clock(), self._timeouts, self._compile_timeout)
            if late is None or (p.phase != COMPILE_PHASE and self._other_compiles()):
                continue
            self._fire(f"process {self._me} {late}")
            return

    def _other_compiles(self) -> bool:
        """Whether another process compiles (within its allowance) or ended a compilation less than ``timeout`` s
        ago, by the states the processes published: the one wait of a process that is over its timeout that is
        not a stall. False when they cannot be read (the watchdog then fires as without that answer)."""
        client = self._client
        if client is None:
            return False
        entries, error = _bounded(lambda: client.key_value_dir_get(self._prefix + "state/"), _SERVICE_SECONDS)
        if error is not None:
            return False
        states = states_from_entries(entries, skip=self._me)
        return compiling_process(states.values(), self._timeouts[1], self._compile_timeout) is not None

    def _publish(self) -> None:
        """Thread: publishes this process's state when it changed and looks for the alarm, every ``interval``."""
        client, published = self._client, None
        assert client is not None  # __init__ starts this thread only for a multi-process job, which has a client
        while not self._closed.wait(self._interval):
            p, callback = self._timer.snapshot(), self._callbacks.sample()
            state = {
                "host": self._host,
                "step": p.step,
                "phase": p.phase,
                "since": p.phase_start_wall,
                "compiled": p.compile_end_wall,
                "callback": None if callback is None else callback.began_wall,
            }
            if state != published and self._set(client, f"state/{self._me}", json.dumps(state)):
                published = state
            alarm, missing = attempt(lambda: client.key_value_try_get(self._prefix + "alarm"))
            if missing:  # not set (or the service is unreachable)
                continue
            assert alarm is not None  # nothing went wrong, so attempt returned the call's result: a str
            self._alarm = json.loads(alarm)
            self._wake.set()
            return

    def _set(self, client: Any, key: str, text: str) -> bool:
        """Whether the coordination service (``client``) took ``text`` under this watchdog's ``key``."""
        return attempt(lambda: client.key_value_set(self._prefix + key, text, allow_overwrite=True))[1] is None

    def _fire(self, why: str) -> None:
        """Prints the table, meets the other processes for a bounded time, and does what ``on_stuck`` says."""
        p, callback = self._timer.snapshot(), self._callbacks.sample()
        now = self._timer.clock()
        own = ProcessState(
            self._me,
            self._host,
            p.step,
            p.phase,
            now - p.phase_start,
            seconds_since(p.compile_end, now),
            None if callback is None else time.monotonic() - callback.began,
        )
        states = {self._me: own}
        unknown = None  # why the other processes' state is unknown
        if self._client is not None:
            alarm = json.dumps({"process": self._me, "why": why})
            client, prefix = self._client, self._prefix

            def gather() -> list[tuple[str, str]]:
                if self._alarm is None:
                    client.key_value_set(prefix + "alarm", alarm, allow_overwrite=True)
                return client.key_value_dir_get(prefix + "state/")

            entries, error = _bounded(gather, _SERVICE_SECONDS)
            if error is None:
                states.update(states_from_entries(entries, skip=self._me))
            else:
                unknown = f"the coordination service {error}"
        if unknown is None:
            # A process in a phase of its own for less than half the timeout has just begun it: not the stall.
            stuck = stuck_processes(states, self._n, stalled_after=self._timeouts[1] / 2)
            named = ", ".join(describe_stuck(q, states) for q in stuck)
        else:
            stuck, named = [], f"unknown ({unknown}, so the other processes' state is unknown)"
        if self._on_stuck == "exit":
            action = (
                f"Every process exits with status {STUCK_EXIT_CODE} so that the job can be restarted from its last "
                "checkpoint."
            )
        elif self._on_stuck == "raise":
            action = f"Process {self._me} raises StuckStepError in its training thread (on_stuck='raise')."
        else:
            action = f"Process {self._me} hands a StuckStepError to its on_stuck function."
        table = format_table(states, self._n, stuck=stuck, absent="no report" if unknown is None else "unknown")
        headline = f"spmdcomm.Watchdog: {why}. Stuck: {named}."
        lines = [f"{headline} {action}", table, f"Training thread of process {self._me}:", stack_of(p.thread)]
        if callback is not None and callback.thread != p.thread:
            lines += [f"Host callback of process {self._me}:", stack_of(callback.thread)]
        sys.stdout.flush()
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        if (client := self._client) is not None:
            # The processes meet before exiting: the first to exit makes the launcher stop the others, which
            # must have printed by then.
            exit_barrier = self._prefix + "exit"
            _bounded(lambda: client.wait_at_barrier(exit_barrier, milliseconds(_EXIT_SECONDS)), _EXIT_SECONDS + 1)
            if self._me == 0 and self._on_stuck == "exit":
                # Process 0 hosts the coordination service: when it goes, JAX aborts the other processes with a
                # fatal error that hides their exit status. Let them exit first.
                time.sleep(_COORDINATOR_LINGER_SECONDS)
        self._closed.set()  # fires once: the publisher stops too
        stuck_error = StuckStepError(f"{headline}\n{table}", stuck=stuck)
        if self._on_stuck == "exit":
            exit_stuck_process()
        elif self._on_stuck == "raise":
            _raise_in_thread(p.thread, stuck_error)
        else:
            self._on_stuck(stuck_error)


def exit_stuck_process() -> NoReturn:
    """Ends this process at once with :data:`STUCK_EXIT_CODE`, from any thread: what ``Watchdog(on_stuck="exit")``
    does, and the one place spmdcomm ends the interpreter (``os._exit``: the training thread may be blocked in a
    device collective that Python cannot interrupt, and exit handlers could wait for it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STUCK_EXIT_CODE)


# ------------------------------------------------------------------------------------------------

# Numbers the Watchdog objects of a process, so that every process's k-th watchdog uses the same keys.
_INSTANCES = itertools.count(1)
# Bounds of the waits for the coordination service once the watchdog fires: reading the states, and the
# barrier at which the processes meet after printing (so that none is ended before it printed).
_SERVICE_SECONDS = 2.0
_EXIT_SECONDS = 3.0
_COORDINATOR_LINGER_SECONDS = 1.0


def _raise_in_thread(thread: int, error: StuckStepError) -> None:
    """Raises ``error`` in thread ``thread`` when it next runs Python code (``PyThreadState_SetAsyncExc``)."""
    # CPython raises an asynchronous exception from its class, so the message and fields travel in a subclass.
    carried = type(
        "StuckStepError",
        (StuckStepError,),
        {"__init__": lambda self: StuckStepError.__init__(self, str(error), stuck=error.stuck), "__module__": __name__},
    )
    if ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(carried)) != 1:
        sys.stderr.write("spmdcomm.Watchdog: the training thread has ended; nothing to raise StuckStepError in.\n")


def _bounded(call: Callable[[], Any], seconds: float) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, why)`` when ``call`` raised or did not return within ``seconds``.

    The call runs in a daemon thread: a call to an unreachable service may never return.
    """
    box: list[Any] = []

    thread = threading.Thread(target=lambda: box.append(attempt(call)), name="spmdcomm-watchdog-call", daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else (None, f"did not answer within {seconds:g} s")
