"""Barriers, host-level collectives and cross-process agreement, none of which can hang silently.

Every way spmdcomm checks that processes agree goes through one timed transport: numbered sync points
in JAX's coordination service (the key-value store and bounded barriers of the job that
:func:`spmdcomm.initialize` joined). Every wait has a timeout. On timeout the error names the processes
that did not arrive and, for every process, the last sync point it reached: its name, sequence number
and call site.

Each process numbers its sync points (barriers, syncs, host collectives, debug and replica checks) 1, 2,
3...; the k-th sync point of every process meets the k-th of the others. When they differ (process 0 is
in ``barrier("a")`` while process 1 is in ``barrier("b")`` or in ``host_all_reduce``), every process
raises :class:`~spmdcomm.errors.ProcessMismatchError` instead of pairing up the wrong calls.

With one process nothing is exchanged: barriers only wait for this process's device work, and the
collectives return at once.

>>> import spmdcomm as sc
>>> sc.barrier("setup")
>>> sc.host_all_reduce({"loss": np.float32(0.5), "n": np.int64(3)}, op="sum")
{'loss': array(0.5, dtype=float32), 'n': array(3)}
>>> sc.all_gather_object({"host": "a"})
[{'host': 'a'}]
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._ops import check_op, check_root
from spmdcomm.errors import (
    BarrierTimeoutError,
    ProcessMismatchError,
    RemoteProcessError,
    SpmdError,
    TracedCallError,
    describe,
)
from spmdcomm.runtime.process import coordination_client, is_main_process, process_count, process_index

__all__ = [
    "barrier",
    "sync_devices",
    "main_process_first",
    "host_all_reduce",
    "host_all_gather",
    "host_broadcast",
    "broadcast_object",
    "all_gather_object",
    "DEFAULT_TIMEOUT",
]

# Seconds every wait in this module allows by default.
DEFAULT_TIMEOUT = 300.0


def barrier(name: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Waits until every process has reached this barrier (and this process's device work is done).

    ``name`` labels the barrier: processes whose k-th sync points have different names raise
    :class:`~spmdcomm.errors.ProcessMismatchError`. After ``timeout`` seconds every waiting process
    raises :class:`~spmdcomm.errors.BarrierTimeoutError` naming the missing processes and where each
    process last synchronised. With one process it only waits for local device work.

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
        done = json.loads(client.blocking_key_value_get(key, _ms(timeout)))
    except jax.errors.JaxRuntimeError:
        raise BarrierTimeoutError(
            describe(
                "main_process_first",
                f"process {process_index()} waited {timeout:g} s for {who} to "
                f"finish the block (main_process_first #{number}, entered at "
                f"{_call_site()}), but it did not.",
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


def host_all_reduce(tree: Any, *, op: str = "sum", timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Reduces a pytree of host values (NumPy arrays, numbers) element-wise across processes.

    ``op`` is one of :data:`spmdcomm.REDUCE_OPS`. Every process receives the same NumPy result,
    reduced in process order. Leaves keep their dtype, except that ``"mean"`` of integers gives
    floats. Every process must pass the same tree structure, shapes and dtypes (checked; a mismatch
    raises :class:`~spmdcomm.errors.ProcessMismatchError` naming the process and leaf).

    >>> sc.host_all_reduce([np.arange(3), 2.0], op="max")
    [array([0, 1, 2]), array(2.)]
    """
    refuse_in_trace("host_all_reduce", tree)
    reduce = _HOST_REDUCERS[check_op("host_all_reduce", op)]
    stacked = _gather_tree("host_all_reduce", tree, timeout)
    return jax.tree.map(lambda x: np.asarray(reduce(x)), stacked)


