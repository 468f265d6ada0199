"""The reduction ops and the ``op``/``root`` rules shared by the device collectives and the host syncs.

One table (:data:`REDUCE_OPS`) and one rule per argument, so that every function that takes ``op`` or
``root`` accepts and rejects the same values with the same words:

- ``op`` is one of the allowed strings;
- ``root`` is an ``int`` or a NumPy integer (``np.int64(3)``, e.g. from ``np.argmax``), not a ``bool``, in
  ``[0, n)``; other device indices (``permute``'s pairs, ``shift``'s offset) pass the same :func:`is_index`.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal

import numpy as np

from spmdcomm.errors import AxisError, SpmdError, describe

__all__ = ["REDUCE_OPS", "SCAN_OPS", "ReduceOp", "check_op", "check_root", "is_index"]

ReduceOp = Literal["sum", "mean", "max", "min", "prod"]

# The element-wise reductions of all_reduce, reduce_scatter, reduce and host_all_reduce.
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")
# The prefix reductions of scan ("mean" is no associative prefix op).
SCAN_OPS: tuple[str, ...] = ("sum", "max", "min", "prod")


def check_op(fn: str, op: Any, allowed: tuple[str, ...] = REDUCE_OPS) -> str:
    """Returns ``op`` if it is one of ``allowed``; raises :class:`SpmdError` naming ``fn``, the value and the set."""
    if isinstance(op, str) and op in allowed:
        return op
    raise SpmdError(describe(fn, f"unknown op {op!r}.", fix=f"use one of {allowed}."))


def check_root(fn: str, root: Any, n: int, *, what: Literal["device", "process"] = "device", axis: Any = None) -> int:
    """Returns ``root`` as an ``int`` if it indexes one of ``n`` devices (or processes); raises otherwise.

    ``int`` and NumPy integers are accepted, ``bool`` is not (``root=True`` is a mistake, not device 1). A
    device root outside ``axis`` raises :class:`AxisError`; a process root, :class:`SpmdError`. The message
    names ``fn``, the value, the range and what to pass instead.
    """
    where = f"axis {axis!r} of size {n}" if what == "device" else f"a job of {n} process(es)"
    fix = f"pass a {what} index in [0, {n})."
    error = AxisError if what == "device" else SpmdError
    if not is_index(root):
        kind = "a bool" if isinstance(root, bool | np.bool_) else f"a {type(root).__name__}"
        raise error(describe(fn, f"root={root!r} is {kind}, not a {what} index of {where}.", fix=fix))
    if not 0 <= root < n:
        raise error(describe(fn, f"root={root!r} is out of range for {where}.", fix=fix))
    return int(root)


def is_index(value: Any) -> bool:
    """True for an ``int`` or a NumPy integer, False for a ``bool`` (an index is never ``True``/``False``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
