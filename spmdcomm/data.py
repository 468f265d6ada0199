"""Host batches: padding uneven batches with a mask.

torch.nn.DataParallel splits 15 examples over 2 devices as 8 + 7; SPMD programs need equal blocks, so
spmdcomm pads to 16 and carries a boolean mask that marks the real examples. Everything downstream (the DDP
step, eval metrics) weighs examples by the mask, so results equal the unpadded computation exactly.

>>> import numpy as np, spmdcomm as sc
>>> padded = sc.pad_batch({"x": np.arange(5.0)}, 4)
>>> padded.data["x"].tolist(), padded.mask.tolist()
([0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0], [True, True, True, True, True, False, False, False])
>>> sc.unpad(padded)["x"].tolist()
[0.0, 1.0, 2.0, 3.0, 4.0]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from spmdcomm.errors import ShapeError, SpmdError, describe

__all__ = ["MaskedBatch", "pad_batch", "unpad"]


class MaskedBatch(NamedTuple):
    """A batch whose leaves share a leading example dimension, and a bool ``mask`` of real examples."""

    data: Any
    mask: Any


def pad_batch(batch: Any, multiple: int) -> MaskedBatch:
    """Pads dimension 0 of every leaf with zeros up to a multiple of ``multiple``; ``mask`` marks real rows.

    A :class:`MaskedBatch` passed in is padded further, keeping its mask. Leaves must be arrays with a
    common leading size.
    """
    if not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise SpmdError(describe("pad_batch", f"multiple={multiple!r} must be a positive int.",
                                 fix="pass the number of devices along the data axis (or a multiple)."))
    if isinstance(batch, MaskedBatch):
        data, mask = batch.data, np.asarray(batch.mask, dtype=bool)
    else:
        data, mask = batch, None
    size = leading_size("pad_batch", data)
    if mask is None:
        mask = np.ones(size, dtype=bool)
    pad = (-size) % multiple
    if pad == 0:
        return MaskedBatch(data, mask)

    def grow(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        return np.concatenate([leaf, np.zeros((pad,) + leaf.shape[1:], leaf.dtype)])

    return MaskedBatch(jax.tree.map(grow, data), grow(mask))


def unpad(batch: MaskedBatch | Any, mask: Any = None) -> Any:
    """Drops the padded rows: keeps the rows of each leaf where the mask is True.

    Takes a :class:`MaskedBatch`, or any pytree (e.g. per-example model outputs) and a ``mask``.
    """
    if isinstance(batch, MaskedBatch):
        batch, mask = batch.data, batch.mask
    if mask is None:
        raise SpmdError(describe("unpad", "no mask given.",
                                 fix="pass a MaskedBatch, or the mask as the second argument."))
    keep = np.asarray(mask, dtype=bool)
    return jax.tree.map(lambda leaf: np.asarray(leaf)[keep], batch)


def leading_size(fn: str, tree: Any) -> int:
    """The common size of dimension 0 of every leaf of ``tree``; raises naming the leaves that differ."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        raise SpmdError(describe(fn, "the batch has no array leaves.", fix="pass a pytree of arrays."))
    sizes: dict[str, int] = {}
    for path, leaf in flat:
        name = jax.tree_util.keystr(path) or "<root>"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise SpmdError(describe(fn, f"is a {type(leaf).__name__}, not an array.", leaf=name,
                                     fix="keep only arrays in a batch (NumPy or jax.Array)."))
        if len(leaf.shape) == 0:
            raise ShapeError(describe(fn, "is a scalar; batch leaves need a leading example dimension.",
                                      leaf=name, fix="give every leaf shape (batch, ...)."))
        sizes[name] = int(leaf.shape[0])
    if len(set(sizes.values())) > 1:
        raise ShapeError(describe(
            fn, f"leaves have different leading sizes: {sizes}.",
            fix="give every leaf the same number of examples in dimension 0."))
    return next(iter(sizes.values()))
