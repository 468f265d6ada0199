"""Runs a job's processes on this machine and supervises them: environment, output, failures, restarts.

:func:`launch` is the launcher behind ``spmdcomm-launch`` (its command line: :mod:`spmdcomm.launch.cli`, which
describes the behaviour and exit statuses).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

from spmdcomm._env import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    host_and_port,
    is_loopback,
)
from spmdcomm.errors import SpmdError, describe

__all__ = [
    "launch",
    "free_port",
    "GRACE_SECONDS",
]

# Seconds between SIGTERM and SIGKILL when the job is stopped (SIGINT/SIGTERM to the launcher, or --timeout): what
# a preempted job needs to agree on a stop step, finish its steps in flight, save and exit. Measured on 2 busy CPU
# cores with a small checkpoint: 1.6-2.6 s; the margin is for larger checkpoints and slower steps, and Kubernetes'
# and SLURM's default grace periods (30 s) still leave the launcher time to end the job itself.
GRACE_SECONDS = 20.0
# At most this many seconds after a process failed: the others cannot save without it, and a restart should not
# wait for processes that ignore SIGTERM (JAX's preemption notifier does).
FAILURE_GRACE_SECONDS = 3.0

_POLL_SECONDS = 0.05
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_TIMEOUT_STATUS = 124  # as coreutils' timeout(1)


def launch(
    target: Sequence[str],
    nprocs: int,
    *,
    devices_per_process: int | None = None,
    gpus_per_process: int | None = None,
    coordinator: str | None = None,
    timeout: float | None = None,
    grace: float = GRACE_SECONDS,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> int:
    """Runs ``python *target`` as ``nprocs`` processes and returns the launcher's exit status.

    ``target`` is what follows ``python`` on a command line: ``["train.py", "--lr", "0.1"]`` or
    ``["-m", "pkg.train"]``. ``devices_per_process`` gives each process that many fake CPU devices
    (it sets ``XLA_FLAGS=--xla_force_host_platform_device_count``, and ``JAX_PLATFORMS=cpu`` unless
    already set). ``gpus_per_process`` gives rank ``r`` the local accelerators ``r*K .. r*K+K-1``
    (through ``SPMDCOMM_LOCAL_DEVICE_IDS``, which :func:`spmdcomm.initialize` passes to JAX as
    ``local_device_ids``). ``coordinator`` is ``HOST:PORT`` (default: ``127.0.0.1`` and a free port).
    ``timeout`` ends an attempt after that many seconds (status 124). ``grace`` is the time between
    SIGTERM and SIGKILL when the job is stopped (a signal to the launcher, or the timeout), in which a
    preempted job agrees, finishes its steps in flight, saves and exits; after a process failed, the
    others get at most 3 s. ``env`` replaces ``os.environ`` as the base environment.

    ``max_restarts``: when a process fails (non-zero exit, killed, or the timeout expired), all are
    stopped and started again, up to that many times, each restart on a free coordinator port that
    no earlier attempt used (on ``coordinator``'s host when one is given). Every process sees the
    attempt's number in ``SPMDCOMM_RESTART_COUNT`` (0 first; :func:`spmdcomm.restart_count`). A
    SIGINT or SIGTERM to the launcher stops the job without a restart.

    A count below 1 (``nprocs``, ``devices_per_process``, ``gpus_per_process``), a negative
    ``max_restarts`` or a ``coordinator`` that is not ``HOST:PORT`` raises
    :class:`~spmdcomm.errors.SpmdError` before any process starts.
    """
    check_options(nprocs, devices_per_process, gpus_per_process, max_restarts)
    host, port = split_coordinator(coordinator)
    base = dict(os.environ if env is None else env)
    base.setdefault("PYTHONUNBUFFERED", "1")
    if devices_per_process is not None:
        base["XLA_FLAGS"] = _with_device_count(base.get("XLA_FLAGS", ""), devices_per_process)
        base.setdefault("JAX_PLATFORMS", "cpu")
    job = _Job(grace=grace)
    used_ports: set[int] = set()
    with _forward_signals(job):
        for attempt in range(max_restarts + 1):
            # A restart never reuses a port: the old coordinator's may still be held by a dying process.
            if port is None or attempt > 0:
                port = _fresh_port(host, used_ports)
            used_ports.add(port)
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if attempt > 0:
                job.say(f"restart {attempt} of {max_restarts}: starting {nprocs} process(es), coordinator {address}.")
            job.begin()
            for rank in range(nprocs):
                child_env = dict(base)
                child_env.update(
                    {
                        ENV_COORDINATOR: address,
                        ENV_NUM_PROCESSES: str(nprocs),
                        ENV_PROCESS_ID: str(rank),
                        ENV_LOCAL_RANK: str(rank),
                        ENV_LOCAL_WORLD_SIZE: str(nprocs),
                        ENV_RESTART_COUNT: str(attempt),
                    }
                )
                if gpus_per_process:
                    ids = range(rank * gpus_per_process, (rank + 1) * gpus_per_process)
                    child_env[ENV_LOCAL_DEVICE_IDS] = ",".join(map(str, ids))
                job.start(rank, [sys.executable, *target], child_env)
            job.forward_output()  # only now start threads: every fork above happened without them
            status = job.wait(timeout)
            if job.interrupted is not None:  # a stop from outside is never restarted
                return 128 + job.interrupted
            if status == 0:
                return 0
        if max_restarts:
            job.say(f"all {max_restarts} restart(s) used; exiting with status {status}.")
        return status


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_options(
    nprocs: int, devices_per_process: int | None, gpus_per_process: int | None, max_restarts: int
) -> None:
    """Raises :class:`~spmdcomm.errors.SpmdError` naming the flag when a count is below its least value."""
    # Checked up front: a zero device count would only fail later, inside every child's XLA start-up.
    for flag, name, value, least, fix in [
        ("-n", "nprocs", nprocs, 1, "pass -n N with N >= 1, the number of processes to start"),
        (
            "--devices-per-process",
            "devices_per_process",
            devices_per_process,
            1,
            "pass --devices-per-process K with K >= 1, or leave it out to keep the device count",
        ),
        (
            "--gpus-per-process",
            "gpus_per_process",
            gpus_per_process,
            1,
            "pass --gpus-per-process K with K >= 1, or leave it out to let every process see all GPUs",
        ),
        (
            "--max-restarts",
            "max_restarts",
            max_restarts,
            0,
            "pass --max-restarts K with K >= 0, the number of times to restart a failed job",
        ),
    ]:
        if value is not None and value < least:
            raise SpmdError(
                describe("launch", f"{flag} ({name}) must be at least {least}, got {value}.", fix=fix + ".")
            )


def split_coordinator(coordinator: str | None) -> tuple[str, int | None]:
    """``HOST:PORT`` as (host without IPv6 brackets, port); no address gives loopback and no port yet."""
    if coordinator is None:
        return "127.0.0.1", None
    parsed = host_and_port(coordinator)
    if parsed is None:
        raise SpmdError(
            describe(
                "launch",
                f"--coordinator (coordinator) must be HOST:PORT, got {coordinator!r}.",
                fix="pass e.g. 127.0.0.1:1234 (an IPv6 host goes in brackets: [::1]:1234), or leave it out "
                "to use 127.0.0.1 and a free port.",
            )
        )
    return parsed


# ------------------------------------------------------------------------------------------------


def _fresh_port(host: str, used: set[int]) -> int:
    # Bound where the coordinator will listen: on a loopback host itself, otherwise on every interface
    # (as spmdcomm.initialize does).
    bind_host = host if is_loopback(host) else ("::" if ":" in host else "0.0.0.0")
    port = free_port(bind_host)
    while port in used:  # the OS rarely hands out the same ephemeral port twice in a row
        port = free_port(bind_host)
    return port


def _with_device_count(flags: str, count: int) -> str:
    kept = [f for f in flags.split() if not f.startswith(_DEVICE_FLAG)]
    return " ".join([*kept, f"{_DEVICE_FLAG}={count}"])


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _die_with_parent() -> Callable[[], None] | None:
    """A function for the child to run between fork and exec: the kernel sends it SIGKILL when the
    launcher dies (Linux; elsewhere None). libc is looked up here, before forking."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


@dataclass
class _Job:
    """The processes of the current attempt, and a stop requested from outside (any attempt)."""

    grace: float
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    interrupted: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> None:
        """Forgets the previous attempt's processes (all ended and drained by :meth:`stop`)."""
        self.procs = {}
        self.threads = []

    def start(self, rank: int, cmd: list[str], env: dict[str, str]) -> None:
        self.procs[rank] = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )

    def forward_output(self) -> None:
        """Starts the threads that copy each process's output, prefixed with its rank."""
        for rank, proc in self.procs.items():
            for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(rank, src, dst, self.lock), daemon=True)
                t.start()
                self.threads.append(t)

    def wait(self, timeout: float | None) -> int:
        """Waits for the attempt to end, stops what still runs and returns the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.interrupted is not None:
                return self._interrupt(self.interrupted)
            codes = {rank: p.poll() for rank, p in self.procs.items()}
            failed = [(r, c) for r, c in codes.items() if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                running = sum(c is None for c in codes.values())
                self.say(
                    f"rank {rank} (pid {self.procs[rank].pid}) {_describe_status(code)}; "
                    f"stopping the other {running} running process(es)."
                )
                self.stop(grace=min(self.grace, FAILURE_GRACE_SECONDS))
                status = _exit_status(code)
                break
            if all(c == 0 for c in codes.values()):
                self._drain()
                return 0
            if deadline is not None and time.monotonic() > deadline:
                ranks = ", ".join(str(r) for r, c in codes.items() if c is None)
                self.say(
                    f"timed out: the timeout of {timeout:g} s expired with rank(s) {ranks} still running; "
                    "stopping all processes."
                )
                self.stop()
                status = _TIMEOUT_STATUS
                break
            time.sleep(_POLL_SECONDS)
        # A stop requested while the failed attempt was being stopped still wins over its failure.
        return self._interrupt(self.interrupted) if self.interrupted is not None else status

    def stop(self, sig: int = signal.SIGTERM, *, grace: float | None = None) -> None:
        """Sends ``sig`` to every running process group, then SIGKILL after ``grace`` seconds (default: the job's
        grace period)."""
        self._signal_all(sig)
        end = time.monotonic() + (self.grace if grace is None else grace)
        while time.monotonic() < end and any(p.poll() is None for p in self.procs.values()):
            time.sleep(_POLL_SECONDS)
        self._signal_all(signal.SIGKILL)
        for p in self.procs.values():
            p.wait()
        self._drain()

    def say(self, message: str) -> None:
        with self.lock:
            print(f"spmdcomm-launch: {message}", file=sys.stderr, flush=True)

    def _interrupt(self, sig: int) -> int:
        name = signal.Signals(sig).name
        self.say(f"received {name}; stopping all processes (a stop, not a failure: no restart).")
        self.stop(sig)
        return 128 + sig

    def _signal_all(self, sig: int) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)  # each child leads its own session: group id == pid
                except ProcessLookupError:
                    pass

    def _drain(self) -> None:
        for t in self.threads:
            t.join(timeout=2.0)


def _pump(rank: int, src: IO[bytes], dst: IO[str], lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] "
    for raw in iter(src.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            dst.write(prefix + line + "\n")
            dst.flush()
    src.close()


@contextlib.contextmanager
def _forward_signals(job: _Job) -> Iterator[None]:
    # While active, SIGINT and SIGTERM to the launcher mark the job as interrupted; its wait loop
    # then passes the signal on to every process. An exception on the way out stops the job.
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            saved[sig] = signal.signal(sig, lambda sig, _: setattr(job, "interrupted", sig))
    try:
        yield
    except BaseException:
        job.stop()
        raise
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
