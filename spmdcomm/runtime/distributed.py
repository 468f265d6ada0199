"""Joining a multi-process job: ``initialize``, ``is_initialized`` and the coordinator address they check.

Call :func:`initialize` once at the top of a script, before any other JAX call. The same script
then runs as one process (``initialize`` does nothing) or as one of N processes started by
``spmdcomm-launch``, ``srun`` on SLURM, ``mpirun`` (Open MPI) or a Kubernetes job; JAX's own
distributed runtime does the work (its coordination service; gloo collectives on CPU, NCCL on GPU).
Where the process then sits in the job is :mod:`spmdcomm.runtime.process`.

>>> import spmdcomm as sc
>>> sc.initialize()          # a single process: nothing to join
>>> sc.is_initialized()
False
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from spmdcomm._env import host_and_port, is_loopback
from spmdcomm._jax_compat import auto_detect_cluster, backends_initialized
from spmdcomm.errors import CoordinatorError, DistributedError, describe
from spmdcomm.runtime.process import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    env_int,
    process_count,
    process_index,
    publish_host,
)

__all__ = ["initialize", "is_initialized", "DEFAULT_INIT_TIMEOUT"]

# Seconds initialize() waits for the coordinator to be reachable and for every process to join.
DEFAULT_INIT_TIMEOUT = 120.0


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    timeout: float = DEFAULT_INIT_TIMEOUT,
    exit_on_uncaught_error: bool = True,
) -> None:
    """Joins this process to a multi-process JAX job; does nothing when there is only one process.

    Each setting comes from its argument, else from the launcher's environment
    (``SPMDCOMM_COORDINATOR``, ``SPMDCOMM_NUM_PROCESSES``, ``SPMDCOMM_PROCESS_ID``), else from
    JAX's cluster auto-detection (SLURM, Open MPI, Kubernetes, Cloud TPU). With none of them set,
    the job is a single process and nothing happens. CPU collectives use gloo. Calling it again
    once joined is a no-op; it must come before anything starts JAX's backend (``jax.devices()``,
    creating an array).

    A process other than 0 first checks that it can open a TCP connection to the coordinator; if it
    cannot within ``timeout`` seconds it raises :class:`~spmdcomm.errors.CoordinatorError` naming
    the address (JAX itself would abort the process). Process 0 checks that the port is free.
    ``timeout`` also bounds the wait for all processes to join: when one never arrives, JAX aborts
    the processes that are waiting after about that long (it offers no way to turn this into an
    exception).

    With ``exit_on_uncaught_error`` (the default) an exception that nothing catches, once it has ended the script
    and printed its traceback, ends the process at once with status 1 instead of running JAX's exit handler:
    that handler waits up to 5 minutes at a shutdown barrier for processes that are themselves waiting for
    this one inside a collective, so the job would hang instead of failing, and the launcher would see the
    failure only at its timeout. Pass ``False`` to keep Python's normal exit (and its ``atexit`` handlers).

    Args:
      coordinator_address: ``HOST:PORT`` of process 0's coordination service (an IPv6 host in brackets);
        default ``SPMDCOMM_COORDINATOR``, else auto-detection.
      num_processes: the number of processes in the job; default ``SPMDCOMM_NUM_PROCESSES``, else
        auto-detection.
      process_id: this process's index in ``[0, num_processes)``; default ``SPMDCOMM_PROCESS_ID``, else
        auto-detection.
      local_device_ids: the ids of the accelerators this process uses; default ``SPMDCOMM_LOCAL_DEVICE_IDS``
        (comma-separated), else all it sees.
      timeout: seconds to wait for the coordinator to be reachable and for every process to join (default
        :data:`DEFAULT_INIT_TIMEOUT`, 120).
      exit_on_uncaught_error: end the process with status 1 right after an uncaught exception's traceback.

    Raises:
      CoordinatorError: when the coordinator is not reachable within ``timeout`` (processes other than 0), or
        its port is not free (process 0).
      DistributedError: when a multi-process job lacks the address or this process's id, the address is not
        ``HOST:PORT``, JAX's backend already runs, a launcher variable is not an integer, or a second call
        names another process count or id.
    """
    if jax.distributed.is_initialized():
        _check_same_job(num_processes, process_id)
        return
    address, count, pid, device_ids = _settings(
        coordinator_address, num_processes, process_id, local_device_ids, timeout
    )
    if count is None or count == 1:
        return
    if address is None or pid is None:
        raise DistributedError(
            describe(
                "initialize",
                f"a job of {count} processes needs a coordinator address and this "
                f"process's id, but got coordinator_address={address!r}, process_id={pid!r}.",
                fix=f"pass them, set {ENV_COORDINATOR} and {ENV_PROCESS_ID}, or start the script with spmdcomm-launch.",
            )
        )
    host, port = _split_address(address)
    if backends_initialized():
        raise DistributedError(
            describe(
                "initialize",
                "JAX's backend is already running in this process (something called "
                "jax.devices(), created an array or ran a computation), so it can no longer join a "
                "job.",
                fix="call spmdcomm.initialize() at the top of the script, before any other JAX call.",
            )
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + timeout
    if pid == 0:
        _check_port_free(address, host, port)
    else:
        _wait_reachable(address, host, port, pid, timeout, deadline)
    jax.distributed.initialize(
        address,
        count,
        pid,
        local_device_ids=device_ids,
        cluster_detection_method="deactivate",
        initialization_timeout=max(1, math.ceil(deadline - time.monotonic())),
        coordinator_bind_address=f"{host}:{port}" if is_loopback(host) else None,
    )
    publish_host(pid, timeout)
    if exit_on_uncaught_error:
        _exit_at_once_on_uncaught_errors()


def is_initialized() -> bool:
    """Whether this process has joined a multi-process job.

    Returns:
      True once :func:`initialize` (or ``jax.distributed.initialize``) has joined a job; False for a single
      process.
    """
    return jax.distributed.is_initialized()


# ------------------------------------------------------------------------------------------------


def _settings(
    address: str | None,
    count: int | None,
    pid: int | None,
    device_ids: Sequence[int] | None,
    timeout: float,
) -> tuple[str | None, int | None, int | None, Sequence[int] | None]:
    address = address or os.environ.get(ENV_COORDINATOR) or None
    count = count if count is not None else env_int(ENV_NUM_PROCESSES)
    pid = pid if pid is not None else env_int(ENV_PROCESS_ID)
    if device_ids is None and os.environ.get(ENV_LOCAL_DEVICE_IDS):
        device_ids = [int(i) for i in os.environ[ENV_LOCAL_DEVICE_IDS].split(",")]
    if None in (address, count, pid):
        address, count, pid, device_ids = auto_detect_cluster(
            address, count, pid, device_ids, timeout=max(1, math.ceil(timeout))
        )
    return address, count, pid, device_ids


def _check_same_job(count: int | None, pid: int | None) -> None:
    if (count not in (None, process_count())) or (pid not in (None, process_index())):
        raise DistributedError(
            describe(
                "initialize",
                f"already joined as process {process_index()} of {process_count()}, but "
                f"called again with num_processes={count}, process_id={pid}.",
                fix="call initialize() once per process (later calls without arguments are no-ops).",
            )
        )


def _split_address(address: str) -> tuple[str, int]:
    parsed = host_and_port(address)
    if parsed is None:
        raise DistributedError(
            describe(
                "initialize",
                f"coordinator address {address!r} is not HOST:PORT.",
                fix="pass e.g. '10.0.0.1:1234' (an IPv6 host goes in brackets: '[::1]:1234').",
            )
        )
    return parsed


def _wait_reachable(address: str, host: str, port: int, pid: int, timeout: float, deadline: float) -> None:
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return
        except OSError as e:
            last = e
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise CoordinatorError(
        describe(
            "initialize",
            f"process {pid} could not reach the coordinator at {address} within {timeout:g} s (last error: {last}).",
            fix=f"check that process 0 is running and was given the same address, that {host} resolves "
            f"to the machine running process 0 and port {port} is open between the machines "
            "(firewall), or raise `timeout` if process 0 starts late.",
        )
    )


def _check_port_free(address: str, host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host if is_loopback(host) else ("::" if family == socket.AF_INET6 else "")
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as e:
            raise CoordinatorError(
                describe(
                    "initialize",
                    f"process 0 cannot serve as coordinator at {address}: port {port} is not available ({e}).",
                    fix="choose a free port (spmdcomm-launch picks one when --coordinator is not "
                    "given), or stop what listens on it.",
                )
            ) from None


def _exit_at_once_on_uncaught_errors() -> None:
    """An uncaught exception ends the process at once with status 1, after printing its traceback.

    JAX's exit handler waits at a shutdown barrier for every process (up to 5 minutes); the other processes
    are meanwhile waiting for this one inside a collective, so a plain exit would hang the job instead of
    failing it, and the launcher (and ``--max-restarts``) would see the failure only at its timeout.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook
