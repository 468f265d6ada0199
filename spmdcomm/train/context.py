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

from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.train.attention import (
    attention_reference,
    local_positions,
    ring_attention,
    ulysses_attention,
    zigzag_order,
)

__all__ = ["ContextParallel", "context_attention", "context_positions", "active_context", "context_split"]

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
        if self.layout not in ("zigzag", "contiguous"):
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
    eval steps set it while tracing)."""
    token = _ACTIVE.set(context)
    try:
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
    return local_positions(length, context.axis, context.layout)


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
    """Softmax attention of ``q`` over ``k`` and ``v``, exact to one device whatever the context split.

    ``q``, ``k``, ``v`` are ``[batch, tokens, heads, head_dim]`` (fewer KV heads for grouped-query attention).
    Outside a context-parallel step the tokens are the whole sequence and this is plain attention. Inside one, each
    device holds its tokens of every sequence and ``algorithm`` moves what attention needs: ``"all_to_all"``
    (DeepSpeed Ulysses: one all-to-all swaps the split from tokens to heads, attention runs on whole sequences, one
    all-to-all swaps back; the heads and KV heads must divide the context size) or ``"ring"`` (key/value blocks
    travel around the context axis while each device merges blockwise results with a running log-sum-exp; the
    backward pass reruns the ring instead of keeping every block).

    Args:
      q: the queries.
      k: the keys.
      v: the values.
      causal: each token sees only tokens at or before its global position.
      segment_ids: ``[batch, tokens]`` ints: a token sees only tokens of its segment (packed sequences).
      kv_mask: ``[batch, tokens]`` bools: False keys (padding) are seen by no token.
      algorithm: ``"ring"`` (default) or ``"all_to_all"``.

    Returns:
      ``[batch, tokens, heads, head_dim]``, in ``q``'s dtype; zeros for a query that sees no key.

    Raises:
      ShapeError: when heads or KV heads do not divide the context size (``"all_to_all"``).
      SpmdError: for an unknown ``algorithm``.
    """
    context = active_context()
    tokens = q.shape[1]
    positions = context_positions(tokens)
    masks: dict[str, Any] = {
        "q_pos": positions,
        "k_pos": positions,
        "causal": causal,
        "q_segments": segment_ids,
        "k_segments": segment_ids,
        "k_valid": kv_mask,
    }
    if context is None:
        return attention_reference(q, k, v, **masks)
    if algorithm == "ring":
        return ring_attention(q, k, v, axis=context.axis, **masks)
    if algorithm == "all_to_all":
        return ulysses_attention(q, k, v, axis=context.axis, **masks)
    raise SpmdError(
        describe("context_attention", f"algorithm={algorithm!r} is not an algorithm.", fix='"ring" or "all_to_all".')
    )
