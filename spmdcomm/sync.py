"""Barriers and host-level collectives across processes, none of which can hang silently.

Everything here goes through JAX's coordination service (the key-value store and bounded barriers
of the process that :func:`spmdcomm.initialize` joined), not through device collectives, and every
wait has a timeout. On timeout the error names the processes that did not arrive and, for every
process, the last sync point it reached: its name, sequence number and call site.

Each process numbers its sync points (barriers, syncs and host collectives) 1, 2, 3...; the k-th
sync point of every process meets the k-th of the others. When they differ (process 0 is in
``barrier("a")`` while process 1 is in ``barrier("b")`` or in ``host_all_reduce``), every process
raises :class:`~spmdcomm.errors.ProcessMismatchError` instead of pairing up the wrong calls.

With one process nothing is exchanged: barriers only wait for this process's device work, and the
collectives return at once.

>>> import spmdcomm as sc
>>> sc.barrier("setup")
>>> sc.host_all_reduce({"loss": np.float32(0.5), "n": np.int64(3)}, "sum")
{'loss': array(0.5, dtype=float32), 'n': array(3)}
>>> sc.all_gather_object({"host": "a"})
[{'host': 'a'}]
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from spmdcomm.errors import (
    BarrierTimeoutError,
    ProcessMismatchError,
    RemoteProcessError,
    SpmdError,
    TracedCallError,
    describe,
)
from spmdcomm.mesh import process_count, process_index
from spmdcomm.runtime import coordination_client, is_main_process

__all__ = [
    "barrier",
    "sync_devices",
    "main_process_first",
    "host_all_reduce",
    "host_all_gather",
    "host_broadcast",
    "broadcast_object",
    "all_gather_object",
    "HOST_REDUCE_OPS",
    "DEFAULT_TIMEOUT",
]

# Seconds every wait in this module allows by default.
DEFAULT_TIMEOUT = 300.0

HOST_REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")

_PREFIX = "spmdcomm/sync/"
_counters = {"sync": 0, "first": 0}


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
        _sync_point("barrier", f"barrier {name!r}" if name else "barrier", timeout)


def sync_devices(*, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Returns when every device of every process has finished the work queued on it so far.

    Each process waits for its own devices, then all processes meet at a bounded barrier (it never
    runs a device collective, which could hang without a timeout).

    >>> sc.sync_devices()
    """
    refuse_in_trace("sync_devices")
    _wait_local_devices()
    if process_count() > 1:
        _sync_point("sync_devices", "sync_devices", timeout)


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
    _counters["first"] += 1
    group = socket.gethostname() if local else "all"
    key = f"spmdcomm/first/{_counters['first']}/{group}"
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
                f"finish the block (main_process_first #{_counters['first']}, entered at "
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


