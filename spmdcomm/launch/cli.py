"""A local launcher: runs one Python script (or module) as N cooperating JAX processes.

``spmdcomm-launch -n 2 --devices-per-process 2 train.py --lr 0.1`` (or ``python -m
spmdcomm.launch``) picks a free loopback port for the coordinator, starts two copies of
``train.py`` with the environment that :func:`spmdcomm.initialize` reads (``SPMDCOMM_COORDINATOR``,
``SPMDCOMM_NUM_PROCESSES``, ``SPMDCOMM_PROCESS_ID``, ``SPMDCOMM_LOCAL_RANK``,
``SPMDCOMM_LOCAL_WORLD_SIZE``, ``SPMDCOMM_RESTART_COUNT``; see :mod:`spmdcomm.runtime.process`), and
prefixes every output line with ``[rank i]``.

It fails fast: as soon as one process exits with a non-zero status or is killed, or the attempt's
``--timeout`` expires, the others get SIGTERM and, after a grace period, SIGKILL (JAX catches
SIGTERM and keeps running). The grace period (``--grace``, default :data:`~spmdcomm.launch.GRACE_SECONDS`,
20 s) is what a preempted job needs between SIGTERM and its exit: agree on a stop step, finish the steps in
flight, save a checkpoint and shut down (``docs/reliability.md``). After a process failed, the others get at
most 3 s: they cannot save without it. With ``--max-restarts K`` the launcher then starts all processes again
on a fresh coordinator port, up to K times (``SPMDCOMM_RESTART_COUNT`` tells each attempt apart).
Ctrl-C or SIGTERM to the launcher is a stop, not a failure: it is passed on to every process in
the same way and never restarted. Each process runs in its own session and, on Linux, is killed by
the kernel if the launcher dies, so no process outlives the launcher. Each event is one line on
stderr, prefixed ``spmdcomm-launch:``.

Exit status: 0 when every process of an attempt exited 0; otherwise that of the last attempt's
failure: the first failing process's status (``128 + signal`` when it was killed by a signal) or
``124`` when ``--timeout`` expired; ``128 + signal`` when the launcher itself was interrupted.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from spmdcomm.errors import SpmdError
from spmdcomm.launch.supervisor import (
    FAILURE_GRACE_SECONDS,
    GRACE_SECONDS,
    check_options,
    launch,
    split_coordinator,
)

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``spmdcomm-launch``; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    if args.module is None and not args.command:
        _parser().error("give a script to run (script.py [args...]) or -m module [args...]")
    target = ["-m", args.module, *args.command] if args.module else list(args.command)
    try:
        check_options(args.nprocs, args.devices_per_process, args.gpus_per_process, args.max_restarts)
        split_coordinator(args.coordinator)
    except SpmdError as e:  # on the command line, a usage error (exit status 2), not a traceback
        _parser().error(str(e))
    return launch(
        target,
        args.nprocs,
        devices_per_process=args.devices_per_process,
        gpus_per_process=args.gpus_per_process,
        coordinator=args.coordinator,
        timeout=args.timeout,
        grace=args.grace,
        max_restarts=args.max_restarts,
    )


# ------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spmdcomm-launch",
        description="Run a script as N cooperating JAX processes on this machine.",
        usage="spmdcomm-launch -n N [--devices-per-process K] [--coordinator HOST:PORT] [--max-restarts K] "
        "(script.py | -m module) [args...]",
    )
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of processes")
    p.add_argument(
        "--devices-per-process", type=int, default=None, metavar="K", help="give each process K fake CPU devices"
    )
    p.add_argument(
        "--gpus-per-process",
        type=int,
        default=None,
        metavar="K",
        help="give each process K of this host's GPUs (rank r gets GPUs r*K .. r*K+K-1)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="coordinator address (default: 127.0.0.1 and a free port; restarts use a free port on HOST)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end an attempt after this many seconds (a failure; exit status 124)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=GRACE_SECONDS,
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when the job is stopped (a signal, or --timeout): time to agree "
        f"on a stop step, finish the steps in flight, save and exit (default {GRACE_SECONDS:g}); at most "
        f"{FAILURE_GRACE_SECONDS:g} after a process failed",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a process fails, stop all and start them again on a fresh coordinator port, "
        "up to K times (default 0); each sees SPMDCOMM_RESTART_COUNT",
    )
    p.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    p.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args...], or the module's args")
    return p
