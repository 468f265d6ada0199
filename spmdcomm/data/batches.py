"""Host batches: padding uneven batches with a mask, gathering index batches and joining.

torch.nn.DataParallel splits 15 examples over 2 devices as 8 + 7; SPMD programs need equal blocks, so
spmdcomm pads to 16 and carries a boolean mask that marks the real examples. Everything downstream (the DDP
step, eval metrics) weighs examples by the mask, so results equal the unpadded computation exactly.

>>> import numpy as np, spmdcomm as sc
>>> padded = sc.pad_batch({"x": np.arange(5.0)}, 4)
>>> padded.data["x"].tolist(), padded.mask.tolist()
([0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0], [True, True, True, True, True, False, False, False])
>>> sc.unpad(padded)["x"].tolist()
[0.0, 1.0, 2.0, 3.0, 4.0]

:func:`take_batches` gathers the rows of index batches (such as :class:`spmdcomm.ShardedSampler`'s, in
:mod:`spmdcomm.data.sampler`, which splits a data set across processes so that every example is used exactly once
per epoch), and :func:`join_batches` keeps processes whose iterators run out early stepping with fully masked
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


def take_batches(dataset: Any, index_batches: Iterable[Any]) -> Iterator[MaskedBatch]:
    """Gathers ``dataset`` rows for each index batch: yields ``MaskedBatch(rows, mask)``.

    ``dataset`` is a pytree of arrays indexed along dimension 0 (NumPy arrays, memory maps, or anything
    that takes an integer index array). ``index_batches`` yields :class:`MaskedBatch` es of indices (as
    :meth:`spmdcomm.ShardedSampler.batches` does) or plain index arrays (all rows real). Padded rows are zeros.

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
