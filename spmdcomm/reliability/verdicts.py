"""Who holds a job up: the verdicts of :class:`~spmdcomm.Watchdog`, as pure functions of the processes' states.

Which process is late (:func:`overdue`), which one the others legitimately wait for while it compiles
(:func:`compiling_process`), which ones are stuck (:func:`stuck_processes`) and the table every process prints
(:func:`format_table`). The watchdog's threads gather the states; these functions decide.
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
    "format_table",
    "states_from_entries",
    "seconds_since",
    "describe_phase",
]


class ProcessState(NamedTuple):
    """One process's row of the watchdog's table."""

    process: int
    host: str
    step: int | None  # last completed step; None before the first
    phase: str  # a phase name of spmdcomm.reliability.phases, or the loop's own
    seconds: float  # seconds in that phase
    compiled: float | None = None  # seconds since its last compilation ended; None: none ended yet


def stuck_processes(states: Mapping[int, ProcessState], n: int) -> list[int]:
    """The processes of a job of ``n`` that hold it up, from each process's state (absent: no report).

    Those that never reported, then, among the processes with the lowest last completed step, those that are
    not waiting for the others (not in :data:`~spmdcomm.reliability.phases.WAITING_PHASES`); when all of those wait, all
    of them.
    """
    missing = [q for q in range(n) if q not in states]
    if len(missing) == n:
        return missing
    lowest = min(-1 if s.step is None else s.step for s in states.values())
    behind = [q for q, s in sorted(states.items()) if (-1 if s.step is None else s.step) == lowest]
    busy = [q for q in behind if states[q].phase not in WAITING_PHASES]
    return missing + (busy if busy or missing else behind)


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


def format_table(states: Mapping[int, ProcessState], n: int, *, stuck: list[int], absent: str = "no report") -> str:
    """The watchdog's table: one row per process of a job of ``n``, the stuck ones marked, ``absent`` in the
    phase column of the processes without a state."""
    rows = [("process", "host", "last step", "phase", "seconds in phase", "")]
    for q in range(n):
        s = states.get(q)
        mark = "<- stuck" if q in stuck else ""
        if s is None:
            rows.append((str(q), "?", "?", absent, "?", mark))
        else:
            step = "none" if s.step is None else str(s.step)
            rows.append((str(q), s.host, step, describe_phase(s.phase), f"{s.seconds:.1f}", mark))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ------------------------------------------------------------------------------------------------


def states_from_entries(entries: list[tuple[str, str]], *, skip: int) -> dict[int, ProcessState]:
    """The processes' states from the coordination service's ``state/`` keys (``skip``: this process's own)."""
    now, states = time.time(), {}
    for key, text in entries:
        other, s = key_process(key), json.loads(text)
        if other != skip:
            compiled = s.get("compiled")
            states[other] = ProcessState(
                other, s["host"], s["step"], s["phase"], now - s["since"], seconds_since(compiled, now)
            )
    return states


def seconds_since(moment: float | None, now: float) -> float | None:
    return None if moment is None else now - moment


def describe_phase(phase: str) -> str:
    return PHASE_DESCRIPTIONS.get(phase, phase)