def host_all_gather(tree: Any, *, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Stacks every process's pytree of host values: each leaf gains a leading axis of size N.

    Row ``p`` holds process ``p``'s value. Shapes, dtypes and structure must agree (checked).

    >>> sc.host_all_gather({"step": 7})
    {'step': array([7])}
    """
    refuse_in_trace("host_all_gather", tree)
    return _gather_tree("host_all_gather", tree, timeout)


def host_broadcast(tree: Any, *, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process receives process ``root``'s pytree of host values, as NumPy arrays.

    The other processes' trees are ignored (any structure will do, e.g. ``None``). The values travel
    through the coordination service, like :func:`broadcast_object`: meant for small trees.

    >>> sc.host_broadcast({"lr": 0.1})
    {'lr': array(0.1)}
    """
    refuse_in_trace("host_broadcast", tree)
    root = check_root("host_broadcast", root, process_count(), what="process")
    return broadcast_object(_to_host("host_broadcast", tree), root=root, timeout=timeout)


def broadcast_object(obj: Any, *, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process receives a copy of process ``root``'s picklable object (e.g. a config).

    Objects travel through the coordination service, meant for small values (up to a few MB).
    With one process the object itself is returned.

    >>> sc.broadcast_object({"seed": 42})
    {'seed': 42}
    """
    refuse_in_trace("broadcast_object", obj)
    root = check_root("broadcast_object", root, process_count(), what="process")
    if process_count() == 1:
        return obj
    payload = pickle.dumps(obj) if process_index() == root else b""
    data = exchange("broadcast_object", f"broadcast from process {root}", payload, timeout=timeout)
    return pickle.loads(data[root])


def all_gather_object(obj: Any, *, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """A list of every process's picklable object, indexed by process.

    Objects travel through the coordination service, meant for small values (up to a few MB).
    With one process it returns ``[obj]``.

    >>> sc.all_gather_object("ok")
    ['ok']
    """
    refuse_in_trace("all_gather_object", obj)
    if process_count() == 1:
        return [obj]
    data = exchange("all_gather_object", "all_gather_object", pickle.dumps(obj), timeout=timeout)
    return [pickle.loads(b) for b in data]


# ---- the transport, for spmdcomm's own modules ------------------------------------------------------------


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
        seq, me, n = self.seq, process_index(), process_count()
        record = {"label": label, "seq": seq, "site": _call_site()}
        header = json.dumps(record).encode()
        # One key per process and sync point holds the record and the payload, so that a sync point
        # costs one write, the barrier and one directory read.
        client.key_value_set_bytes(f"{self.prefix}{seq}/{me}", header + b"\n" + payload)
        client.key_value_set(f"{self.prefix}last/{me}", header.decode(), allow_overwrite=True)
        try:
            client.wait_at_barrier(f"{self.prefix}{seq}", _ms(timeout))
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
                f"{_where(mine)} on process {process_index()}: {what}. Last sync point of each "
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
    if process_count() == 1:
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


def broadcast_tree(fn: str, tree: Any, *, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process receives process ``root``'s pytree of arrays, bit for bit, as NumPy arrays.

    For trees of any size (model parameters of many MB) of NumPy arrays, numbers or this process's own
    ``jax.Array`` s. Every process must pass a tree of the same structure, shapes and dtypes. The
    processes first agree on that signature at a sync point of the main channel, which is timed: a
    missing process is named after ``timeout`` seconds, and a process whose tree differs raises
    :class:`~spmdcomm.errors.ProcessMismatchError` naming it. Only then do the bytes move, in one device
    all-reduce of one flat int32 buffer over one device per process (root contributes its bytes, the
    others zeros; integer sums with zeros are exact for every dtype, where a float sum would turn -0.0
    into 0.0). The coordination service is not meant for values of many MB, and a device collective has
    no timeout, but after the agreement every process is known to be at this point with the same buffer
    size, so the collective cannot wait for a missing peer (a process that dies in between ends the job
    through the launcher or JAX's heartbeat). With one process the tree itself comes back, not copied.
    """
    refuse_in_trace(fn, tree)
    root = check_root(fn, root, process_count(), what="process")
    if process_count() == 1:
        return tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(_to_host(fn, tree))
    signature = "; ".join(f"{jax.tree_util.keystr(p) or '<root>'}: {x.shape} {x.dtype}" for p, x in flat)
    check_same_across_processes(
        fn,
        f"trees (structure, shapes, dtypes) for a broadcast from process {root}",
        f"{signature}; structure {treedef}",
        fix="pass a tree of the same structure, shapes and dtypes on every process (build it the same way "
        "everywhere; only the values may differ).",
        timeout=timeout,
    )
    leaves = [x for _, x in flat]
    return jax.tree.unflatten(treedef, _broadcast_bytes(leaves, root))


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


# ------------------------------------------------------------------------------------------------


_HOST_REDUCERS: dict[str, Callable[[np.ndarray], Any]] = {
    "sum": lambda x: np.sum(x, axis=0, dtype=x.dtype),
    "mean": lambda x: np.mean(x, axis=0),
    "max": lambda x: np.max(x, axis=0),
    "min": lambda x: np.min(x, axis=0),
    "prod": lambda x: np.prod(x, axis=0, dtype=x.dtype),
}

_MAIN = Channel("main")
_FIRST_BLOCKS = itertools.count(1)
# How much of its description check_same_across_processes sends with the digest, to show a difference.
_SHOWN_BYTES = 64 * 1024
# Processes named, with excerpts, in a mismatch message.
_LISTED = 3


def _staging() -> bool:
    # Only a staging trace (jit, shard_map, scan, checkpoint) turns a fresh constant computation into a tracer;
    # the probe costs about 20 us eagerly, nothing next to a host synchronisation.
    return isinstance(jax.lax.iota(np.int32, 1), jax.core.Tracer)


def _wait_local_devices() -> None:
    jax.block_until_ready(jax.live_arrays())


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _call_site() -> str:
    """``file:line`` of the innermost frame outside spmdcomm and contextlib."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if os.path.dirname(path) != here and not path.endswith("contextlib.py"):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _summary(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return text + where


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
    message = f"process(es) {bad} passed {what} that differ from process 0's (seen on process {process_index()})"
    return describe(fn, f"{message}: {'; '.join(parts)}{more}.", fix=fix)


def _excerpt(text: str, i: int) -> str:
    start, end = max(0, i - 60), max(0, i - 60) + 160
    return ("..." if start else "") + repr(text[start:end]) + ("..." if end < len(text) else "")


def _to_host(fn: str, tree: Any) -> Any:
    def one(path: Any, leaf: Any) -> np.ndarray:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise SpmdError(
                describe(
                    fn,
                    f"is a global jax.Array of shape {leaf.shape} spread over several processes; "
                    "host collectives take this process's own values.",
                    leaf=jax.tree_util.keystr(path),
                    fix="pass a host value, e.g. np.asarray(x.addressable_data(0)), or use the device "
                    "collectives inside spmd.",
                )
            )
        return np.asarray(leaf)

    return jax.tree_util.tree_map_with_path(one, tree)


def _gather_tree(fn: str, tree: Any, timeout: float) -> Any:
    host = _to_host(fn, tree)
    trees = (
        [host]
        if process_count() == 1
        else [pickle.loads(b) for b in exchange(fn, fn, pickle.dumps(host), timeout=timeout)]
    )
    flat = [jax.tree_util.tree_flatten_with_path(t) for t in trees]
    _check_same_leaves(fn, flat)
    leaves = [[leaf for _, leaf in f[0]] for f in flat]
    return jax.tree.unflatten(flat[0][1], [np.stack(col) for col in zip(*leaves, strict=True)])


def _check_same_leaves(fn: str, flat: list[tuple[list[tuple[Any, np.ndarray]], Any]]) -> None:
    (ref, ref_def) = flat[0]
    for p, (leaves, treedef) in enumerate(flat[1:], start=1):
        if treedef != ref_def:
            raise ProcessMismatchError(
                describe(
                    fn,
                    f"process {p} passed a tree of structure {treedef}, process 0 {ref_def}.",
                    fix="pass the same pytree structure on every process.",
                )
            )
        for (path, a), (_, b) in zip(leaves, ref, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ProcessMismatchError(
                    describe(
                        fn,
                        f"process {p} passed shape {a.shape} dtype {a.dtype}, process 0 shape "
                        f"{b.shape} dtype {b.dtype}.",
                        leaf=jax.tree_util.keystr(path),
                        fix="pass the same shapes and dtypes on every process.",
                    )
                )


def _broadcast_bytes(leaves: list[np.ndarray], root: int) -> list[np.ndarray]:
    """``root``'s leaves on every process: their bytes in one int32 buffer, summed over one device per
    process with zeros from every process but ``root``. Every process must pass the same shapes and dtypes."""
    n, me = process_count(), process_index()
    sizes = [x.nbytes for x in leaves]
    words = -(-sum(sizes) // 4)
    if words == 0:
        return [x.copy() for x in leaves]
    row = np.zeros((1, words), np.int32)
    if me == root:
        flat, offset = row.reshape(-1).view(np.uint8), 0
        for x, size in zip(leaves, sizes, strict=True):
            flat[offset : offset + size] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            offset += size
    devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
    mesh = Mesh(np.array(devices), ("processes",))
    rows = jax.make_array_from_single_device_arrays(
        (n, words), NamedSharding(mesh, P("processes")), [jax.device_put(row, devices[me])]
    )
    got = np.asarray(_sum_rows(mesh)(rows).addressable_data(0)).view(np.uint8)
    out, offset = [], 0
    for x, size in zip(leaves, sizes, strict=True):
        out.append(got[offset : offset + size].view(x.dtype).reshape(x.shape).copy())
        offset += size
    return out


@functools.lru_cache(maxsize=8)
def _sum_rows(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    # An integer sum: x + 0 is exact for any bit pattern (a float sum would turn -0.0 into 0.0 and flush
    # denormals).
    return jax.jit(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), out_shardings=NamedSharding(mesh, P()))
