"""Which rows of the model's input are real, inside a step.

A step given a masked batch (:class:`~spmdcomm.MaskedBatch`, ``sc.pad_batch``) runs the model on padding rows too;
the loss leaves them out through ``mask``. Layers whose result couples the rows (a mixture of experts: its capacity,
load-balancing loss and counts are over the whole batch) must leave them out as well, without the user threading the
mask through the model. The train and eval steps install each micro-batch's row mask around the user's function
(:func:`rows_of`), a pipeline's layer stack narrows it to the micro-batch a stage runs, and such a layer reads it with
:func:`real_rows`. Outside a step, or for an unmasked batch, there is none.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

__all__ = ["UNKNOWN", "Unknown", "real_rows", "rows_of"]


class Unknown:
    """The marker of a model call whose rows are not the step's (a stack whose input has another row count)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


#: What :func:`real_rows` returns where the step's batch is masked but the rows a layer runs on cannot be matched to
#: it (a pipeline stack given an input whose dimension 0 is not the batch's rows).
UNKNOWN = Unknown()

_ROWS: contextvars.ContextVar[jax.Array | Unknown | None] = contextvars.ContextVar("spmdcomm_real_rows", default=None)


def real_rows() -> jax.Array | Unknown | None:
    """The ``[rows]`` bool mask of the rows the model is running on, :data:`UNKNOWN`, or ``None`` (every row real:
    outside a step, or an unmasked batch)."""
    return _ROWS.get()


@contextlib.contextmanager
def rows_of(mask: jax.Array | Unknown | None) -> Iterator[None]:
    """Within the block, :func:`real_rows` is ``mask``."""
    token = _ROWS.set(mask)
    try:
        yield
    finally:
        _ROWS.reset(token)
