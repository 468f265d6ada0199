"""Who holds a job up: the verdicts of :class:`~spmdcomm.Watchdog`, as pure functions of the processes' states.

Which process is late (:func:`overdue`), which one the others legitimately wait for while it compiles
(:func:`compiling_process`), which ones are stuck (:func:`stuck_processes`), what each process is doing in words
(:func:`describe_state`, :func:`verdict_of`) and the table every process prints (:func:`format_table`). The
watchdog's threads gather the states; these functions decide.

**Waiting or working.** A process either waits for the others or works on its own: it loads data, runs a hook,
compiles, runs your code between phases, or runs a host callback inside its step. Only a process that stopped
inside its own work can hold the job up; one that waits is a victim, however long it has waited. Waiting are the
:data:`~spmdcomm.reliability.phases.WAITING_PHASES` and ``"dispatch"``: enqueuing a step takes microseconds to
milliseconds, and a dispatch that lasts seconds is blocked behind the devices, which wait for a peer at a
collective (XLA:CPU runs part of a step in the dispatching thread, so that a process whose previous step waits
for a peer blocks in the next step's dispatch). A host callback (:mod:`spmdcomm.reliability.threads`) is its
process's own work whatever phase the training thread is in: the step cannot end until it returns.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from spmdcomm.reliability.phases import COMPILE_PHASE, PHASE_DESCRIPTIONS, WAITING_PHASES, Progress
from spmdcomm.runtime.transport import key_process

__all__ = [
    "ProcessState",
    "overdue",
    "compiling_process",
    "stuck_processes",
    "own_work",
    "describe_state",
    "verdict_of",
    "describe_stuck",
    "format_table",
    "states_from_entries",
    "seconds_since",
    "describe_phase",
]

# The phase of a step's dispatch: a wait (see the module docstring).
DISPATCH_PHASE = "dispatch"


class ProcessState(NamedTuple):
    """One process's row of the watchdog's table."""

    process: int
    host: str
    step: int | None  # last completed step; None before the first
    phase: str  # a phase name of spmdcomm.reliability.phases, or the loop's own
    seconds: float  # seconds in that phase
    compiled: float | None = None  # seconds since its last compilation ended; None: none ended yet
    callback: float | None = None  # seconds the oldest host callback in flight has run; None: none runs


def own_work(s: ProcessState) -> float | None:
    """Seconds ``s`` has spent in its own work (a host callback, or a phase other than a waiting one); None while
    it waits for the others (see the module docstring)."""
    if s.callback is not None:
        return s.callback
    if s.phase in WAITING_PHASES or s.phase == DISPATCH_PHASE:
        return None
    return s.seconds


def stuck_processes(states: Mapping[int, ProcessState], n: int, *, stalled_after: float = 0.0) -> list[int]:
    """The processes of a job of ``n`` that hold it up, from each process's state (absent: no report).

    Those that never reported, then those that stopped in their own work (:func:`own_work` for at least
    ``stalled_after`` seconds; the watchdog passes half its timeout, so that a process that just began a phase of
    its own is not one); never a process that waits. When every process reported and none stopped: among those in
    their own work (just begun), the ones with the lowest last completed step; when all wait, all of them (a hang
    inside the devices, or a collective that some process never joined: which one, only the devices know).
    """
    missing = [q for q in range(n) if q not in states]
    stalled = [q for q, s in sorted(states.items()) if (w := own_work(s)) is not None and w >= stalled_after]
    if missing or stalled:
        return missing + stalled
    working = {q: s for q, s in states.items() if own_work(s) is not None}
    if not working:
        return sorted(states)
    lowest = min(-1 if s.step is None else s.step for s in working.values())
    return sorted(q for q, s in working.items() if (-1 if s.step is None else s.step) == lowest)


def describe_state(s: ProcessState) -> str:
    """What ``s`` is doing, in words: its phase, or the host callback it runs."""
    if s.callback is not None:
        return f"in a host callback ({describe_phase(s.phase)})"
    return describe_phase(s.phase)


def verdict_of(q: int, states: Mapping[int, ProcessState], stuck: list[int]) -> str:
    """Process ``q``'s line of the verdict: why it is stuck, or whom it waits for ("" when nobody is named)."""
    s = states.get(q)
    if q in stuck:
        if s is None:
            return "<- stuck: no report"
        if s.callback is not None:
            return f"<- stuck: a host callback has run {s.callback:.1f} s"
        if own_work(s) is None:
            return "<- stuck: waits with the others (a hang inside the devices or a barrier)"
        return f"<- stuck: {describe_phase(s.phase)} for {s.seconds:.1f} s"
    others = [p for p in stuck if p != q]
    if not others:
        return ""
    return "waiting for process" + ("es " if len(others) > 1 else " ") + ", ".join(map(str, others))


