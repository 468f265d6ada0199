"""What a train state holds on each device, by part: :class:`StateMemory`, which ``TrainState.memory()`` returns
and ``sc.explain`` of a step shows."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax

__all__ = ["StateMemory", "optimizer_state_bytes", "device_bytes"]


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """Bytes of a :class:`TrainState` on one device (the one holding the most of each part).

    Attributes:
      params: the stored parameters' blocks.
      opt_state: the optimizer state's blocks.
      model_state: the model state (replicated).
      padding: the bytes of ``params`` and ``opt_state`` that are padding: leaves that no dimension divides are
        stored padded to a multiple of the shard axis size.
      whole: parameter bytes the shard axis leaves whole on every device (leaves of fewer elements than it
        has devices; every parameter under DDP and ZeRO).
    """

    params: int
    opt_state: int
    model_state: int
    padding: int
    whole: int


def device_bytes(tree: Any) -> int:
    """The bytes of ``tree``'s blocks on the addressable device that holds the most (0 for an empty tree)."""
    per_device: dict[Any, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values(), default=0)


def optimizer_state_bytes(state: Any) -> int:
    """Bytes of ``state.opt_state`` held on one device (the largest, when devices differ).

    Only this process's devices are counted.

    Args:
      state: the train state.

    Returns:
      The bytes of the optimizer state's shards on the device that holds the most (0 for an empty state).

    Examples:
      >>> import optax
      >>> s = sc.TrainState.create(params={"w": np.zeros(1000, np.float32)}, tx=optax.adam(1e-3))
      >>> sc.optimizer_state_bytes(s)  # two float32 moments of 1000 entries, and an int32 count
      8004
    """
    return device_bytes(state.opt_state)
