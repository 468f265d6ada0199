"""Barriers and ordered blocks across processes, none of which can hang silently.

Each is a sync point of the timed transport (:mod:`spmdcomm.runtime.transport`): every wait has a timeout, after
which the error names the processes that did not arrive and the last sync point of each; processes whose k-th
sync points differ raise :class:`~spmdcomm.errors.ProcessMismatchError`. With one process, barriers only wait for
this process's device work.

>>> import spmdcomm as sc
>>> sc.barrier("setup")
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import traceback
from collections.abc import Iterator

import jax

from spmdcomm.errors import BarrierTimeoutError, RemoteProcessError, describe
from spmdcomm.runtime.process import is_main_process, process_count, process_index
from spmdcomm.runtime.transport import (
    DEFAULT_TIMEOUT,
    call_site,
    coordination_client,
    exchange,
    milliseconds,
    refuse_in_trace,
)

__all__ = ["barrier", "sync_devices", "main_process_first", "DEFAULT_TIMEOUT"]


def barrier(name: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Waits until every process has reached this barrier (and this process's device work is done).

    ``name`` labels the barrier: processes whose k-th sync points have different names raise
    :class:`~spmdcomm.errors.ProcessMismatchError`. After ``timeout`` seconds every waiting process
    raises :class:`~spmdcomm.errors.BarrierTimeoutError` naming the missing processes and where each
    process last synchronised. With one process it only waits for local device work.

    Args:
      name: a label for the barrier, compared across processes; None for an unnamed barrier.
      timeout: seconds to wait for the other processes.

    Raises:
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.
      ProcessMismatchError: when the processes' k-th sync points differ (another name or another call).
      TracedCallError: when called inside a traced function (``jax.jit``, ``spmd``, ``lax.scan``, ...).

    Examples:
      >>> sc.barrier()
    """
    refuse_in_trace("barrier")
    _wait_local_devices()
    if process_count() > 1:
        exchange("barrier", f"barrier {name!r}" if name else "barrier", b"", timeout=timeout)


def sync_devices(*, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Returns when every device of every process has finished the work queued on it so far.

    Each process waits for its own devices, then all processes meet at a bounded barrier (it never
    runs a device collective, which could hang without a timeout).

    Args:
      timeout: seconds to wait for the other processes at the barrier.

    Raises:
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.
      ProcessMismatchError: when the processes' k-th sync points differ.
      TracedCallError: when called inside a traced function.

    Examples:
      >>> sc.sync_devices()
    """
    refuse_in_trace("sync_devices")
    _wait_local_devices()
    if process_count() > 1:
        exchange("sync_devices", "sync_devices", b"", timeout=timeout)


@contextlib.contextmanager
def main_process_first(*, local: bool = False, timeout: float = DEFAULT_TIMEOUT) -> Iterator[None]:
    """Runs the block on the main process first; the other processes run it once main has finished.

    The main process is process 0, or with ``local=True`` the local-rank-0 process of each host
    (the others on that host wait for it): the pattern for downloading or preprocessing a dataset
    once. If the main process raises inside the block, the waiting processes raise
    :class:`~spmdcomm.errors.RemoteProcessError` with its error instead of hanging; if it does not
    finish within ``timeout`` seconds, they raise :class:`~spmdcomm.errors.BarrierTimeoutError`.

    Args:
      local: one main process per host (local rank 0) instead of process 0 of the job.
      timeout: seconds the other processes wait for the main process to finish the block.

    Raises:
      RemoteProcessError: on the waiting processes, when the main process raised inside the block.
      BarrierTimeoutError: on the waiting processes, when the main process does not finish within ``timeout``.
      TracedCallError: when entered inside a traced function.

    Examples:
      >>> with sc.main_process_first():
      ...     data = list(range(3))
    """
    refuse_in_trace("main_process_first")
    if process_count() == 1:
        yield
        return
    client = coordination_client("main_process_first")
    number = next(_FIRST_BLOCKS)
    group = socket.gethostname() if local else "all"
    key = f"spmdcomm/first/{number}/{group}"
    if is_main_process(local=local):
        try:
            yield
        except BaseException as e:
            failure = {"error": _summary(e), "process": process_index()}
            client.key_value_set(key, json.dumps(failure))
            raise
        client.key_value_set(key, json.dumps({"error": None}))
        return
    who = "the main process of this host" if local else "the main process"
    try:
        done = json.loads(client.blocking_key_value_get(key, milliseconds(timeout)))
    except jax.errors.JaxRuntimeError:
        raise BarrierTimeoutError(
            describe(
                "main_process_first",
                f"process {process_index()} waited {timeout:g} s for {who} to "
                f"finish the block (main_process_first #{number}, entered at "
                f"{call_site()}), but it did not.",
                fix="make sure every process enters main_process_first the same number of times, or "
                "raise `timeout` if the main process's work is slow.",
            )
        ) from None
    if done["error"]:
        raise RemoteProcessError(
            describe(
                "main_process_first",
                f"{who} (process {done['process']}) raised inside the block, "
                f"so process {process_index()} does not run it: {done['error']}",
                fix="see the main process's traceback for the cause.",
            )
        )
    yield


# ------------------------------------------------------------------------------------------------

_FIRST_BLOCKS = itertools.count(1)


def _wait_local_devices() -> None:
    jax.block_until_ready(jax.live_arrays())


def _summary(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return text + where
