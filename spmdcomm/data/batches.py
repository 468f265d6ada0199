"""Host batches: padding uneven batches with a mask, sampling and joining.

torch.nn.DataParallel splits 15 examples over 2 devices as 8 + 7; SPMD programs need equal blocks, so
spmdcomm pads to 16 and carries a boolean mask that marks the real examples. Everything downstream (the DDP
step, eval metrics) weighs examples by the mask, so results equal the unpadded computation exactly.

>>> import numpy as np, spmdcomm as sc
>>> padded = sc.pad_batch({"x": np.arange(5.0)}, 4)
>>> padded.data["x"].tolist(), padded.mask.tolist()
([0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0], [True, True, True, True, True, False, False, False])
>>> sc.unpad(padded)["x"].tolist()
[0.0, 1.0, 2.0, 3.0, 4.0]

:class:`ShardedSampler` splits a data set across processes so that every example is used exactly once per
epoch, and :func:`join_batches` keeps processes whose iterators run out early stepping with fully masked
batches until every process is done. :func:`spmdcomm.shard_batch` (in :mod:`spmdcomm.data.placement`) puts a
batch on the mesh.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.runtime.process import process_count, process_index
from spmdcomm.runtime.transport import DEFAULT_TIMEOUT, Channel

__all__ = [
    "MaskedBatch",
    "pad_batch",
    "unpad",
    "ShardedSampler",
    "take_batches",
    "join_batches",
]


class MaskedBatch(NamedTuple):
    """A batch whose leaves share a leading example dimension, and a bool ``mask`` of real examples.

    Attributes:
      data: the batch, a pytree of arrays with a common size of dimension 0.
      mask: a bool vector with one entry per row of ``data``; True marks a real example, False padding.
    """

    data: Any
    mask: Any


def pad_batch(batch: Any, multiple_of: int | None = None, *, multiple: int | None = None) -> MaskedBatch:
    """Pads dimension 0 of every leaf with zeros up to a multiple of ``multiple_of``; ``mask`` marks real rows.

    A :class:`MaskedBatch` passed in is padded further, keeping its mask. Leaves must be arrays with a
    common leading size. ``multiple_of`` is the keyword every spmdcomm function that pads takes
    (``pad_batch(batch, 8)`` works too); ``multiple=`` is its old spelling, accepted with a
    ``DeprecationWarning`` until the next release.

    Args:
      batch: a pytree of arrays with a common leading size, or a :class:`MaskedBatch`.
      multiple_of: the positive int the padded leading size is a multiple of (usually the number of devices
        along the data axis).
      multiple: the deprecated spelling of ``multiple_of``; pass only one of the two.

    Returns:
      A :class:`MaskedBatch`: the leaves padded with zero rows (unchanged when the size already divides) and a
      bool mask, True for the real rows (the given mask for a :class:`MaskedBatch`, else all of them).

    Raises:
      SpmdError: when ``multiple_of`` is missing or not a positive int, both spellings are given, or a leaf
        is not an array.
      ShapeError: when a leaf is a scalar or the leaves' leading sizes differ.

    Examples:
      >>> b = sc.pad_batch({"x": np.arange(3.0)}, 4)
      >>> b.data["x"].tolist(), b.mask.tolist()
      ([0.0, 1.0, 2.0, 0.0], [True, True, True, False])
    """
    multiple_of = renamed_keyword("pad_batch", "multiple", multiple, "multiple_of", multiple_of)
    if multiple_of is None:
        raise SpmdError(
            describe(
                "pad_batch",
                "no multiple_of given.",
                fix="pass the number of devices along the data axis: pad_batch(batch, multiple_of=n).",
            )
        )
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, (int, np.integer)) or multiple_of < 1:
        raise SpmdError(
            describe(
                "pad_batch",
                f"multiple_of={multiple_of!r} must be a positive int.",
                fix="pass the number of devices along the data axis (or a multiple).",
            )
        )
    if isinstance(batch, MaskedBatch):
        data, mask = batch.data, np.asarray(batch.mask, dtype=bool)
    else:
        data, mask = batch, None
    size = leading_size("pad_batch", data)
    if mask is None:
        mask = np.ones(size, dtype=bool)
    pad = (-size) % multiple_of
    if pad == 0:
        return MaskedBatch(data, mask)

    def grow(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        return np.concatenate([leaf, np.zeros((pad,) + leaf.shape[1:], leaf.dtype)])

    return MaskedBatch(jax.tree.map(grow, data), grow(mask))


def unpad(batch: MaskedBatch | Any, mask: Any = None) -> Any:
    """Drops the padded rows: keeps the rows of each leaf where the mask is True.

    Takes a :class:`MaskedBatch`, or any pytree (e.g. per-example model outputs) and a ``mask``.

    Args:
      batch: a :class:`MaskedBatch` (its own mask is used), or a pytree of arrays with a leading example
        dimension.
      mask: a bool vector with one entry per row; needed when ``batch`` is not a :class:`MaskedBatch`.

    Returns:
      The pytree of ``batch``'s data with every leaf a NumPy array of its real rows only.

    Raises:
      SpmdError: when ``batch`` is not a :class:`MaskedBatch` and no ``mask`` is given.

    Examples:
      >>> sc.unpad({"y": np.arange(4) * 10}, np.array([True, False, True, False]))["y"].tolist()
      [0, 20]
    """
    if isinstance(batch, MaskedBatch):
        batch, mask = batch.data, batch.mask
    if mask is None:
        raise SpmdError(
            describe("unpad", "no mask given.", fix="pass a MaskedBatch, or the mask as the second argument.")
        )
    keep = np.asarray(mask, dtype=bool)
    return jax.tree.map(lambda leaf: np.asarray(leaf)[keep], batch)


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


def take_batches(dataset: Any, index_batches: Iterable[Any]) -> Iterator[MaskedBatch]:
    """Gathers ``dataset`` rows for each index batch: yields ``MaskedBatch(rows, mask)``.

    ``dataset`` is a pytree of arrays indexed along dimension 0 (NumPy arrays, memory maps, or anything
    that takes an integer index array). ``index_batches`` yields :class:`MaskedBatch` es of indices (as
    :meth:`ShardedSampler.batches` does) or plain index arrays (all rows real). Padded rows are zeros.

    Args:
      dataset: a pytree of arrays indexed along dimension 0.
      index_batches: an iterable of :class:`MaskedBatch` es of indices, or of plain index arrays.

    Yields:
      ``MaskedBatch(rows, mask)`` per index batch: ``dataset``'s pytree of the rows (zeros where ``mask`` is
      False) and the index batch's mask (all True for a plain index array).

    Examples:
      >>> s = sc.ShardedSampler(5, shard_index=0, num_shards=1, shuffle=False)
      >>> [(b.data["x"].tolist(), b.mask.tolist()) for b in sc.take_batches({"x": np.arange(5) * 10},
      ...                                                                  s.batches(4))]
      [([0, 10, 20, 30], [True, True, True, True]), ([40, 0, 0, 0], [True, False, False, False])]
    """
    for item in index_batches:
        idx, mask = (item.data, item.mask) if isinstance(item, MaskedBatch) else (item, None)
        idx = np.asarray(idx)
        mask = np.ones(len(idx), bool) if mask is None else np.asarray(mask, bool)
        rows = jax.tree.map(lambda a, idx=idx, mask=mask: _zero_masked(np.asarray(a[idx]), mask), dataset)
        yield MaskedBatch(rows, mask)


def join_batches(
    batches: Iterable[Any], *, like: Any = None, timeout: float = DEFAULT_TIMEOUT
) -> Iterator[MaskedBatch]:
    """Yields this process's batches until every process has run out; meanwhile pads with empty batches.

    Each step, the processes exchange a has-data flag at a timed sync point of this call's own (through
    the coordination service, so it may run in a prefetch thread): a process that stops iterating while
    the others go on is named in a :class:`~spmdcomm.errors.BarrierTimeoutError` after ``timeout``
    seconds. Every process must call it equally often. A process whose iterator is done yields fully
    masked batches (zero data, all-False ``mask``) shaped like its last batch, or like ``like`` if it
    had none, so it keeps calling the same collectives as the others and nobody hangs (torch's
    ``Join``, Horovod's ``hvd.join``). Batches come out as :class:`MaskedBatch` (plain batches get an
    all-True mask). With one process it only adds the mask.

    Args:
      batches: this process's batches: pytrees of arrays with a common leading size, or :class:`MaskedBatch` es.
      like: an example batch that shapes the empty batches of a process that had none at all (default
        ``None``: its last batch does).
      timeout: seconds each step's sync point waits for the other processes (default 300).

    Yields:
      :class:`MaskedBatch` es: this process's batches, then, until every process has run out, fully masked
      batches of the same shapes.

    Raises:
      BarrierTimeoutError: when another process does not reach a step's sync point within ``timeout``.
      SpmdError: when this process had no batches and no ``like`` was given.

    Examples:
      >>> [b.mask.tolist() for b in sc.join_batches([{"x": np.ones(2)}])]
      [[True, True]]
    """
    source, template = iter(batches), like
    # A channel of its own: this generator often runs in a prefetch thread, beside the main thread's syncs.
    channel = Channel(f"join_batches/{next(_JOINS)}") if process_count() > 1 else None
    has_data = True
    while True:
        item = next(source, _END) if has_data else _END
        has_data = item is not _END
        if channel is not None and not _anyone_has_data(channel, has_data, timeout):
            return
        if has_data:
            template = item if isinstance(item, MaskedBatch) else pad_batch(item, 1)
            yield template
            continue
        if channel is None:
            return
        if template is None:
            raise SpmdError(
                describe(
                    "join_batches",
                    f"process {process_index()} had no batches at all, so it cannot shape "
                    "the empty batches it must feed while the other processes finish.",
                    fix="pass like=<one example batch> to join_batches.",
                )
            )
        yield _empty_like(template)


def leading_size(fn: str, tree: Any) -> int:
    """The common size of dimension 0 of every leaf of ``tree``; raises naming the leaves that differ."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise SpmdError(describe(fn, "the batch has no array leaves.", fix="pass a pytree of arrays."))
    sizes: dict[str, int] = {}
    for path, leaf in flat:
        name = jax.tree_util.keystr(path) or "<root>"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise SpmdError(
                describe(
                    fn,
                    f"is a {type(leaf).__name__}, not an array.",
                    leaf=name,
                    fix="keep only arrays in a batch (NumPy or jax.Array).",
                )
            )
        if len(leaf.shape) == 0:
            raise ShapeError(
                describe(
                    fn,
                    "is a scalar; batch leaves need a leading example dimension.",
                    leaf=name,
                    fix="give every leaf shape (batch, ...).",
                )
            )
        sizes[name] = int(leaf.shape[0])
    if len(set(sizes.values())) > 1:
        raise ShapeError(
            describe(
                fn,
                f"leaves have different leading sizes: {sizes}.",
                fix="give every leaf the same number of examples in dimension 0.",
            )
        )
    return next(iter(sizes.values()))


