"""Checks that replicated values really are identical on every device and in every process.

A data-parallel run silently goes wrong when replicas drift apart (a non-deterministic op, a process
that skipped a step, a bad restore). These checks compare a 64-bit checksum of each replicated
leaf's bit pattern on every device (one program over the devices, reading each copy where it lies, no copy of
the data to the host) and name the first leaf that differs, with the device and process holding the differing copy.
Across processes the checksums meet at a timed sync point (:mod:`spmdcomm.runtime.transport`), so a process that
never calls the check is named instead of leaving the others waiting.

>>> import optax
>>> state = sc.TrainState.create(params={"w": np.ones(4, np.float32)}, tx=optax.sgd(0.1))
>>> sc.check_replicas_in_sync(state)
[]
>>> sc.assert_replicated(state)
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._cache import Cache
from spmdcomm.errors import ReplicaDivergenceError, describe
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import DEFAULT_TIMEOUT, check_same_across_processes, refuse_in_trace

__all__ = ["Divergence", "check_replicas_in_sync", "assert_replicated"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One replicated leaf whose copy on ``device`` (in ``process``) differs from the first device's copy.

    Attributes:
      leaf: the leaf's path in the tree, as ``jax.tree_util.keystr`` writes it (``"<root>"`` for a bare leaf).
      device: the id of the device holding the differing copy.
      process: the index of the process that owns that device.
    """

    leaf: str
    device: int
    process: int


def check_replicas_in_sync(tree: Any, *, timeout: float = DEFAULT_TIMEOUT) -> list[Divergence]:
    """Returns every (leaf, device) whose copy differs from the first device's; ``[]`` if none.

    Compared are the fully replicated ``jax.Array`` leaves on the same devices as the first one
    (sharded leaves such as batches or ZeRO-1 optimizer state have no copies to compare). With
    several processes every process must call this with the same tree; the result is the same
    everywhere. The processes swap their checksums at a sync point (like a barrier): a process
    that does not arrive within ``timeout`` seconds is named in a
    :class:`~spmdcomm.errors.BarrierTimeoutError`, and processes whose replicated leaves differ
    in name raise :class:`~spmdcomm.errors.ProcessMismatchError` naming them.

    Args:
      tree: a pytree whose fully replicated ``jax.Array`` leaves are compared (other leaves are skipped).
      timeout: seconds to wait for the other processes at the sync point.

    Returns:
      A list of :class:`Divergence`, by leaf in tree order, then by device id; ``[]`` when every copy agrees.

    Raises:
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.
      ProcessMismatchError: when the processes' replicated leaves differ in name.
    """
    refuse_in_trace(_FN, tree)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [
        (jax.tree_util.keystr(path) or "<root>", x)
        for path, x in flat
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and x.size
    ]
    # jax.Device: jaxlib ships no type stubs, so mypy knows a Device's attributes only through this name (Any)
    devices: set[jax.Device] = leaves[0][1].sharding.device_set if leaves else set()
    leaves = [(name, x) for name, x in leaves if x.sharding.device_set == devices]
    names = [name for name, _ in leaves]
    local = sorted((d for d in devices if d.process_index == process_index()), key=lambda d: d.id)
    ids = np.array([[d.id, d.process_index] for d in local], dtype=np.int64).reshape(-1, 2)
    table = _local_checksums([x for _, x in leaves], local)
    if process_count() > 1:
        # Every process joins the exchange, even one with nothing to compare, so that none is left waiting.
        got = check_same_across_processes(
            _FN,
            "replicated leaves",
            dict.fromkeys(names, "replicated"),
            fix="call it with the same tree on every process, placed on the same devices.",
            timeout=timeout,
            payload=pickle.dumps((ids, table)),
            label=_FN,
        )
        rows = [pickle.loads(b) for b in got]
        ids, table = np.concatenate([i for i, _ in rows]), np.concatenate([t for _, t in rows])
    if not names:
        return []
    order = np.argsort(ids[:, 0])
    table, ids = table[order], ids[order]
    out = []
    for j, name in enumerate(names):
        for row in np.nonzero(np.any(table[:, j] != table[0, j], axis=-1))[0]:
            out.append(Divergence(name, int(ids[row, 0]), int(ids[row, 1])))
    return out


