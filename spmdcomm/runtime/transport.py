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

import json
import os
import sys
import zlib
from collections.abc import Callable, Mapping
from functools import partial
from types import FrameType
from typing import Any, TypeVar

import jax
import numpy as np

from spmdcomm._jax_compat import coordination_client as jax_coordination_client
from spmdcomm.errors import BarrierTimeoutError, DistributedError, ProcessMismatchError, TracedCallError, describe

__all__ = [
    "DEFAULT_TIMEOUT",
    "Channel",
    "exchange",
    "check_same_across_processes",
    "refuse_in_trace",
    "coordination_client",
    "call_site",
    "milliseconds",
    "attempt",
    "key_process",
]

T = TypeVar("T")

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
        entries = {key_process(k): v.split(b"\n", 1) for k, v in client.key_value_dir_get_bytes(f"{self.prefix}{seq}/")}
        _check_labels(fn, record, {p: json.loads(head) for p, (head, _) in entries.items()})
        # Every process has passed this barrier, so all are done reading the previous sync point's keys.
        if seq > 1:
            attempt(lambda: client.key_value_delete(f"{self.prefix}{seq - 1}/{me}"))
        return [entries[p][1] for p in range(n)]

    def _timeout_error(
        self, fn: str, client: Any, mine: dict[str, Any], n: int, timeout: float, cause: Exception
    ) -> BarrierTimeoutError:
        seq = mine["seq"]
        entries, _ = attempt(lambda: client.key_value_dir_get_bytes(f"{self.prefix}{seq}/"))
        arrived = {key_process(k) for k, _ in entries or []}
        missing = [p for p in range(n) if p not in arrived]
        last = []
        for p in range(n):
            text, _ = attempt(partial(client.key_value_try_get, f"{self.prefix}last/{p}"))
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
    fn: str,
    what: str,
    signature: str | Mapping[str, str],
    *,
    fix: str,
    timeout: float = DEFAULT_TIMEOUT,
    payload: bytes = b"",
    label: str | None = None,
    channel: Channel | None = None,
) -> list[bytes]:
    """Every process's ``payload``, in process order, once all have passed the same ``signature``; else
    :class:`~spmdcomm.errors.ProcessMismatchError` on every process.

    The one way spmdcomm asks "did every process pass the same tree". ``signature`` is what must agree: a text,
    or leaf path -> description (e.g. shape and dtype) in tree order, and ``what`` names it in the message. The
    error names the call ``fn``, each process that differs from process 0 and, for a mapping, its differing leaf
    paths with both descriptions (for a text, both texts around their first difference). Signature and payload
    travel together through one sync point of ``channel`` (default: the main one), labelled ``label`` (default
    ``check <what>``) and bounded by ``timeout`` like every sync point. With one process nothing is exchanged.

    >>> check_same_across_processes("f", "trees", {"['w']": "(3,) float32"}, fix="-", payload=b"mine")
    [b'mine']
    """
    if jax.process_count() == 1:
        return [payload]
    send = (channel or _MAIN).exchange
    got = [_unpack(b) for b in send(fn, label or f"check {what}", _pack(signature, payload), timeout=timeout)]
    differ = [sig != got[0][0] for sig, _ in got]
    if any(differ):
        signatures = [sig for sig, _ in got]
        raise ProcessMismatchError(_mismatch(fn, what, signatures, differ, fix, text=isinstance(signature, str)))
    return [data for _, data in got]


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
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if os.path.dirname(path) != here and not path.endswith("contextlib.py"):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def attempt(call: Callable[[], T]) -> tuple[T | None, str | None]:
    """``(call(), None)``, or ``(None, why)`` when the coordination service refused the call (unreachable, a key
    that is not set, a barrier that timed out): for the waits that must not raise, e.g. in a daemon thread.

    >>> attempt(lambda: 7)
    (7, None)
    """
    try:
        return call(), None
    except jax.errors.JaxRuntimeError as e:
        return None, f"failed: {str(e).splitlines()[0]}"


def key_process(key: str) -> int:
    """The process index that ends a per-process key (``.../<process>``) of the key-value store.

    >>> key_process("spmdcomm/sync/main/3/1")
    1
    """
    return int(key.rsplit("/", 1)[1])


def milliseconds(seconds: float) -> int:
    """A timeout for the coordination service, which counts whole milliseconds (at least 1)."""
    return max(1, int(seconds * 1000))


# ------------------------------------------------------------------------------------------------

_MAIN = Channel("main")
# Processes named in a mismatch message, and leaves named per process.
_LISTED = 3


def _staging() -> bool:
    # Only a staging trace (jit, shard_map, scan, checkpoint) turns a fresh constant computation into a tracer;
    # the probe costs about 20 us eagerly, nothing next to a host synchronisation.
    return isinstance(jax.lax.iota(np.int32, 1), jax.core.Tracer)


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


def _pack(signature: str | Mapping[str, str], payload: bytes) -> bytes:
    """The signature (compressed JSON of ``[path, description]`` pairs; a text is one pair with path ``""``),
    after its length, then the payload."""
    entries = [["", signature]] if isinstance(signature, str) else [[k, v] for k, v in signature.items()]
    packed = zlib.compress(json.dumps(entries).encode())
    return len(packed).to_bytes(8, "little") + packed + payload


def _unpack(data: bytes) -> tuple[list[list[str]], bytes]:
    size = int.from_bytes(data[:8], "little")
    return json.loads(zlib.decompress(data[8 : 8 + size])), data[8 + size :]


def _mismatch(
    fn: str, what: str, signatures: list[list[list[str]]], differ: list[bool], fix: str, *, text: bool
) -> str:
    """Names the processes whose signature differs from process 0's, with their differing leaves (or, for a
    text, both texts around the first difference)."""
    bad = [p for p, d in enumerate(differ) if d]
    parts = []
    for p in bad[:_LISTED]:
        if text:
            a, b = signatures[p][0][1], signatures[0][0][1]
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            parts.append(f"process {p} has {_excerpt(a, i)}, process 0 has {_excerpt(b, i)}")
        else:
            parts.append(f"process {p}: {_leaf_differences(p, dict(signatures[p]), dict(signatures[0]))}")
    more = f" ({len(bad) - _LISTED} more not shown)" if len(bad) > _LISTED else ""
    message = f"process(es) {bad} passed {what} that differ from process 0's (seen on process {jax.process_index()})"
    return describe(fn, f"{message}: {'; '.join(parts)}{more}.", fix=fix)


def _leaf_differences(p: int, mine: dict[str, str], ref: dict[str, str]) -> str:
    """The first leaves at which process ``p``'s signature differs from process 0's."""
    lines = []
    for path in [*ref, *(k for k in mine if k not in ref)]:
        if path not in mine:
            lines.append(f"{path} missing")
        elif path not in ref:
            lines.append(f"{path} only on process {p}")
        elif mine[path] != ref[path]:
            lines.append(f"{path} is {mine[path]} (process 0: {ref[path]})")
    if not lines:
        return "the same leaves in another order"
    more = f" (and {len(lines) - _LISTED} more leaves)" if len(lines) > _LISTED else ""
    return ", ".join(lines[:_LISTED]) + more


def _excerpt(text: str, i: int) -> str:
    start, end = max(0, i - 60), max(0, i - 60) + 160
    return ("..." if start else "") + repr(text[start:end]) + ("..." if end < len(text) else "")
