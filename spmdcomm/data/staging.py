"""Aligned host memory for zero-copy placement on CPU, and the staging pool prefetch copies unaligned leaves into.

On CPU, ``jax.device_put`` of a 64-byte aligned, contiguous NumPy array aliases the host memory instead of copying
it. :func:`aligned_empty` gives loaders such arrays; :class:`StagingPool` gives prefetch's placing thread aligned
buffers that are reused only once nothing can read them.

**Who owns a staging buffer.** Each staged leaf gets its memory through a lease object; the NumPy array
handed to JAX is a view whose ``base`` is that lease. Anything that can still read the memory keeps the
lease alive: the staged NumPy view, and every device buffer that aliases it (JAX keeps a reference to the
host array it aliases until the device buffer is freed, which waits for every computation still reading
it; without that reference the memory could be freed under the device array). Only when the lease is
garbage collected does its memory go back to the pool for another batch. So a batch the loop keeps, a
shard taken out of it, or a dropped batch that a dispatched step still reads is never overwritten; while
leases are out, new batches get fresh buffers. If JAX copies instead of aliasing, it drops the reference
once the copy is done and the buffer returns at once.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import numpy as np

__all__ = ["aligned_empty", "is_aligned", "StagingPool", "ALIGNMENT"]

# Host arrays aligned to this many bytes are put on CPU devices without a copy.
ALIGNMENT = 64


def aligned_empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """An uninitialised C-contiguous NumPy array whose data starts on a 64-byte boundary.

    Loaders that fill their batches into such arrays let :func:`prefetch_to_device` (and
    ``jax.device_put``) put them on CPU devices without copying, as long as each device's block is a
    multiple of 64 bytes. The device arrays then alias the memory: do not write into it afterwards.

    Args:
      shape: the array's shape, an int for one dimension or a tuple of ints.
      dtype: anything ``np.dtype`` accepts (default ``np.float32``).

    Returns:
      A new, uninitialised, writable C-contiguous array of ``shape`` and ``dtype`` whose data address is a
      multiple of 64.

    Examples:
      >>> x = sc.data.aligned_empty((256, 3), np.float32)
      >>> x.ctypes.data % 64, x.shape, x.dtype, x.flags.c_contiguous
      (0, (256, 3), dtype('float32'), True)
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset:][:nbytes].view(dtype).reshape(shape)


def is_aligned(leaf: np.ndarray) -> bool:
    return leaf.flags.c_contiguous and leaf.ctypes.data % ALIGNMENT == 0


class _Lease:
    """Owns one staging buffer's memory while anything can read it (see the module's ownership rule).

    NumPy arrays made from it (``np.asarray(lease)``) and their views keep it as their ``base``; when it is
    collected, a finalizer hands the memory back to its pool.
    """

    def __init__(self, raw: np.ndarray):
        self.__array_interface__ = {
            "data": (raw.ctypes.data, False),
            "shape": raw.shape,
            "typestr": "|u1",
            "version": 3,
        }


class StagingPool:
    """Aligned staging memory per size in bytes; a buffer comes back only when its lease is collected."""

    def __init__(self, keep: int):
        self.keep = keep  # free buffers kept per size; more are released to the allocator
        self.free: dict[int, collections.deque[np.ndarray]] = {}
        self.allocated = 0  # buffers ever allocated (the rest of the copies reused returned ones)

    def copy(self, leaf: np.ndarray) -> np.ndarray:
        """An aligned copy of ``leaf`` in memory that nothing else can read, leased to the returned array."""
        free = self.free.setdefault(leaf.nbytes, collections.deque())
        try:
            raw = free.pop()
        except IndexError:
            raw = aligned_empty(leaf.nbytes, np.uint8)
            self.allocated += 1
        lease = _Lease(raw)
        # The finalizer holds the memory (raw) and may run on any thread, JAX's included: deque appends are
        # atomic, so it takes no lock.
        weakref.finalize(lease, self._give_back, free, raw).atexit = False
        view = np.asarray(lease).view(leaf.dtype).reshape(leaf.shape)
        np.copyto(view, leaf)
        return view

    def _give_back(self, free: collections.deque[np.ndarray], raw: np.ndarray) -> None:
        if len(free) < self.keep:
            free.append(raw)
