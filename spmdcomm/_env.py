"""The contract between ``spmdcomm-launch`` and the processes it starts: the ``SPMDCOMM_*`` environment variables
and how a coordinator address reads. No JAX here: the launcher imports this module, and a supervisor that only
starts, watches and restarts processes should not pay for starting JAX (1.2 s of CPU per job on a 2-core machine).

>>> host_and_port("[::1]:1234"), is_loopback("127.0.0.1")
(('::1', 1234), True)
"""

from __future__ import annotations

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_LOCAL_RANK",
    "ENV_LOCAL_DEVICE_IDS",
    "ENV_LOCAL_WORLD_SIZE",
    "ENV_RESTART_COUNT",
    "host_and_port",
    "is_loopback",
]

# The environment that spmdcomm-launch sets for each process and initialize() reads.
ENV_COORDINATOR = "SPMDCOMM_COORDINATOR"  # HOST:PORT of process 0's coordination service
ENV_NUM_PROCESSES = "SPMDCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "SPMDCOMM_PROCESS_ID"
ENV_LOCAL_RANK = "SPMDCOMM_LOCAL_RANK"  # index among the processes on this host
ENV_LOCAL_DEVICE_IDS = "SPMDCOMM_LOCAL_DEVICE_IDS"  # comma-separated accelerator ids for this process
ENV_LOCAL_WORLD_SIZE = "SPMDCOMM_LOCAL_WORLD_SIZE"  # number of processes on this host
ENV_RESTART_COUNT = "SPMDCOMM_RESTART_COUNT"  # how often the launcher restarted the job (--max-restarts)


def host_and_port(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` as (host without IPv6 brackets, port), or None when it is not of that form."""
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    return host in ("localhost", "::1") or host.startswith("127.")
