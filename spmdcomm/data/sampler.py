"""Sharded sampling: which example indices each shard (usually each process) takes in each epoch.

:class:`ShardedSampler` splits a data set across shards so that every example is used exactly once per epoch, in
global batches that are the same for every split of one global batch size; :func:`spmdcomm.take_batches` gathers
the rows of its index batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from spmdcomm.data.batches import MaskedBatch
from spmdcomm.errors import SpmdError, describe

__all__ = ["ShardedSampler"]


class ShardedSampler:
    """Splits example indices ``0 .. num_examples - 1`` into per-shard batches, each used once per epoch.

    Shard ``shard_index`` of ``num_shards`` (usually one shard per process) calls :meth:`batches`. Each
    epoch is a list of global batches of ``batch_size x num_shards`` indices, defined by ``num_examples``,
    that global size, ``seed``, the epoch and ``drop_remainder`` alone; shard ``i`` takes the contiguous
    slice ``[i * batch_size, (i + 1) * batch_size)`` of each. So the shards' batches side by side, in shard
    order, are the same global batch (indices, padding and its positions) for every split of one global
    batch size: 2 processes of 4 rows train on what 1 process of 8 or 4 of 2 train on. With
    ``drop_remainder=False`` every example appears exactly once per epoch, and the last global batch holds
    its real examples first and its padding at the end (index 0, ``mask`` False; never repeated examples,
    unlike torch's ``DistributedSampler``), so a shard's last batch may be partly or wholly padding. With
    ``drop_remainder=True`` only full global batches are used: the few examples left over (different ones
    each shuffled epoch) are skipped.

    ``shuffle`` draws a new order every epoch from ``(seed, epoch)`` alone; every shard draws the same
    one, so the shards must share ``seed``. The epoch is an argument, or, left out, the sampler's
    position (:meth:`state_dict`), which each :meth:`batches` call moves to the next epoch, so a
    forgotten ``set_epoch`` cannot repeat an epoch's order. Since an epoch's order depends only on
    ``(seed, epoch)``, a sampler restored to a position mid-epoch (:meth:`load_state_dict`) yields exactly
    that epoch's remaining batches, also with another number of shards of the same global batch size.

    Args:
      num_examples: the number of examples in the data set, an int >= 0.
      shard_index: this shard's index in ``[0, num_shards)``, usually :func:`spmdcomm.process_index`.
      num_shards: the number of shards, an int >= 1, usually :func:`spmdcomm.process_count`.
      shuffle: whether each epoch draws a new order from ``(seed, epoch)`` (default True); False keeps
        ``0 .. num_examples - 1``.
      seed: the shuffle seed (default 0), the same on every shard.
      drop_remainder: whether to skip the examples that do not fill a last global batch (default False:
        pad it).

    Raises:
      SpmdError: when ``num_examples`` or ``num_shards`` is not an int in range, or ``shard_index`` is not in
        ``[0, num_shards)``.

    Examples:
      >>> s = sc.ShardedSampler(10, shard_index=1, num_shards=2, shuffle=False)
      >>> [(b.data.tolist(), b.mask.tolist()) for b in s.batches(3)]  # global batches 0..5 and 6..9 + 2 padding
      [([3, 4, 5], [True, True, True]), ([9, 0, 0], [True, False, False])]
    """

    def __init__(
        self,
        num_examples: int,
        *,
        shard_index: int,
        num_shards: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
    ):
        for name, value, low in (("num_examples", num_examples, 0), ("num_shards", num_shards, 1)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise SpmdError(describe("ShardedSampler", f"{name}={value!r} must be an int >= {low}."))
        if not isinstance(shard_index, (int, np.integer)) or not 0 <= shard_index < num_shards:
            raise SpmdError(
                describe(
                    "ShardedSampler",
                    f"shard_index={shard_index!r} is not in [0, num_shards={num_shards}).",
                    fix="pass e.g. shard_index=sc.process_index(), num_shards=sc.process_count().",
                )
            )
        self.num_examples = int(num_examples)
        self.shard_index = int(shard_index)
        self.num_shards = int(num_shards)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.epoch = 0  # the position: the epoch and the index of the next batch not yet consumed
        self.batch = 0

    def state_dict(self) -> dict[str, int]:
        """The position as ``{"epoch": e, "batch": b}``: batch ``b`` of epoch ``e`` is the next one not yet consumed.

        :meth:`batches` without ``epoch`` starts there. A :class:`spmdcomm.Loader` moves the position as
        the training loop takes each batch (not as prefetch fetches it), so a position saved with a
        checkpoint names exactly the batches the saved state has not trained on.

        Returns:
          A new dict ``{"epoch": e, "batch": b}`` of ints, for :meth:`load_state_dict`.

        Examples:
          >>> s = sc.ShardedSampler(8, shard_index=0, num_shards=1, shuffle=False)
          >>> s.load_state_dict({"epoch": 2, "batch": 1})
          >>> [b.data.tolist() for b in s.batches(3)], s.state_dict()
          ([[3, 4, 5], [6, 7, 0]], {'epoch': 3, 'batch': 0})
        """
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: Any) -> None:
        """Moves the position to ``state`` (as :meth:`state_dict` returns it).

        Args:
          state: a dict with exactly the keys ``"epoch"`` and ``"batch"``, each an int >= 0.

        Raises:
          SpmdError: when ``state`` is not such a dict.
        """
        keys = {"epoch", "batch"}
        if not isinstance(state, dict) or set(state) != keys:
            raise SpmdError(
                describe(
                    "ShardedSampler.load_state_dict",
                    f"state={state!r} is not a position.",
                    fix='pass what state_dict() returned: {"epoch": int, "batch": int}.',
                )
            )
        self.epoch = _non_negative("ShardedSampler.load_state_dict", "state['epoch']", state["epoch"])
        self.batch = _non_negative("ShardedSampler.load_state_dict", "state['batch']", state["batch"])

    def num_batches(self, batch_size: int) -> int:
        """The number of batches every shard gets per epoch for a per-shard ``batch_size``.

        Args:
          batch_size: the rows per shard and batch, a positive int.

        Returns:
          ``num_examples / (batch_size x num_shards)`` rounded up, or down with ``drop_remainder``.

        Raises:
          SpmdError: when ``batch_size`` is not a positive int.
        """
        step = self.num_shards * _positive("ShardedSampler.num_batches", "batch_size", batch_size)
        if self.drop_remainder:
            return self.num_examples // step
        return -(-self.num_examples // step)

    def order(self, epoch: int) -> np.ndarray:
        """All ``num_examples`` indices in the order of ``epoch`` (identical on every shard).

        Args:
          epoch: the epoch whose order to draw (with ``shuffle=False`` the order is the same for every epoch).

        Returns:
          An int array of length ``num_examples``: a permutation drawn from ``(seed, epoch)``, or
          ``arange(num_examples)`` without shuffle.
        """
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def batches(self, batch_size: int, *, epoch: int | None = None, start: int | None = None) -> Iterator[MaskedBatch]:
        """This shard's index batches for one epoch, from batch ``start`` on (the earlier ones skipped).

        ``epoch=None`` starts at the position (:meth:`state_dict`; ``start`` defaults to its batch) and
        moves it to the start of the next epoch (at this call, not lazily). An explicit ``epoch`` leaves the
        position alone; ``start`` then defaults to 0. Padded positions hold index 0 and ``mask`` False, so
        gathering them never fails.

        Args:
          batch_size: the rows per batch of this shard, a positive int.
          epoch: the epoch to give; ``None`` (default) the position's, which moves on to the next epoch.
          start: the index of the first batch to give, an int >= 0; ``None`` (default) the position's batch
            when ``epoch`` is ``None``, else 0.

        Returns:
          An iterator over ``MaskedBatch(indices, mask)`` es of ``batch_size`` int indices and a bool mask each.

        Raises:
          SpmdError: when ``batch_size`` is not a positive int or ``start`` is negative.
        """
        batch_size = _positive("ShardedSampler.batches", "batch_size", batch_size)
        if start is not None:
            start = _non_negative("ShardedSampler.batches", "start", start)
        if epoch is None:
            epoch, start = self.epoch, (self.batch if start is None else start)
            self.epoch, self.batch = epoch + 1, 0
        indices, mask = self._global_batches(batch_size, epoch)
        mine = np.s_[:, self.shard_index * batch_size : (self.shard_index + 1) * batch_size]
        return iter([MaskedBatch(i, m) for i, m in zip(indices[mine], mask[mine], strict=True)][start or 0 :])

    def _global_batches(self, batch_size: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, mask)`` of shape ``(num_batches, batch_size x num_shards)``: the epoch's global batches,
        the same for every shard and every split of the global batch size; padding (index 0) at the end."""
        n = self.num_batches(batch_size)
        size = batch_size * self.num_shards
        used = min(self.num_examples, n * size)  # drop_remainder leaves out the rest; otherwise only padding remains
        order = self.order(epoch)
        indices = np.zeros(n * size, order.dtype)
        indices[:used] = order[:used]
        return indices.reshape(n, size), (np.arange(n * size) < used).reshape(n, size)


# ---------------------------------------------------------------------------------------------------------


def _positive(fn: str, name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise SpmdError(describe(fn, f"{name}={value!r} must be a positive int."))
    return int(value)


def _non_negative(fn: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise SpmdError(describe(fn, f"{name}={value!r} must be an int >= 0."))
    return int(value)