def renamed_keyword(fn: str, old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of keyword ``new``, also accepted for one release under its old spelling ``old`` with a
    ``DeprecationWarning`` naming the new one; ``None`` means "not passed", and passing both raises."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise SpmdError(describe(fn, f"both {new}= and its old spelling {old}= were given.", fix=f"pass only {new}=."))
    warnings.warn(
        f"spmdcomm.{fn}: {old}= is deprecated and will be removed in the next release; pass {new}={old_value!r}.",
        DeprecationWarning,
        stacklevel=3,  # the caller of fn
    )
    return old_value


# ---------------------------------------------------------------------------------------------------------


_END = object()


def _positive(fn: str, name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise SpmdError(describe(fn, f"{name}={value!r} must be a positive int."))
    return int(value)


def _non_negative(fn: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise SpmdError(describe(fn, f"{name}={value!r} must be an int >= 0."))
    return int(value)


def _zero_masked(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    if mask.all():
        return rows
    rows = rows.copy()
    rows[~mask] = 0
    return rows


def _empty_like(template: Any) -> MaskedBatch:
    data = template.data if isinstance(template, MaskedBatch) else template
    size = leading_size("join_batches", data)
    return MaskedBatch(jax.tree.map(lambda a: np.zeros(np.shape(a), np.asarray(a).dtype), data), np.zeros(size, bool))


def _anyone_has_data(channel: Channel, has_data: bool, timeout: float) -> bool:
    flags = channel.exchange("join_batches", "join_batches step", b"1" if has_data else b"0", timeout=timeout)
    return b"1" in flags


# Numbers the join_batches calls of this process; each call's channel has the same name on every process.
_JOINS = itertools.count()