def overdue(progress: Progress, now: float, timeouts: tuple[float, float], compile_timeout: float) -> str | None:
    """Why this process is late, from its timer's ``progress`` at ``now`` (the timer's clock); None if it is not.

    A compile phase is late past ``compile_timeout``; a step past its timeout (``timeouts``: the first step's, the
    others'), counted from the end of the previous step or of the last compilation, whichever is later.
    """
    if progress.phase == COMPILE_PHASE:
        waited = now - progress.phase_start
        return (
            f"compiled for {waited:.1f} s (compile timeout {compile_timeout:g} s)" if waited > compile_timeout else None
        )
    start, after = (
        progress.step_start,
        "the last completed step" if progress.step is not None else "the watchdog started",
    )
    if progress.compile_end is not None and progress.compile_end > start:
        start, after = progress.compile_end, "its last compilation ended"
    limit, waited = timeouts[progress.step is not None], now - start
    return f"completed no step for {waited:.1f} s after {after} (timeout {limit:g} s)" if waited > limit else None


def compiling_process(states: Iterable[ProcessState], timeout: float, compile_timeout: float) -> int | None:
    """A process among ``states`` that holds the others up legitimately: compiling within ``compile_timeout``,
    or done compiling less than ``timeout`` s ago (its step may take that long after it). None if there is none."""
    for s in states:
        if s.phase == COMPILE_PHASE and s.seconds <= compile_timeout:
            return s.process
        if s.phase != COMPILE_PHASE and s.compiled is not None and s.compiled <= timeout:
            return s.process
    return None


def describe_stuck(q: int, states: Mapping[int, ProcessState]) -> str:
    """Process ``q`` as the watchdog's headline names it: what it is doing, for how long, after which step."""
    s = states.get(q)
    if s is None:
        return f"process {q} (no report)"
    seconds = s.seconds if s.callback is None else s.callback
    step = "none" if s.step is None else s.step
    return f"process {q} ({describe_state(s)} for {seconds:.1f} s, last completed step {step})"


def format_table(states: Mapping[int, ProcessState], n: int, *, stuck: list[int], absent: str = "no report") -> str:
    """The watchdog's table: one row per process of a job of ``n`` (its last completed step, what it is doing, for
    how long, and its verdict: stuck, and why, or whom it waits for), ``absent`` in the phase column of the
    processes without a state."""
    rows = [("process", "host", "last step", "doing", "seconds", "verdict")]
    for q in range(n):
        s = states.get(q)
        verdict = verdict_of(q, states, stuck)
        if s is None:
            rows.append((str(q), "?", "?", absent, "?", "<- stuck" if q in stuck else ""))
        else:
            step = "none" if s.step is None else str(s.step)
            seconds = s.seconds if s.callback is None else s.callback
            rows.append((str(q), s.host, step, describe_state(s), f"{seconds:.1f}", verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ------------------------------------------------------------------------------------------------


def states_from_entries(entries: list[tuple[str, str]], *, skip: int) -> dict[int, ProcessState]:
    """The processes' states from the coordination service's ``state/`` keys (``skip``: this process's own)."""
    now, states = time.time(), {}
    for key, text in entries:
        other, s = key_process(key), json.loads(text)
        if other != skip:
            states[other] = ProcessState(
                other,
                s["host"],
                s["step"],
                s["phase"],
                now - s["since"],
                seconds_since(s.get("compiled"), now),
                seconds_since(s.get("callback"), now),
            )
    return states


def seconds_since(moment: float | None, now: float) -> float | None:
    return None if moment is None else now - moment


def describe_phase(phase: str) -> str:
    return PHASE_DESCRIPTIONS.get(phase, phase)