def host_all_reduce(tree: Any, op: str = "sum", *, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Reduces a pytree of host values (NumPy arrays, numbers) element-wise across processes.

    ``op`` is one of :data:`HOST_REDUCE_OPS`. Every process receives the same NumPy result, reduced
    in process order. Leaves keep their dtype, except that ``"mean"`` of integers gives floats.
    Every process must pass the same tree structure, shapes and dtypes (checked; a mismatch raises
    :class:`~spmdcomm.errors.ProcessMismatchError` naming the process and leaf).

    >>> sc.host_all_reduce([np.arange(3), 2.0], "max")
    [array([0, 1, 2]), array(2.)]
    """
    refuse_in_trace("host_all_reduce", tree)
    if op not in HOST_REDUCE_OPS:
        raise SpmdError(describe("host_all_reduce", f"unknown op {op!r}.", fix=f"use one of {HOST_REDUCE_OPS}."))
    reduce = _HOST_REDUCERS[op]
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


def host_broadcast(tree: Any, root: int = 0, *, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process receives process ``root``'s pytree of host values, as NumPy arrays.

    The other processes' trees are ignored (any structure will do, e.g. ``None``).

    >>> sc.host_broadcast({"lr": 0.1})
    {'lr': array(0.1)}
    """
    refuse_in_trace("host_broadcast", tree)
    return broadcast_object(_to_host("host_broadcast", tree), root, timeout=timeout)


def broadcast_object(obj: Any, root: int = 0, *, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process receives a copy of process ``root``'s picklable object (e.g. a config).

    Objects travel through the coordination service, meant for small values (up to a few MB).
    With one process the object itself is returned.

    >>> sc.broadcast_object({"seed": 42})
    {'seed': 42}
    """
    refuse_in_trace("broadcast_object", obj)
    n = process_count()
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < n:
        raise SpmdError(
            describe(
                "broadcast_object",
                f"root={root!r} is out of range for a job of {n} process(es).",
                fix=f"pass a process index in [0, {n}).",
            )
        )
    if n == 1:
        return obj
    payload = pickle.dumps(obj) if process_index() == root else b""
    data = _sync_point("broadcast_object", f"broadcast from process {root}", timeout, payload)
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
    data = _sync_point("all_gather_object", "all_gather_object", timeout, pickle.dumps(obj))
    return [pickle.loads(b) for b in data]


def exchange(fn: str, label: str, payload: bytes, *, timeout: float = DEFAULT_TIMEOUT) -> list[bytes]:
    """A sync point named ``label`` that gathers every process's ``payload``, in process order.

    The building block of this module, also used by :mod:`spmdcomm.debug`. Multi-process jobs only.
    """
    return _sync_point(fn, label, timeout, payload)


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


def _sync_point(fn: str, label: str, timeout: float, payload: bytes | None = None) -> list[bytes]:
    client = coordination_client(fn)
    _counters["sync"] += 1
    seq, me, n = _counters["sync"], process_index(), process_count()
    record = {"label": label, "seq": seq, "site": _call_site()}
    text = json.dumps(record)
    client.key_value_set(f"{_PREFIX}{seq}/rec/{me}", text)
    client.key_value_set(f"{_PREFIX}last/{me}", text, allow_overwrite=True)
    if payload is not None:
        client.key_value_set_bytes(f"{_PREFIX}{seq}/data/{me}", payload)
    try:
        client.wait_at_barrier(f"{_PREFIX}{seq}", _ms(timeout))
    except jax.errors.JaxRuntimeError as e:
        raise _timeout_error(fn, client, record, n, timeout, e) from None
    records = {_pid(k): json.loads(v) for k, v in client.key_value_dir_get(f"{_PREFIX}{seq}/rec/")}
    _check_labels(fn, record, records)
    # Every process has passed this barrier, so all are done with the previous sync point's keys.
    if seq > 1:
        for kind in ("rec", "data"):
            _try(lambda kind=kind: client.key_value_delete(f"{_PREFIX}{seq - 1}/{kind}/{me}"), None)
    if payload is None:
        return []
    data = dict((_pid(k), v) for k, v in client.key_value_dir_get_bytes(f"{_PREFIX}{seq}/data/"))
    return [data[p] for p in range(n)]


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


def _timeout_error(
    fn: str, client: Any, mine: dict[str, Any], n: int, timeout: float, cause: Exception
) -> BarrierTimeoutError:
    seq = mine["seq"]
    records = _try(lambda: client.key_value_dir_get(f"{_PREFIX}{seq}/rec/"), [])
    arrived = {_pid(k) for k, _ in records}
    missing = [p for p in range(n) if p not in arrived]
    last = []
    for p in range(n):
        text = _try(lambda p=p: client.key_value_try_get(f"{_PREFIX}last/{p}"), None)
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


def _try(get: Callable[[], Any], default: Any) -> Any:
    try:
        return get()
    except jax.errors.JaxRuntimeError:
        return default


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
        [host] if process_count() == 1 else [pickle.loads(b) for b in _sync_point(fn, fn, timeout, pickle.dumps(host))]
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
