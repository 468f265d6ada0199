"""Host-level collectives across processes: reduce, gather and broadcast pytrees of host values and objects.

They travel through the timed transport of :mod:`spmdcomm.runtime.transport` (no call can hang silently), except
the bytes of :func:`broadcast_tree`, which move in one device all-reduce once the processes have agreed. With one
process nothing is exchanged: the collectives return at once.

>>> import spmdcomm as sc
>>> sc.host_all_reduce({"loss": np.float32(0.5), "n": np.int64(3)}, op="sum")
{'loss': array(0.5, dtype=float32), 'n': array(3)}
>>> sc.all_gather_object({"host": "a"})
[{'host': 'a'}]
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._cache import Cache
from spmdcomm._ops import check_op, check_root
from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import DEFAULT_TIMEOUT, check_same_across_processes, exchange, refuse_in_trace

__all__ = [
    "host_all_reduce",
    "host_all_gather",
    "host_broadcast",
    "broadcast_object",
    "all_gather_object",
    "broadcast_tree",
]


def host_all_reduce(tree: Any, *, op: str = "sum", timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Reduces a pytree of host values (NumPy arrays, numbers) element-wise across processes.

    ``op`` is one of :data:`spmdcomm.collectives.REDUCE_OPS`. Every process receives the same NumPy result,
    reduced in process order. Leaves keep their dtype, except that ``"mean"`` of integers gives
    floats. Every process must pass the same tree structure, shapes and dtypes (checked; a mismatch
    raises :class:`~spmdcomm.errors.ProcessMismatchError` naming the process and leaf).

    Args:
      tree: a pytree of this process's host values (NumPy arrays, numbers, fully addressable ``jax.Array`` s).
      op: the reduction, one of :data:`spmdcomm.collectives.REDUCE_OPS`.
      timeout: seconds to wait for the other processes.

    Returns:
      A tree of the same structure whose leaves are NumPy arrays of the leaves' shapes, the same on every
      process.

    Raises:
      SpmdError: when ``op`` is unknown, or a leaf is a ``jax.Array`` spread over several processes.
      ProcessMismatchError: when the processes' structures, shapes or dtypes differ.
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.

    Examples:
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

    Args:
      tree: a pytree of this process's host values (NumPy arrays, numbers, fully addressable ``jax.Array`` s).
      timeout: seconds to wait for the other processes.

    Returns:
      A tree of the same structure whose leaves are NumPy arrays of shape ``(process_count(), *leaf.shape)``.

    Raises:
      SpmdError: when a leaf is a ``jax.Array`` spread over several processes.
      ProcessMismatchError: when the processes' structures, shapes or dtypes differ.
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.

    Examples:
      >>> sc.host_all_gather({"step": 7})
      {'step': array([7])}
    """
    refuse_in_trace("host_all_gather", tree)
    return _gather_tree("host_all_gather", tree, timeout)


def host_broadcast(tree: Any, *, root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process receives process ``root``'s pytree of host values, as NumPy arrays.

    The other processes' trees are ignored (any structure will do, e.g. ``None``). The values travel
    through the coordination service, like :func:`broadcast_object`: meant for small trees.

    Args:
      tree: on process ``root``, a pytree of host values (NumPy arrays, numbers, fully addressable
        ``jax.Array`` s); ignored elsewhere.
      root: the index of the process whose tree every process receives.
      timeout: seconds to wait for the other processes.

    Returns:
      Process ``root``'s tree with NumPy array leaves, on every process.

    Raises:
      SpmdError: when ``root`` is not a process index, or a leaf is a ``jax.Array`` spread over several
        processes.
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.

    Examples:
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

    Args:
      obj: on process ``root``, a picklable object; ignored elsewhere.
      root: the index of the process whose object every process receives.
      timeout: seconds to wait for the other processes.

    Returns:
      An unpickled copy of process ``root``'s object (``obj`` itself with one process).

    Raises:
      SpmdError: when ``root`` is not a process index.
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.

    Examples:
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

    Args:
      obj: this process's picklable object.
      timeout: seconds to wait for the other processes.

    Returns:
      A list of ``process_count()`` objects: item ``p`` is an unpickled copy of process ``p``'s object.

    Raises:
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.

    Examples:
      >>> sc.all_gather_object("ok")
      ['ok']
    """
    refuse_in_trace("all_gather_object", obj)
    if process_count() == 1:
        return [obj]
    data = exchange("all_gather_object", "all_gather_object", pickle.dumps(obj), timeout=timeout)
    return [pickle.loads(b) for b in data]


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
    check_same_across_processes(
        fn,
        f"trees (structure, shapes, dtypes) for a broadcast from process {root}",
        _signature(flat, treedef),
        fix="pass a tree of the same structure, shapes and dtypes on every process (build it the same way "
        "everywhere; only the values may differ).",
        timeout=timeout,
    )
    leaves = [x for _, x in flat]
    return jax.tree.unflatten(treedef, _broadcast_bytes(leaves, root))


# ------------------------------------------------------------------------------------------------


_SUM_ROWS = Cache(limit=8)  # the compiled byte sum of broadcast_tree, per mesh of one device per process
_HOST_REDUCERS: dict[str, Callable[[np.ndarray], Any]] = {
    "sum": lambda x: np.sum(x, axis=0, dtype=x.dtype),
    "mean": lambda x: np.mean(x, axis=0),
    "max": lambda x: np.max(x, axis=0),
    "min": lambda x: np.min(x, axis=0),
    "prod": lambda x: np.prod(x, axis=0, dtype=x.dtype),
}


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
    flat, treedef = jax.tree_util.tree_flatten_with_path(_to_host(fn, tree))
    leaves = [x for _, x in flat]
    rows = [leaves]
    if process_count() > 1:
        got = check_same_across_processes(
            fn,
            "trees (structure, shapes, dtypes)",
            _signature(flat, treedef),
            fix="pass the same pytree structure, shapes and dtypes on every process.",
            timeout=timeout,
            payload=pickle.dumps(leaves),
            label=fn,
        )
        rows = [pickle.loads(b) for b in got]
    return jax.tree.unflatten(treedef, [np.stack(col) for col in zip(*rows, strict=True)])


def _signature(flat: list[tuple[Any, np.ndarray]], treedef: Any) -> dict[str, str]:
    """What must agree across processes for a tree of host arrays: each leaf's shape and dtype, and the structure."""
    leaves = {jax.tree_util.keystr(p) or "<root>": f"shape {x.shape} dtype {x.dtype}" for p, x in flat}
    return leaves | {"structure": str(treedef)}


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


def _sum_rows(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    # An integer sum: x + 0 is exact for any bit pattern (a float sum would turn -0.0 into 0.0 and flush
    # denormals).
    return _SUM_ROWS.get_or_make(
        mesh, lambda: jax.jit(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), out_shardings=NamedSharding(mesh, P()))
    )
