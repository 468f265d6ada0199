"""Stopping every process of a job at one agreed step when the scheduler asks (SIGTERM).

SLURM and Kubernetes send SIGTERM some seconds before they kill a job; ``spmdcomm-launch`` passes it on to
every process. :class:`Preemption` turns the signal into one step number on which all processes agree, so
that the training loop can save a checkpoint there and exit with :data:`PREEMPTED_EXIT_CODE`:

>>> import spmdcomm as sc
>>> with sc.Preemption() as preemption:
...     for step in range(100):
...         if preemption.should_stop(step):
...             break  # save a checkpoint of `step` completed steps, then sys.exit(sc.PREEMPTED_EXIT_CODE)
...         if step == 2:
...             preemption.request()  # what SIGTERM does
>>> step, preemption.stop_step
(3, 3)

How the processes agree (the protocol of JAX's ``multihost_utils.reached_preemption_sync_point``, with
timeouts and named processes): the signal handler only notes the request; a background thread of that
process publishes a notice in the coordination service's key-value store, where a background thread of every
process looks for it (one small RPC per second, nothing per step). On the notice, each process publishes
the last step it has checked, all meet at a bounded barrier, and the stop step is the largest of them plus
one: the first step boundary that every process can still stop at. While its process takes part in the
agreement, :meth:`Preemption.should_stop` waits for it (a few milliseconds); otherwise it is a lock and a
comparison. With one process nothing is exchanged: the next :meth:`~Preemption.should_stop` stops.

Why not JAX's own sync point: it exists only in multi-process jobs, reacts to SIGTERM only, and when a
process does not take part it logs an error after 3 minutes and lets the job train on until it is killed;
here the stop step is known in milliseconds and a missing process is named in a
:class:`~spmdcomm.errors.BarrierTimeoutError` after ``timeout`` seconds. While a :class:`Preemption` is
active its handler replaces any other handler of its signals, JAX's preemption notifier included (so
``reached_preemption_sync_point`` and orbax's use of it do not see the signal).
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

from spmdcomm.errors import BarrierTimeoutError, DistributedError, SpmdError, describe
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import attempt, coordination_client, key_process, milliseconds

__all__ = ["Preemption", "PREEMPTED_EXIT_CODE", "DEFAULT_PREEMPTION_TIMEOUT"]

# The exit status of a process that stopped at the agreed step after saving: 128 + SIGTERM, what a shell
# and a scheduler report for a process ended by SIGTERM (spmdcomm-launch exits with it too when it receives
# SIGTERM).
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM

# Seconds the processes wait for each other to agree on the stop step. A process that cannot agree reports it
# (BarrierTimeoutError) and exits about this plus 2 s after the signal (1 s to see the notice, 1 s to exit): inside
# spmdcomm-launch's default grace period of 20 s, before its SIGKILL. A healthy job agrees in milliseconds.
DEFAULT_PREEMPTION_TIMEOUT = 10.0


class Preemption:
    """Notes a stop request (a signal or :meth:`request`) and agrees with all processes on the step they stop at.

    The signals' handlers are installed when the object is created, which must happen in the main thread, and
    the previous ones restored by :meth:`close` (or leaving the ``with`` block); a handler installed outside
    Python (JAX's preemption notifier) is restored as the default action. With several processes two daemon
    threads wait for a request (this process's, and any process's notice in the coordination service);
    :meth:`close` ends them.

    Args:
      signals: the signals that request a stop (default SIGTERM; SLURM's ``--signal=USR1@60`` wants
        ``signal.SIGUSR1`` too); SIGKILL cannot be caught.
      timeout: seconds the agreement may take (default :data:`DEFAULT_PREEMPTION_TIMEOUT`, 10 s); keep it well
        below the launcher's ``--grace``, so that a process that cannot agree says so before it is killed.

    Raises:
      SpmdError: when ``signals`` is empty, holds SIGKILL or something that is not a signal, ``timeout`` is not
        a positive number, or the object is created outside the main thread.
    """

    def __init__(
        self,
        *,
        signals: Sequence[int] = (signal.SIGTERM,),
        timeout: float = DEFAULT_PREEMPTION_TIMEOUT,
    ):
        signals = _check_signals(signals)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise SpmdError(
                describe(
                    "Preemption",
                    f"timeout={timeout!r} is not a positive number of seconds.",
                    fix="pass e.g. timeout=10, well below the launcher's and the scheduler's grace periods.",
                )
            )
        if threading.current_thread() is not threading.main_thread():
            raise SpmdError(
                describe(
                    "Preemption",
                    f"was created in thread {threading.current_thread().name!r}; Python runs signal handlers "
                    "only in the main thread, so only there can it install them.",
                    fix="create the Preemption in the main thread (e.g. before starting worker threads).",
                )
            )
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._requested: str | None = None  # why this process asked; set by the signal handler
        self._notice: dict[str, Any] | None = None
        self._last_step = -1
        self._stop_step: int | None = None
        self._failure: DistributedError | None = None
        self._wanted, self._closed = threading.Event(), threading.Event()
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        self._me, self._n = process_index(), process_count()
        self._threads: list[threading.Thread] = []
        self._agreeing = self._n > 1
        if self._agreeing:
            self._client = coordination_client("Preemption")
            self._prefix = f"spmdcomm/preemption/{next(_INSTANCES)}/"
            for target in (self._announce, self._listen):
                thread = threading.Thread(target=target, name=f"spmdcomm-preemption{target.__name__}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def request(self, reason: str = "request()") -> None:
        """Asks every process to stop, as the signals do (e.g. from a scheduler's API or a health check).

        Only the first request counts; later ones (and later signals) change nothing. Safe to call from a signal
        handler.

        Args:
          reason: why the stop was asked, shown in :attr:`reason` (a signal's request gives its name, e.g.
            ``"SIGTERM"``).
        """
        # This runs inside signal handlers, which may interrupt any code of the main thread, a handler included:
        # the assignment comes first, so that a nested call returns before taking the event's lock again.
        if self._requested is None:
            self._requested = reason
            self._wanted.set()

    def should_stop(self, step: int) -> bool:
        """True when the loop must stop before running step ``step`` (after ``step`` completed steps).

        Call it at every step boundary, with consecutive step numbers that are the same on every process;
        then it returns True at the same step on all of them, once, after a stop was requested anywhere.

        Args:
          step: the number of the step about to run (the number of steps completed so far).

        Returns:
          True when ``step`` is the agreed stop step, else False.

        Raises:
          BarrierTimeoutError: naming the processes that did not take part in the agreement within ``timeout``
            seconds.
          DistributedError: when a step number jumps past the agreed step.
        """
        with self._lock:  # held by the background thread while the processes agree
            if self._failure is not None:
                raise self._failure
            self._last_step = step
            if not self._agreeing and self._requested is not None and self._stop_step is None:
                self._stop_step = step  # a single process has no one to agree with
                self._notice = {"process": self._me, "reason": self._requested}
            stop = self._stop_step
        if stop is not None and step > stop:
            raise DistributedError(
                describe(
                    "Preemption.should_stop",
                    f"step={step} on process {self._me} is past the agreed stop step {stop}: the "
                    "processes would stop at different steps.",
                    fix="call should_stop at every step boundary with consecutive step numbers.",
                )
            )
        return stop == step

    @property
    def stop_step(self) -> int | None:
        """The agreed step at which every process stops (None while no stop was agreed)."""
        return self._stop_step

    @property
    def reason(self) -> str | None:
        """Which process asked to stop, and why (e.g. ``"SIGTERM on process 1"``); None before that."""
        notice = self._notice
        return None if notice is None else f"{notice['reason']} on process {notice['process']}"

    def close(self) -> None:
        """Restores the previous signal handlers and stops the background threads.

        Returns at once, unless the processes are agreeing on a stop step right then (then within ``timeout``).
        """
        self._closed.set()
        self._wanted.set()
        for thread in self._threads:
            thread.join(self._timeout + _POLL_SECONDS)
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)

    def _announce(self) -> None:
        """Thread: publishes this process's request as the job's notice (the first request wins)."""
        self._wanted.wait()
        notice = json.dumps({"process": self._me, "reason": self._requested})
        key = self._prefix + "notice"
        while not self._closed.is_set():
            if attempt(lambda: self._client.key_value_set(key, notice, allow_overwrite=True))[1] is None:
                return
            self._closed.wait(_POLL_SECONDS)

    def _listen(self) -> None:
        """Thread: looks for the job's notice every second, then agrees with the other processes on the stop step."""
        # Polls instead of a blocking get: a daemon thread inside a blocking call when Python exits aborts the
        # process.
        while not self._closed.wait(_POLL_SECONDS):
            text, missing = attempt(lambda: self._client.key_value_try_get(self._prefix + "notice"))
            if missing:  # not set (or the service is unreachable)
                continue
            assert text is not None  # nothing went wrong, so attempt returned the call's result: a str
            self._agree(json.loads(text))
            return

    def _agree(self, notice: dict[str, Any]) -> None:
        client, n = self._client, self._n
        key = f"{self._prefix}step/{self._me}"
        with self._lock:  # should_stop waits: this process's last checked step must not move meanwhile
            self._notice = notice
            _, failed = attempt(lambda: client.key_value_set(key, str(self._last_step), allow_overwrite=True))
            if failed is None:
                _, failed = attempt(lambda: client.wait_at_barrier(self._prefix + "agree", milliseconds(self._timeout)))
            steps = _steps(client, self._prefix)
            missing = [p for p in range(n) if p not in steps]
            if failed or missing:
                who = f"process(es) {missing} did not report their step" if missing else "not every process arrived"
                self._failure = BarrierTimeoutError(
                    describe(
                        "Preemption.should_stop",
                        f"{self.reason} asked every process to stop, but {who} within {self._timeout:g} s, so no "
                        f"stop step was agreed (seen on process {self._me}; steps reported: {steps}).",
                        fix="check that every process created its Preemption and is alive; a process that is "
                        "stuck is named by spmdcomm.Watchdog.",
                    )
                )
                return
            self._stop_step = max(steps.values()) + 1


# ------------------------------------------------------------------------------------------------

# Numbers the Preemption objects of a process, so that every process's k-th object uses the same keys.
_INSTANCES = itertools.count(1)
# Seconds between two looks for the notice.
_POLL_SECONDS = 1.0


def _check_signals(signals: Sequence[int]) -> list[signal.Signals]:
    try:
        checked = [signal.Signals(s) for s in signals]
    except (TypeError, ValueError):
        checked = []
    if not checked or signal.SIGKILL in checked:
        raise SpmdError(
            describe(
                "Preemption",
                f"signals={signals!r} is not a non-empty sequence of catchable signals.",
                fix="pass e.g. signals=(signal.SIGTERM,) or (signal.SIGTERM, signal.SIGUSR1).",
            )
        )
    return checked


def _steps(client: Any, prefix: str) -> dict[int, int]:
    entries, _ = attempt(lambda: client.key_value_dir_get(prefix + "step/"))
    return {key_process(k): int(v) for k, v in entries or []}
