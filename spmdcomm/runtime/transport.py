"""The one timed transport for cross-process agreement, below everything that agrees across processes.

Every way spmdcomm checks that processes agree goes through numbered sync points in JAX's coordination
service (the key-value store and bounded barriers of the job that :func:`spmdcomm.initialize` joined). Every
wait has a timeout. On timeout the error names the processes that did not arrive and, for every process, the
last sync point it reached: its name, sequence number and call site.

Each process numbers its sync points (barriers, syncs, host collectives, debug and replica checks) 1, 2, 3...;
the k-th sync point of every process meets the k-th of the others. When they differ (process 0 is in
``barrier("a")`` while process 1 is in ``barrier("b")`` or in ``host_all_reduce``), every process raises
:class:`~spmdcomm.errors.ProcessMismatchError` instead of pairing up the wrong calls. The public barriers are in
:mod:`spmdcomm.runtime.sync`, the host collectives in :mod:`spmdcomm.runtime.host_collectives`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from spmdcomm._jax_compat import coordination_client as jax_coordination_client
from spmdcomm.errors import BarrierTimeoutError, DistributedError, ProcessMismatchError, TracedCallError, describe

__all__ = [
    "DEFAULT_TIMEOUT",
    "Channel",
    "exchange",
    "check_same_across_processes",
    "raise_if_different",
    "refuse_in_trace",
    "coordination_client",
    "call_site",
    "milliseconds",
]

# Seconds every wait of a sync point allows by default.
DEFAULT_TIMEOUT = 300.0


def coordination_client(fn: str) -> Any:
    """JAX's coordination-service client of this job (barriers and a key-value store).

    ``fn`` names the caller for the error raised when the process has not joined a job.
    """
    client = jax_coordination_client()
    if client is None:
        raise DistributedError(
            describe(
                fn,
                "this process has not joined a multi-process job.",
                fix="call spmdcomm.initialize() at the top of the script (under spmdcomm-launch, "
                "SLURM, Open MPI or Kubernetes it finds its settings).",
            )
        )
    return client


class Channel:
    """A sequence of numbered sync points: the k-th exchange of a process meets the k-th of the others.

    Barriers, host collectives and the debug and replica checks share the main channel (:func:`exchange`),
    so they must come in the same order on every process. A loop that synchronises from another thread
    (:func:`spmdcomm.join_batches` inside a prefetch thread) opens a channel of its own, named the same on
    every process, so that its sync points never pair up with the main thread's. One thread at a time may
    use a channel.
    """

    def __init__(self, name: str):
        self.prefix = f"spmdcomm/sync/{name}/"
        self.seq = 0

    def exchange(self, fn: str, label: str, payload: bytes, *, timeout: float) -> list[bytes]:
        """Every process's ``payload``, in process order, once all have reached this sync point.

        ``label`` names the sync point: processes whose k-th sync points have different labels raise
        :class:`~spmdcomm.errors.ProcessMismatchError` listing each one's label and call site. After
        ``timeout`` seconds every waiting process raises :class:`~spmdcomm.errors.BarrierTimeoutError`
        naming the processes that did not arrive. Multi-process jobs only.
        """
        client = coordination_client(fn)
        self.seq += 1
        seq, me, n = self.seq, jax.process_index(), jax.process_count()
        record = {"label": label, "seq": seq, "site": call_site()}
        header = json.dumps(record).encode()
        # One key per process and sync point holds the record and the payload, so that a sync point
        # costs one write, the barrier and one directory read.
        client.key_value_set_bytes(f"{self.prefix}{seq}/{me}", header + b"\n" + payload)
        client.key_value_set(f"{self.prefix}last/{me}", header.decode(), allow_overwrite=True)
        try:
            client.wait_at_barrier(f"{self.prefix}{seq}", milliseconds(timeout))
        except jax.errors.JaxRuntimeError as e:
            raise self._timeout_error(fn, client, record, n, timeout, e) from None
        entries = {_pid(k): v.split(b"\n", 1) for k, v in client.key_value_dir_get_bytes(f"{self.prefix}{seq}/")}
        _check_labels(fn, record, {p: json.loads(head) for p, (head, _) in entries.items()})
        # Every process has passed this barrier, so all are done reading the previous sync point's keys.
        if seq > 1:
            _try(lambda: client.key_value_delete(f"{self.prefix}{seq - 1}/{me}"), None)
        return [entries[p][1] for p in range(n)]

    def _timeout_error(
        self, fn: str, client: Any, mine: dict[str, Any], n: int, timeout: float, cause: Exception
    ) -> BarrierTimeoutError:
        seq = mine["seq"]
        arrived = {_pid(k) for k, _ in _try(lambda: client.key_value_dir_get_bytes(f"{self.prefix}{seq}/"), [])}
        missing = [p for p in range(n) if p not in arrived]
        last = []
        for p in range(n):
            text = _try(lambda p=p: client.key_value_try_get(f"{self.prefix}last/{p}"), None)
            last.append(f"process {p}: " + (_where(json.loads(text)) if text else "no sync point yet"))
        if missing:
            what = f"process(es) {missing} did not arrive within {timeout:g} s"
        else:
            what = (
                f"every process arrived, but not within {timeout:g} s of the first (or the barrier "
                f"failed: {str(cause).splitlines()[0]})"
            )
        return BarrierTimeoutError(
            describe(
                fn,
                f"{_where(mine)} on process {jax.process_index()}: {what}. Last sync point of each "
                "process: " + "; ".join(last) + ".",
                fix="make every process call the same barriers and host collectives in the same order, "
                "check that no process has died or is stuck, or raise `timeout` if a process is slow.",
            )
        )


def exchange(fn: str, label: str, payload: bytes, *, timeout: float = DEFAULT_TIMEOUT) -> list[bytes]:
    """Every process's ``payload`` bytes, in process order, through a sync point of the main channel.

    The building block of every agreement check (see :meth:`Channel.exchange`). Multi-process jobs only.
    """
    return _MAIN.exchange(fn, label, payload, timeout=timeout)


def check_same_across_processes(
    fn: str, what: str, description: str, *, fix: str, timeout: float = DEFAULT_TIMEOUT
) -> None:
    """Raises :class:`~spmdcomm.errors.ProcessMismatchError` on every process unless all pass the same
    ``description``.

    ``description`` is text that captures what must agree (e.g. a tree's structure, shapes and dtypes);
    ``what`` names it in the message. The processes exchange its digest and first 64 KiB (one sync
    point); the error names each process that differs from process 0 and shows both descriptions around
    their first difference. With one process it returns at once.
    """
    if jax.process_count() == 1:
        return
    text = description.encode()
    payload = hashlib.sha256(text).digest() + text[:_SHOWN_BYTES]
    got = exchange(fn, f"check {what}", payload, timeout=timeout)
    digests = [b[:32] for b in got]
    if len(set(digests)) > 1:
        shown = [b[32:].decode(errors="replace") for b in got]
        raise ProcessMismatchError(_mismatch(fn, what, shown, [d != digests[0] for d in digests], fix))


def raise_if_different(fn: str, what: str, descriptions: Sequence[str], *, fix: str) -> None:
    """Raises :class:`~spmdcomm.errors.ProcessMismatchError` unless every process's description (one per
    process, in process order, as an :func:`exchange` returns them) equals process 0's; the message is
    that of :func:`check_same_across_processes`."""
    differ = [d != descriptions[0] for d in descriptions]
    if any(differ):
        raise ProcessMismatchError(_mismatch(fn, what, list(descriptions), differ, fix))


def refuse_in_trace(fn: str, tree: Any = None) -> None:
    """Raises :class:`~spmdcomm.errors.TracedCallError` when called while JAX traces a program.

    Host-side synchronisation inside ``jax.jit``, ``shard_map``, ``lax.scan`` or ``jax.checkpoint`` would run
    once, while tracing, and be absent from the compiled program: a silent no-op on every later call. Under
    plain ``jax.grad`` or ``jax.vmap`` Python runs eagerly, so those calls are allowed.
    """
    if not (any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)) or _staging()):
        return
    raise TracedCallError(
        describe(
            fn,
            "was called inside a traced function (jax.jit, shard_map, spmd, lax.scan, jax.checkpoint, ...). "
            "It synchronises processes from the host, so it would run once while JAX traces the function and be "
            "absent from the compiled program.",
            fix="call it outside the traced function, e.g. between two calls of the compiled step; inside the "
            "program use device collectives (spmdcomm.psum, all_gather, broadcast, ...), which are part of it.",
        )
    )


def call_site() -> str:
    """``file:line`` of the innermost frame outside spmdcomm and contextlib."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if os.path.dirname(path) != here and not path.endswith("contextlib.py"):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def milliseconds(seconds: float) -> int:
    """A timeout for the coordination service, which counts whole milliseconds (at least 1)."""
    return max(1, int(seconds * 1000))


