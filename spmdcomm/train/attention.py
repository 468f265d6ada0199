"""Attention kernels of context (sequence) parallelism: the sequence is split over a ``context`` mesh axis and each
device holds a block of the tokens of ``q``, ``k`` and ``v`` (``[batch, t_local, heads, head_dim]``, ``t_local = T /
c``). The functions here run inside a ``jax.shard_map`` that is manual over that axis.

Two algorithms, which give the attention of the whole sequence to the tokens each device holds:

- :func:`ulysses_attention` (all-to-all, DeepSpeed Ulysses): one ``all_to_all`` swaps the split from the sequence to
  the heads, any attention kernel runs on whole sequences (``h / c`` heads per device), and one more swaps it back.
  Needs the heads and the KV heads divisible by ``c``.
- :func:`ring_attention`: the key/value blocks travel around the ring (``c - 1`` ``ppermute`` hops) while each device
  merges its blockwise results with a running log-sum-exp (online softmax). Its custom VJP keeps only ``q``, ``k``,
  ``v``, the output and the log-sum-exp, and runs the ring again in the backward pass, recomputing each block's
  probabilities; the gradients of ``k`` and ``v`` travel with their blocks and come home after the ring.

Masks come from the global position of every token (``q_pos``, ``k_pos``), never from where a token is stored, so any
split of the sequence works; :func:`local_positions` gives them for the contiguous and the zig-zag split
(:func:`zigzag_order`: device ``i`` holds chunks ``i`` and ``2c - 1 - i`` of ``2c``, which balances causal work). A
key is visible to a query when it is valid (``k_valid``: False for padding), in the same segment (packed sequences)
and, with ``causal``, not later (``k_pos <= q_pos``). A query that sees no key gets zeros, in the output and in
every gradient. Softmax and accumulation run in float32; the output has ``q``'s dtype. Keys and values may have
fewer heads than queries (grouped-query attention): query head ``j`` reads KV head ``j // (heads / kv_heads)``.
:func:`attention_reference` is the same attention on one device, which both algorithms equal.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.train._attention_blocks import attend, mask, ring, sides

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "attention_reference",
    "zigzag_order",
    "zigzag_inverse",
    "local_positions",
]


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: str,
    q_pos: jax.Array,
    k_pos: jax.Array,
    causal: bool,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    k_valid: jax.Array | None = None,
    kernel: Callable[..., jax.Array] | None = None,
) -> jax.Array:
    """Attention over a sequence split on ``axis``, by swapping the split to the heads (all-to-all, Ulysses).

    Inside a ``shard_map`` manual over ``axis`` (size ``c``). Each device sends ``c - 1`` of its ``c`` head groups
    away and receives the other blocks of its own group: ``[b, T, h / c, d]``, the blocks in device order. Positions,
    segments and validity are all-gathered the same way, so the mask is that of the whole sequence whatever the
    split. After the kernel a second all-to-all brings every token's output back to its device. Each device sends
    ``(c - 1) / c`` of each of its ``q``, ``k``, ``v`` and output blocks, where the ring sends ``c - 1`` whole key/value
    blocks.

    Args:
      q: ``[b, t_local, h, d]``, this device's queries.
      k: ``[b, t_local, h_kv, d]``, this device's keys (``h_kv`` divides ``h``).
      v: the values, shaped like ``k``.
      axis: the context mesh axis the sequence is split over.
      q_pos: int ``[t_local]`` or ``[b, t_local]``, each local query's global token position.
      k_pos: the same for the keys.
      causal: a query sees only keys at its position or before.
      q_segments: int ids ``[t_local]`` or ``[b, t_local]`` of packed sequences; a query sees only its own
        segment's keys. None: one sequence.
      k_segments: the keys' segment ids; given together with ``q_segments``.
      k_valid: bool ``[t_local]`` or ``[b, t_local]``, False for keys that are padding. None: all valid.
      kernel: None, float32 softmax attention in ``jax.numpy``; or a function called as ``kernel(q, k, v,
        mask=mask)`` with ``q`` ``[b, T, h / c, d]``, ``k`` and ``v`` ``[b, T, h_kv / c, d]`` and a bool ``mask``
        ``[b or 1, 1, T, T]`` (True: visible), returning ``[b, T, h / c, d]``, e.g.
        ``jax.nn.dot_product_attention``. Rows with no visible key are set to zero after it.

    Returns:
      ``[b, t_local, h, d]`` in ``q``'s dtype: each local query's attention over the whole sequence.

    Raises:
      ShapeError: for shapes that do not fit together, or heads or KV heads that ``c`` does not divide.

    Examples:
      >>> from spmdcomm.train import attention
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("context",))
      >>> def attend(q, k, v):
      ...     pos = attention.local_positions(q.shape[1], "context", "zigzag")
      ...     return attention.ulysses_attention(
      ...         q, k, v, axis="context", q_pos=pos, k_pos=pos, causal=True)
      >>> spec = jax.P(None, "context")
      >>> x = jnp.ones((1, 8, 2, 4))
      >>> jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, x, x).shape
      (1, 8, 2, 4)
    """
    fn = "ulysses_attention"
    qside, kside = sides(fn, q, k, v, q_pos, k_pos, q_segments, k_segments, k_valid)
    c = lax.axis_size(axis)
    for name, heads in (("heads", q.shape[2]), ("KV heads", k.shape[2])):
        if heads % c:
            raise ShapeError(
                describe(
                    fn,
                    f"{heads} {name} (q {q.shape[2]} heads, k/v {k.shape[2]} KV heads) do not split over the "
                    f"context axis {axis!r} of size {c}: the all-to-all gives each device heads / {c} of them.",
                    fix=f"use a number of {name} divisible by {c}, a context axis whose size divides them, or "
                    "ring_attention (any head count).",
                )
            )
    to_heads = lambda x: lax.all_to_all(x, axis, 2, 1, tiled=True)
    full = lambda side: jax.tree.map(lambda x: lax.all_gather(x, axis, axis=1, tiled=True), side)
    visible = mask(full(qside), full(kside), causal)
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    if kernel is None:
        out = attend(qh, kh, vh, visible)
    else:
        out = kernel(qh, kh, vh, mask=visible[:, None])
        out = jnp.where(jnp.any(visible, axis=-1)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return lax.all_to_all(out.astype(q.dtype), axis, 1, 2, tiled=True)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: str,
    q_pos: jax.Array,
    k_pos: jax.Array,
    causal: bool,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Attention over a sequence split on ``axis``, the key/value blocks passed around a ring (online softmax).

    Inside a ``shard_map`` manual over ``axis`` (size ``c``). Step ``s`` attends this device's queries to the block
    of device ``i - s`` and merges it into float32 running statistics (the row maximum, the softmax denominator and
    the weighted values); between steps every key/value block, with its positions, segments and validity, moves one
    device on (``c - 1`` ``ppermute`` hops). The backward pass (a custom VJP) saves only ``q``, ``k``, ``v``, the
    output, the log-sum-exp and the token positions and segments, and runs the ring again: each block's
    probabilities are recomputed from the log-sum-exp, ``dq`` accumulates here, and the ``dk``/``dv`` accumulators
    travel with their blocks and take one more hop home at the end (``c`` hops). So the memory of the backward pass
    does not grow with the number of blocks, where autodiff through the forward ring would keep every block's
    probabilities. Any number of heads works. With ``causal``, lay the sequence out in zig-zag order
    (:func:`local_positions`) so that every device has the same share of visible pairs in every step.

    Args:
      q: ``[b, t_local, h, d]``, this device's queries.
      k: ``[b, t_local, h_kv, d]``, this device's keys (``h_kv`` divides ``h``).
      v: the values, shaped like ``k``.
      axis: the context mesh axis the sequence is split over.
      q_pos: int ``[t_local]`` or ``[b, t_local]``, each local query's global token position.
      k_pos: the same for the keys.
      causal: a query sees only keys at its position or before.
      q_segments: int ids ``[t_local]`` or ``[b, t_local]`` of packed sequences; a query sees only its own
        segment's keys. None: one sequence.
      k_segments: the keys' segment ids; given together with ``q_segments``.
      k_valid: bool ``[t_local]`` or ``[b, t_local]``, False for keys that are padding. None: all valid.

    Returns:
      ``[b, t_local, h, d]`` in ``q``'s dtype: each local query's attention over the whole sequence.

    Raises:
      ShapeError: for shapes that do not fit together.

    Examples:
      >>> from spmdcomm.train import attention
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("context",))
      >>> def attend(q, k, v):
      ...     pos = attention.local_positions(q.shape[1], "context", "zigzag")
      ...     return attention.ring_attention(q, k, v, axis="context", q_pos=pos, k_pos=pos, causal=True)
      >>> spec = jax.P(None, "context")
      >>> x = jnp.ones((1, 8, 2, 4))
      >>> jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, x, x).shape
      (1, 8, 2, 4)
    """
    qside, kside = sides("ring_attention", q, k, v, q_pos, k_pos, q_segments, k_segments, k_valid)
    return ring(axis, causal, q, k, v, qside, kside)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    causal: bool,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Attention of the whole sequence on one device, with the mask rules of the context-parallel kernels.

    Float32 softmax over the visible keys, scaled by ``1 / sqrt(d)``; a query with no visible key gets zeros. The
    tokens may be in any order: the mask comes from the positions given.

    Args:
      q: ``[b, T, h, d]``.
      k: ``[b, S, h_kv, d]`` (``h_kv`` divides ``h``).
      v: the values, shaped like ``k``.
      q_pos: int ``[T]`` or ``[b, T]``, each query's position.
      k_pos: int ``[S]`` or ``[b, S]``, each key's position.
      causal: a query sees only keys at its position or before.
      q_segments: int ids ``[T]`` or ``[b, T]`` of packed sequences, or None.
      k_segments: the keys' segment ids ``[S]`` or ``[b, S]``, given together with ``q_segments``.
      k_valid: bool ``[S]`` or ``[b, S]``, False for padding keys; None: all valid.

    Returns:
      ``[b, T, h, d]`` in ``q``'s dtype.

    Raises:
      ShapeError: for shapes that do not fit together.

    Examples:
      >>> from spmdcomm.train import attention
      >>> x = jnp.ones((1, 4, 2, 8))
      >>> pos = jnp.arange(4)
      >>> attention.attention_reference(x, x, x, q_pos=pos, k_pos=pos, causal=True).shape
      (1, 4, 2, 8)
    """
    qside, kside = sides("attention_reference", q, k, v, q_pos, k_pos, q_segments, k_segments, k_valid)
    return attend(q, k, v, mask(qside, kside, causal))


def zigzag_order(T: int, c: int) -> np.ndarray:
    """The order of the tokens that gives device ``i`` chunks ``i`` and ``2c - 1 - i`` of a contiguous split.

    Cut the sequence into ``2c`` equal chunks; ``x[:, zigzag_order(T, c)]`` split contiguously over ``c`` devices
    puts chunks ``i`` and ``2c - 1 - i`` on device ``i``, so that under causal masking every device has the same
    number of visible query/key pairs. Entry ``j`` is the global position of the token stored at ``j``.

    Args:
      T: the sequence length, a multiple of ``2 c``.
      c: the size of the context axis.

    Returns:
      An int64 permutation of ``range(T)``; :func:`zigzag_inverse` undoes it.

    Raises:
      ShapeError: when ``2 c`` does not divide ``T``.

    Examples:
      >>> from spmdcomm.train import attention
      >>> attention.zigzag_order(8, 2).tolist()   # device 0: chunks 0 and 3; device 1: chunks 1 and 2
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if c < 1 or T % (2 * c):
        raise ShapeError(
            describe(
                "zigzag_order",
                f"a sequence of {T} tokens does not cut into 2 c = {2 * c} equal chunks (c = {c} devices).",
                fix=f"pad the sequence to a multiple of {2 * max(c, 1)} tokens.",
            )
        )
    chunks = np.arange(T).reshape(2 * c, T // (2 * c))
    return chunks[[j for i in range(c) for j in (i, 2 * c - 1 - i)]].reshape(-1)


def zigzag_inverse(T: int, c: int) -> np.ndarray:
    """The inverse of :func:`zigzag_order`: ``y[:, zigzag_inverse(T, c)]`` puts zig-zag tokens back in order.

    Args:
      T: the sequence length, a multiple of ``2 c``.
      c: the size of the context axis.

    Returns:
      An int64 permutation of ``range(T)``.

    Raises:
      ShapeError: when ``2 c`` does not divide ``T``.

    Examples:
      >>> from spmdcomm.train import attention
      >>> attention.zigzag_inverse(8, 2).tolist()
      [0, 1, 4, 5, 6, 7, 2, 3]
    """
    return np.argsort(zigzag_order(T, c))


def local_positions(t_local: int, axis: str, layout: str = "contiguous") -> jax.Array:
    """This device's global token positions for a sequence split over ``axis`` (inside ``shard_map``).

    Args:
      t_local: the tokens per device, ``T / c``.
      axis: the context mesh axis.
      layout: ``"contiguous"`` (device ``i`` holds ``[i t_local, (i + 1) t_local)``) or ``"zigzag"`` (chunks ``i``
        and ``2c - 1 - i`` of ``2c``, as after :func:`zigzag_order`; ``t_local`` even).

    Returns:
      int32 ``[t_local]``.

    Raises:
      SpmdError: for another layout, or an odd ``t_local`` with ``"zigzag"`` (a :class:`ShapeError`).

    Examples:
      >>> from spmdcomm.train import attention
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("context",))
      >>> f = lambda: attention.local_positions(4, "context", "zigzag")
      >>> jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=jax.P("context"))().tolist()
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    i = lax.axis_index(axis)
    if layout == "contiguous":
        return (i * t_local + jnp.arange(t_local)).astype(jnp.int32)
    if layout != "zigzag":
        raise SpmdError(
            describe("local_positions", f"layout={layout!r} is not a known layout.", fix='"contiguous" or "zigzag".')
        )
    if t_local % 2:
        raise ShapeError(
            describe(
                "local_positions",
                f"the zig-zag layout holds two equal chunks per device, but t_local={t_local} is odd.",
                fix="pad the sequence to a multiple of 2 c tokens (zigzag_order).",
            )
        )
    half = t_local // 2
    c = lax.axis_size(axis)
    return jnp.concatenate([i * half + jnp.arange(half), (2 * c - 1 - i) * half + jnp.arange(half)]).astype(jnp.int32)