def assert_replicated(tree: Any, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Raises :class:`~spmdcomm.errors.ReplicaDivergenceError` naming the first leaf whose replicas differ.

    Cheap enough to call every few hundred steps (one checksum per leaf per device, and with several
    processes one sync point bounded by ``timeout`` seconds). Compares what :func:`check_replicas_in_sync`
    compares.

    Args:
      tree: a pytree whose fully replicated ``jax.Array`` leaves are compared (other leaves are skipped).
      timeout: seconds to wait for the other processes at the sync point.

    Raises:
      ReplicaDivergenceError: when a copy differs; the message names the first leaf, its device and process,
        the number of differing (leaf, device) pairs and up to 5 other differing leaves.
      BarrierTimeoutError: when a process does not arrive within ``timeout`` seconds.
      ProcessMismatchError: when the processes' replicated leaves differ in name.
    """
    diverged = check_replicas_in_sync(tree, timeout=timeout)
    if diverged:
        first = diverged[0]
        others = sorted({d.leaf for d in diverged} - {first.leaf})
        raise ReplicaDivergenceError(
            describe(
                "assert_replicated",
                f"the copy on device {first.device} (process {first.process}) differs from "
                f"the first device's copy; {len(diverged)} (leaf, device) pairs differ in all"
                + (f", also leaves {others[:5]}" if others else "")
                + ".",
                leaf=first.leaf,
                fix="look for non-deterministic or process-dependent code in the step, and "
                "re-broadcast the "
                "state from process 0 (TrainState.create broadcasts at start-up).",
            )
        )


_FN = "check_replicas_in_sync"


def _local_checksums(leaves: list[jax.Array], devices: list[jax.Device]) -> np.ndarray:
    """``(devices, leaves, 2)`` uint32: each device's checksums of its own copy of each leaf.

    One program over ``devices`` reads every copy where it lies: its inputs are the leaves' own per-device buffers
    gathered into arrays on one mesh (nothing is copied or compared on the way), so it compiles once per tree of
    shapes and set of devices, where a program per device would compile once per device.
    """
    if not leaves or not devices:
        return np.zeros((len(devices), len(leaves), 2), np.uint32)
    mesh = Mesh(np.array(devices), ("copy",))
    replicated = NamedSharding(mesh, P())
    copies = [
        jax.make_array_from_single_device_arrays(
            x.shape, replicated, [next(s.data for s in x.addressable_shards if s.device == d) for d in devices]
        )
        for x in leaves
    ]
    per_device = _PER_DEVICE.get_or_make(
        tuple(d.id for d in devices),
        lambda: jax.jit(
            jax.shard_map(
                lambda *xs: _checksums(list(xs))[None],
                mesh=mesh,
                in_specs=P(),
                out_specs=P("copy"),
                check_vma=False,
            )
        ),
    )
    return np.asarray(per_device(*copies), dtype=np.uint32)


def _checksums(leaves: list[jax.Array]) -> jax.Array:
    """Two uint32 sums per leaf over its bit pattern (plain and position-weighted), stacked (leaves, 2)."""
    rows = []
    for x in leaves:
        bits = _as_uint32(x).reshape(-1)
        weights = lax.iota(jnp.uint32, bits.shape[0]) * jnp.uint32(2654435761) + jnp.uint32(1)
        rows.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)]))
    return jnp.stack(rows)


def _as_uint32(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.concatenate([_as_uint32(jnp.real(x)).ravel(), _as_uint32(jnp.imag(x)).ravel()])
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return _as_uint32(jax.random.key_data(x))
    size = x.dtype.itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    bits = lax.bitcast_convert_type(x, unsigned)  # 8-byte types gain a trailing dimension of 2
    return bits.astype(jnp.uint32)


_PER_DEVICE = Cache(limit=16)  # this process's device ids -> the jitted checksum program over them
