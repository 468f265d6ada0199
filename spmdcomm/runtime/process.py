"""Where this process sits in the job: process and device counts, ranks, its devices, and the launcher's settings.

Every query works in a single process too (one process, index 0, local rank 0). A script joins a
multi-process job first, with :func:`~spmdcomm.initialize` (:mod:`spmdcomm.runtime.distributed`); ``spmdcomm-launch``
tells each process its place through the ``SPMDCOMM_*`` environment variables named here.

>>> import spmdcomm as sc
>>> sc.initialize()          # a single process: nothing to join
>>> sc.is_main_process(), sc.local_rank(), len(sc.process_devices())
(True, 0, 8)
"""

from __future__ import annotations

import os
import socket

import jax

from spmdcomm._env import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
)
from spmdcomm.errors import DistributedError, SpmdError, describe
from spmdcomm.runtime.transport import coordination_client, key_process, milliseconds

__all__ = [
    "is_main_process",
    "local_rank",
    "restart_count",
    "process_devices",
    "process_index",
    "process_count",
    "device_count",
    "local_device_count",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_LOCAL_RANK",
    "ENV_LOCAL_DEVICE_IDS",
    "ENV_LOCAL_WORLD_SIZE",
    "ENV_RESTART_COUNT",
]

_KV_PREFIX = "spmdcomm/host/"
_hosts: dict[int, str] = {}  # process id -> host name, filled by publish_host() during initialize()


def is_main_process(*, local: bool = False) -> bool:
    """Whether this is process 0 of the job (``local=True``: process 0 of its host, local rank 0).

    Args:
      local: ask about this host (local rank 0) instead of the whole job (process index 0).

    Returns:
      True on process 0 (``local=True``: on local rank 0), else False.

    Raises:
      DistributedError: with ``local=True``, when the local rank is unknown (see :func:`local_rank`).

    Examples:
      >>> sc.is_main_process()
      True
    """
    return (local_rank() if local else process_index()) == 0


def local_rank() -> int:
    """This process's index among the processes on its host (0 for a single process).

    Known from :func:`~spmdcomm.initialize` (processes publish their host names), else from the launcher's
    ``SPMDCOMM_LOCAL_RANK``, SLURM's ``SLURM_LOCALID`` or Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``.

    Returns:
      The local rank, an int >= 0; 0 for a single process.

    Raises:
      DistributedError: when the process joined a job without :func:`~spmdcomm.initialize` and no launcher
        variable gives its local rank.
    """
    if _hosts:
        me = process_index()
        return sorted(p for p, h in _hosts.items() if h == _hosts[me]).index(me)
    for var in (ENV_LOCAL_RANK, "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    if process_count() == 1:
        return 0
    raise DistributedError(
        describe(
            "local_rank",
            "this process joined the job without spmdcomm.initialize() and no launcher variable gives its local rank.",
            fix=f"call spmdcomm.initialize() instead of jax.distributed.initialize(), or set {ENV_LOCAL_RANK}.",
        )
    )


def restart_count() -> int:
    """How many times ``spmdcomm-launch --max-restarts`` has restarted this job.

    Read from ``SPMDCOMM_RESTART_COUNT``. A script can use it to resume from its last checkpoint instead of
    starting over.

    Returns:
      The number of restarts: 0 on the first attempt and outside the launcher.

    Raises:
      DistributedError: when ``SPMDCOMM_RESTART_COUNT`` is set but not an integer.

    Examples:
      >>> sc.restart_count()
      0
    """
    return env_int(ENV_RESTART_COUNT, "restart_count") or 0


def process_devices(process: int | None = None) -> list[jax.Device]:
    """The devices attached to process ``process`` (default: this one), in device-id order.

    Args:
      process: a process index in ``[0, process_count())``; None for this process.

    Returns:
      The list of that process's devices: ``jax.local_devices()`` for this process, else sorted by id.

    Raises:
      SpmdError: when ``process`` is not an int in ``[0, process_count())``.

    Examples:
      >>> [d.id for d in sc.process_devices(0)][:3]
      [0, 1, 2]
    """
    n = process_count()
    if process is None:
        return list(jax.local_devices())
    if not isinstance(process, int) or not 0 <= process < n:
        raise SpmdError(
            describe(
                "process_devices",
                f"process={process!r} is out of range for a job of {n} process(es).",
                fix=f"pass a process index in [0, {n}).",
            )
        )
    return sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


def process_index() -> int:
    """This process's index among all processes.

    Returns:
      An int in ``[0, process_count())``; 0 in a single-process run.
    """
    return jax.process_index()


def process_count() -> int:
    """The number of processes in the job.

    Returns:
      The process count; 1 in a single-process run.
    """
    return jax.process_count()


def device_count() -> int:
    """The number of devices across all processes.

    Returns:
      ``jax.device_count()``: every process's devices together.
    """
    return jax.device_count()


def local_device_count() -> int:
    """The number of devices attached to this process.

    Returns:
      ``jax.local_device_count()``.
    """
    return jax.local_device_count()


def env_int(var: str, fn: str = "initialize") -> int | None:
    """The integer in environment variable ``var``; None when it is unset or empty.

    A value that is not an integer raises :class:`~spmdcomm.errors.DistributedError` naming ``fn``.
    """
    text = os.environ.get(var)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(
            describe(
                fn,
                f"environment variable {var}={text!r} is not an integer.",
                fix=f"set {var} to an integer or unset it.",
            )
        ) from None


def publish_host(pid: int, timeout: float) -> None:
    """Publishes this process's host name as process ``pid`` and learns every other process's.

    :func:`local_rank` counts the processes on this host from them. Every process of the job calls this from
    :func:`~spmdcomm.initialize`, once joined; it waits at most ``timeout`` seconds for the others.
    """
    client = coordination_client("initialize")
    client.key_value_set(f"{_KV_PREFIX}{pid}", socket.gethostname(), allow_overwrite=True)
    client.wait_at_barrier("spmdcomm/initialize", milliseconds(timeout))
    _hosts.update({key_process(k): v for k, v in client.key_value_dir_get(_KV_PREFIX)})