# ------------------------------------------------------------------------------------------------

_MAIN = Channel("main")
# How much of its description check_same_across_processes sends with the digest, to show a difference.
_SHOWN_BYTES = 64 * 1024
# Processes named, with excerpts, in a mismatch message.
_LISTED = 3


def _staging() -> bool:
    # Only a staging trace (jit, shard_map, scan, checkpoint) turns a fresh constant computation into a tracer;
    # the probe costs about 20 us eagerly, nothing next to a host synchronisation.
    return isinstance(jax.lax.iota(np.int32, 1), jax.core.Tracer)


def _pid(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def _where(record: dict[str, Any]) -> str:
    return f"{record['label']} (#{record['seq']}, called at {record['site']})"


def _check_labels(fn: str, mine: dict[str, Any], records: dict[int, dict[str, Any]]) -> None:
    if len({r["label"] for r in records.values()}) == 1:
        return
    lines = "; ".join(f"process {p}: {_where(r)}" for p, r in sorted(records.items()))
    raise ProcessMismatchError(
        describe(
            fn,
            f"the processes reached different sync points as their #{mine['seq']}: {lines}.",
            fix="make every process call the same barriers and host collectives in the same order (a "
            "call inside a branch that only some processes take is the usual cause).",
        )
    )


def _try(get: Callable[[], Any], default: Any) -> Any:
    try:
        return get()
    except jax.errors.JaxRuntimeError:
        return default


def _mismatch(fn: str, what: str, texts: list[str], differ: list[bool], fix: str) -> str:
    """Names the processes whose text differs from process 0's, quoting both around the first difference."""
    bad = [p for p, d in enumerate(differ) if d]
    parts = []
    for p in bad[:_LISTED]:
        a, b = texts[p], texts[0]
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same = a == b  # the difference lies beyond the part that was sent
        parts.append(
            f"process {p} differs after the first {len(a)} characters"
            if same
            else f"process {p} has {_excerpt(a, i)}, process 0 has {_excerpt(b, i)}"
        )
    more = f" ({len(bad) - _LISTED} more not shown)" if len(bad) > _LISTED else ""
    message = f"process(es) {bad} passed {what} that differ from process 0's (seen on process {jax.process_index()})"
    return describe(fn, f"{message}: {'; '.join(parts)}{more}.", fix=fix)


def _excerpt(text: str, i: int) -> str:
    start, end = max(0, i - 60), max(0, i - 60) + 160
    return ("..." if start else "") + repr(text[start:end]) + ("..." if end < len(text) else "")
