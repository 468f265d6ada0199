"""Context parallelism: every sequence of the batch split over a ``context`` mesh axis, attention exact to one
device.

:class:`ContextParallel` is the policy, given once to ``TrainState.create(..., context=...)``: the axis, and how the
sequence is laid out over it. Inside the train and eval steps of such a state, dimension 1 of every batch leaf of
two or more dimensions (the tokens) is split over the axis, each device holding ``T / c`` tokens of every row of its
block; everything outside attention is token-wise and needs no communication, and the loss and metrics, means over
each device's tokens, average to the exact means over all tokens. Attention is the one place tokens meet:
:func:`context_attention` (all-to-all, DeepSpeed Ulysses, or ring attention) and :func:`context_positions` (each
local token's global index, for causal masks and positions) read the active split, and outside such a step are plain
attention over the whole sequence and ``arange``.

Layouts. ``"zigzag"`` (default) gives device ``i`` chunks ``i`` and ``2c - 1 - i`` of ``2c`` equal chunks, so that
under a causal mask every device has the same work in ring attention; ``"contiguous"`` gives device ``i`` chunk
``i``. The step reorders the tokens before splitting them (inside the compiled step, on data every context device
already holds), and every mask is built from the global positions, so both algorithms work with both layouts.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from spmdcomm.collectives._layout import LAYOUTS, step_split
from spmdcomm.collectives.attention import (
    all_to_all_attention,
    attention_reference,
    ring_attention,
    sequence_positions,
    zigzag_order,
)
from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.parallel.registry import Parallelism

__all__ = [
    "ContextParallel",
    "context_attention",
    "context_positions",
    "active_context",
    "context_split",
    "PARALLELISM",
]

Layout = Literal["zigzag", "contiguous"]


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How every sequence of the batch is split over the context axis (``TrainState.create(..., context=...)``).

    Args:
      axis: the mesh axis the sequence dimension (dimension 1 of each batch leaf of two or more dimensions) is split
        over (``"context"``).
      layout: ``"zigzag"`` (default: device ``i`` holds chunks ``i`` and ``2c - 1 - i``, balancing causal ring
        attention; the sequence length must be a multiple of ``2c``) or ``"contiguous"`` (chunk ``i``; a multiple
        of ``c``).

    Raises:
      SpmdError: for an axis that is not a string or an unknown layout.

    Examples:
      >>> sc.ContextParallel()
      ContextParallel(axis='context', layout='zigzag')
    """

    axis: str = "context"
    layout: Layout = "zigzag"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str):
            raise SpmdError(
                describe("ContextParallel", f"axis={self.axis!r} is not a mesh axis name.", fix='"context"')
            )
        if self.layout not in LAYOUTS:
            raise SpmdError(
                describe(
                    "ContextParallel",
                    f"layout={self.layout!r} is not a layout.",
                    fix='layout="zigzag" or "contiguous".',
                )
            )

    def order(self, length: int, size: int) -> np.ndarray:
        """The global positions in the order the devices hold them (split into ``size`` equal parts in turn).

        Args:
          length: the sequence length ``T``.
          size: the context axis size ``c``.

        Returns:
          An int array of ``T`` positions: ``arange(T)`` for ``"contiguous"``; for ``"zigzag"`` chunks ``i`` and
          ``2c - 1 - i`` of ``2c`` for device ``i``.

        Raises:
          ShapeError: when ``length`` does not split into the layout's chunks.

        Examples:
          >>> sc.ContextParallel().order(8, 2).tolist()
          [0, 1, 6, 7, 2, 3, 4, 5]
        """
        chunks = 2 * size if self.layout == "zigzag" else size
        if length % chunks:
            raise ShapeError(
                describe(
                    "ContextParallel",
                    f"a sequence of {length} tokens does not split into {chunks} equal chunks ({self.layout} layout "
                    f"over {size} devices of axis {self.axis!r}).",
                    fix=f"make the sequence length a multiple of {chunks} (pad it; mask the padding in the loss).",
                )
            )
        return zigzag_order(length, size) if self.layout == "zigzag" else np.arange(length)


_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar("spmdcomm_context", default=None)


def active_context() -> ContextParallel | None:
    """The context split of the step being traced (None outside a step of a state with one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def context_split(context: ContextParallel | None) -> Iterator[None]:
    """Within the block, :func:`context_attention` and :func:`context_positions` follow ``context`` (the train and
    eval steps set it while tracing), and so do ``sc.ring_attention``, ``sc.all_to_all_attention`` and
    ``sc.sequence_positions`` over its axis: their layout by default, and the only one they accept."""
    token = _ACTIVE.set(context)
    try:
        with step_split(None if context is None else (context.axis, context.layout)):
            yield
    finally:
        _ACTIVE.reset(token)


def context_positions(length: int) -> jax.Array:
    """The global positions of this device's ``length`` tokens of every sequence.

    For rotary or learned positions and for masks: outside a context-parallel step, ``arange(length)``.

    Args:
      length: the tokens of each sequence this device holds (dimension 1 of its block).

    Returns:
      An int32 array of ``length`` global positions: ``arange(length)`` outside a context-parallel step.

    Examples:
      >>> sc.context_positions(4).tolist()
      [0, 1, 2, 3]
    """
    context = active_context()
    if context is None:
        return jnp.arange(length, dtype=jnp.int32)
    return sequence_positions(length, context.axis, layout=context.layout)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    algorithm: Literal["ring", "all_to_all"] = "ring",
) -> jax.Array:
    """Softmax attention of ``q`` over ``k`` and ``v``, exact to one device whatever the context split of the step.

    ``q``, ``k``, ``v`` are ``[batch, tokens, heads, head_dim]``; ``k`` and ``v`` may have fewer heads
    (grouped-query attention: query head ``j`` reads KV head ``j // (heads / kv_heads)``). Outside a
    context-parallel step the tokens are the whole sequence and this is plain attention
    (``spmdcomm.collectives.attention.attention_reference``); in a program of your own whose sequence is split over
    an axis, call :func:`~spmdcomm.ring_attention` or :func:`~spmdcomm.all_to_all_attention` with that axis. Inside a
    step of a state with ``context=sc.ContextParallel(...)``, each device holds its tokens of every sequence and this
    is exactly ``sc.ring_attention`` (``algorithm="ring"``) or ``sc.all_to_all_attention`` (``"all_to_all"``) over
    the context axis, in the split's layout: the ring passes key/value blocks around the axis with a running
    log-sum-exp and its backward pass reruns the ring; the all-to-all (DeepSpeed Ulysses) swaps the split from
    tokens to heads and back (the heads must divide the context size; KV heads that do not are repeated).

    Args:
      q: the queries, ``[batch, tokens, heads, head_dim]``.
      k: the keys, ``[batch, tokens, kv_heads, head_dim]`` (``kv_heads`` divides ``heads``).
      v: the values, shaped like ``k``.
      causal: each token sees only tokens at or before its global position.
      segment_ids: int ``[tokens]`` or ``[batch, tokens]``: a token sees only tokens of its segment (packed
        sequences).
      kv_mask: bool or int ``[tokens]`` or ``[batch, tokens]``: keys that are False or 0 (padding) are seen by no
        token, nonzero ones are attended to (a tokenizer's ``attention_mask`` works as it is).
      algorithm: ``"ring"`` (default) or ``"all_to_all"``; checked on every path, in a step or not.

    Returns:
      ``[batch, tokens, heads, head_dim]``, in ``q``'s dtype; zeros for a query that sees no key.

    Raises:
      ShapeError: for shapes that do not fit together, or heads that do not divide the context size
        (``"all_to_all"``).
      SpmdError: for an unknown ``algorithm`` or a ``causal`` that is not a bool.

    Examples:
      >>> jax.jit(sc.context_attention)(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8))).shape
      (1, 4, 2, 8)
    """
    if algorithm not in ALGORITHMS:
        raise SpmdError(
            describe(
                "context_attention",
                f"algorithm={algorithm!r} is not an algorithm.",
                fix='algorithm="ring" or "all_to_all".',
            )
        )
    masks: dict[str, Any] = {"causal": causal, "segment_ids": segment_ids, "kv_mask": kv_mask}
    context = active_context()
    if context is None:
        return attention_reference(q, k, v, **masks)
    return ALGORITHMS[algorithm](q, k, v, context.axis, layout=context.layout, **masks)


#: ``context_attention``'s algorithms: the collective each runs over the context axis.
ALGORITHMS = {"ring": ring_attention, "all_to_all": all_to_all_attention}


#: Context parallelism's entry of the registry (:mod:`spmdcomm.parallel.registry`): its axis splits the tokens of
#: every row, in :meth:`ContextParallel.order`; attention reads the split the steps install.
PARALLELISM = Parallelism(
    role="context",
    keyword="context",
    config=ContextParallel,
    axis_words="the context axis",
    example="sc.ContextParallel()",
    rows=False,
    step_context=lambda context, roles: context_split(context),
)
