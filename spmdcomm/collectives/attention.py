"""Attention over a sequence split along a mesh axis: ``ring_attention`` and ``all_to_all_attention``.

Each device holds ``t = T / n`` tokens of every sequence (``n`` the size of ``axis``): its block of the queries
``q`` ``[b, t, h, d]`` and of the keys and values ``k``, ``v`` ``[b, t, h_kv, d]``. Both return this device's block of
the softmax attention of the whole sequence, ``[b, t, h, d]`` in ``q``'s dtype, exactly what one device computes on
the whole sequence (to float round-off): softmax over the visible keys scaled by ``1 / sqrt(d)``, accumulated in
float32, zeros for a query that sees no key (in the output and every derivative, never NaN).

- :func:`ring_attention`: the key/value blocks travel around the axis (``n - 1`` ``ppermute`` hops) while each device
  merges blockwise results with a running log-sum-exp (online softmax). Any head count. Its derivative keeps only
  ``q``, ``k``, ``v``, the output and the log-sum-exp and runs the ring again, so memory holds one ``t x t`` block
  of scores per head at a time, at every ``n``.
- :func:`all_to_all_attention` (DeepSpeed Ulysses): one ``all_to_all`` swaps the split from the tokens to the heads,
  attention runs on whole sequences for ``h / n`` heads (any kernel), one more swaps back. The heads must divide by
  ``n``; KV heads that do not are repeated first, the fewest times that make them divide.

Layouts: which tokens a device holds. ``"contiguous"`` (what ``P(None, axis)`` gives a sequence in order): device
``i`` holds chunk ``i`` of ``n``. ``"zigzag"``: device ``i`` holds chunks ``i`` and ``2n - 1 - i`` of ``2n``, the
sequence stored in :func:`zigzag_order`, so that under a causal mask every device has the same work. ``layout=None``
(the default) is the layout of the train step being traced when its ``sc.ContextParallel`` splits ``axis`` (a
different explicit layout there raises ``SpmdError``), else ``"contiguous"``. Every mask is built from the global
positions of the tokens (:func:`sequence_positions`), never from where they are stored: ``causal`` (a query sees keys
at or before its position), ``kv_mask`` (keys that are False or 0, padding, are seen by no query; bool or int, so a
tokenizer's ``attention_mask`` works as it is) and ``segment_ids`` (packed sequences: a query sees only keys of its
segment). Grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q``; query head ``j`` reads KV head
``j // (h / h_kv)``.

Derivatives: both differentiate in ``q``, ``k`` and ``v`` in reverse and forward mode (``jax.grad``, ``jax.vjp``,
``jax.jvp``, ``jax.linearize``, and second derivatives), under ``jax.jit``, ``jax.vmap`` and ``jax.checkpoint``,
inside :func:`spmdcomm.spmd` and raw ``jax.shard_map``. The ring's derivative is a custom JVP whose linear part
has a transpose of its own (``jax.custom_derivatives.linear_call``): forward mode runs one more ring carrying the
tangents, reverse mode runs the ring again from the saved log-sum-exp. The train step's ``sc.context_attention``
calls these same functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm.collectives._attention_blocks import attend, mask, ring, sides
from spmdcomm.collectives._layout import Layout, positions, resolve
from spmdcomm.errors import ShapeError, SpmdError, describe

__all__ = ["ring_attention", "all_to_all_attention", "sequence_positions", "zigzag_order", "attention_reference"]


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str,
    *,
    causal: bool = False,
    layout: Layout | None = None,
    segment_ids: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention over a sequence split along ``axis``, the key/value blocks passed around a ring.

    Step ``s`` attends this device's queries to the block of device ``i - s`` and merges it into float32 running
    statistics (row maximum, denominator, weighted values); between steps every key/value block, with its
    positions, segments and padding, moves one device on: ``n - 1`` ``ppermute`` hops of ``k`` and ``v``. The
    backward pass runs the ring again, recomputing each block's probabilities from the saved log-sum-exp; the
    ``dk``/``dv`` accumulators travel with their blocks and take one more hop home (``n`` hops). Forward mode
    (``jax.jvp``, ``jax.linearize``) runs one more ring, the tangents of ``k`` and ``v`` travelling with their
    blocks. Memory: one ``t x t`` block of scores per head at a time, at every ``n``. Any number of heads.

    Args:
      q: ``[b, t, h, d]``, this device's queries (``t = T / n`` tokens of every sequence).
      k: ``[b, t, h_kv, d]``, this device's keys; ``h_kv`` divides ``h`` (grouped-query attention: query head ``j``
        reads KV head ``j // (h / h_kv)``).
      v: the values, shaped like ``k``.
      axis: the mesh axis the sequence is split over (any name), bound by the enclosing ``spmd`` or
        ``jax.shard_map``.
      causal: a query sees only keys at or before its global position.
      layout: ``"contiguous"`` (device ``i`` holds chunk ``i`` of ``n``) or ``"zigzag"`` (chunks ``i`` and
        ``2n - 1 - i`` of ``2n``: the sequence stored in :func:`zigzag_order`; ``t`` even). None (default): inside
        a train or eval step whose ``sc.ContextParallel`` splits ``axis``, the step's layout (the only one accepted
        there); elsewhere ``"contiguous"``.
      segment_ids: int ``[t]`` or ``[b, t]``, the segment of each local token (packed sequences); a query sees
        only keys of its segment. None: one sequence.
      kv_mask: bool or int ``[t]`` or ``[b, t]`` for the local keys: True or nonzero for a key that is attended to,
        False or 0 for padding (seen by no query); a tokenizer's 0/1 ``attention_mask`` works as it is. Values are
        not checked (inside ``jax.jit`` they cannot be): any nonzero attends. None: all.

    Returns:
      ``[b, t, h, d]`` in ``q``'s dtype: this device's block of the attention over the whole sequence; zeros for a
      query that sees no key.

    Raises:
      AxisError: if ``axis`` is not bound here.
      ShapeError: for shapes that do not fit together (named with the sizes), or ``"zigzag"`` with an odd ``t``.
      SpmdError: for an unknown ``layout``, a ``layout`` other than the traced step's for its context axis, or a
        ``causal`` that is not a bool.

    Examples:
      Eight tokens split over 4 devices of an axis ``"seq"``, each holding 2:

      >>> mesh = sc.make_mesh({"seq": 4}, devices=jax.devices()[:4])
      >>> attend = sc.spmd(lambda q, k, v: sc.ring_attention(q, k, v, "seq", causal=True), mesh=mesh,
      ...                  in_specs=sc.P(None, "seq"), out_specs=sc.P(None, "seq"))
      >>> x = jnp.ones((1, 8, 2, 4))
      >>> attend(x, x, x).shape
      (1, 8, 2, 4)
    """
    fn = "ring_attention"
    qside, kside = _sides(fn, q, k, v, axis, causal, layout, segment_ids, kv_mask)
    return ring(axis, causal, q, k, v, qside, kside)


def all_to_all_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str,
    *,
    causal: bool = False,
    layout: Layout | None = None,
    segment_ids: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    kernel: Callable[..., jax.Array] | None = None,
) -> jax.Array:
    """Softmax attention over a sequence split along ``axis``, by swapping the split to the heads (DeepSpeed Ulysses).

    One ``all_to_all`` gives each device ``h / n`` heads of the whole sequence (``[b, T, h / n, d]``, ``k`` and
    ``v`` ``r h_kv / n``), the positions, segments and padding are all-gathered, attention runs on whole sequences,
    and a second ``all_to_all`` brings every token's output home. Each device sends ``(n - 1) / n`` of its ``q``,
    ``k``, ``v`` and output blocks. Grouped-query attention whose ``h_kv`` KV heads ``n`` does not divide (8 query
    heads, 2 KV heads, ``n = 4``), as Ulysses implementations do: each KV head is repeated ``r = n / gcd(h_kv, n)``
    times before the swap (2 here: 4 KV heads, one per device), the fewest copies whose count ``n`` divides; query
    head ``j`` still reads a copy of KV head ``j // (h / h_kv)``, and the copies' gradients sum into it. The
    repeat costs ``r`` times the bytes of ``k`` and ``v`` in the swap. Derivative: that of the repeat, the
    all-to-alls and the kernel.

    Args:
      q: ``[b, t, h, d]``, this device's queries (``t = T / n`` tokens of every sequence); ``n`` divides ``h``.
      k: ``[b, t, h_kv, d]``, this device's keys; ``h_kv`` divides ``h`` (query head ``j`` reads KV head ``j // (h
        / h_kv)``); repeated ``n / gcd(h_kv, n)`` times where ``n`` does not divide ``h_kv``.
      v: the values, shaped like ``k``.
      axis: the mesh axis the sequence is split over (any name), bound by the enclosing ``spmd`` or
        ``jax.shard_map``.
      causal: a query sees only keys at or before its global position.
      layout: ``"contiguous"``, ``"zigzag"`` or None (default: the traced step's, else ``"contiguous"``), as for
        :func:`ring_attention`.
      segment_ids: int ``[t]`` or ``[b, t]``, each local token's segment (packed sequences). None: one sequence.
      kv_mask: bool or int ``[t]`` or ``[b, t]``: True or nonzero for a key that is attended to, False or 0 for
        padding, as for :func:`ring_attention`. None: all valid.
      kernel: None, float32 softmax attention in ``jax.numpy``; or a function called as ``kernel(q, k, v,
        mask=mask)`` with ``q`` ``[b, T, h / n, d]``, ``k`` and ``v`` ``[b, T, r h_kv / n, d]`` (``r`` the repeat
        above, 1 when ``n`` divides ``h_kv``) and a bool ``mask`` ``[b or 1, 1, T, T]`` (True: visible), returning
        ``[b, T, h / n, d]``, e.g. ``jax.nn.dot_product_attention``. Rows with no visible key are set to zero after
        it.

    Returns:
      ``[b, t, h, d]`` in ``q``'s dtype: this device's block of the attention over the whole sequence.

    Raises:
      AxisError: if ``axis`` is not bound here.
      ShapeError: for shapes that do not fit together, or query heads that ``n`` does not divide.
      SpmdError: for an unknown ``layout``, a ``layout`` other than the traced step's for its context axis, a
        ``causal`` that is not a bool, or a ``kernel`` that is not callable.

    Examples:
      >>> mesh = sc.make_mesh({"seq": 2}, devices=jax.devices()[:2])
      >>> attend = sc.spmd(lambda q, k, v: sc.all_to_all_attention(q, k, v, "seq", causal=True), mesh=mesh,
      ...                  in_specs=sc.P(None, "seq"), out_specs=sc.P(None, "seq"))
      >>> x = jnp.ones((1, 8, 2, 4))
      >>> attend(x, x, x).shape
      (1, 8, 2, 4)
    """
    fn = "all_to_all_attention"
    if kernel is not None and not callable(kernel):
        raise SpmdError(
            describe(
                fn, f"kernel={kernel!r} is not callable.", fix="None or a function like jax.nn.dot_product_attention."
            )
        )
    qside, kside = _sides(fn, q, k, v, axis, causal, layout, segment_ids, kv_mask)
    n = lax.axis_size(axis)
    h, h_kv = q.shape[2], k.shape[2]
    if h % n:
        raise ShapeError(
            describe(
                fn,
                f"q has {h} heads, which do not split over axis {axis!r} of size {n} (q {h} heads, k/v {h_kv} KV "
                f"heads): the all-to-all gives each device {h} / {n} query heads. KV heads are repeated until they "
                "split; query heads cannot be.",
                fix=f"use a number of query heads divisible by {n}, an axis whose size divides {h}, or "
                "ring_attention (any head count).",
            )
        )
    # KV heads that do not split: each repeated r times in place (heads m r .. m r + r - 1 are copies of head m), the
    # fewest copies whose count n divides. Query head j then reads copy j // (h / (r h_kv)), a copy of KV head
    # j // (h / h_kv), since r divides h / h_kv whenever n divides h. Autodiff sums the copies' gradients.
    repeat = n // math.gcd(h_kv, n)
    if repeat > 1:
        k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
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


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
) -> jax.Array:
    """Attention of whole sequences on one device, with the masks of :func:`ring_attention` (positions ``0 .. T-1``).

    What both split kernels equal; ``sc.context_attention`` outside a context-parallel step.

    Args:
      q: ``[b, T, h, d]``.
      k: ``[b, T, h_kv, d]`` (``h_kv`` divides ``h``; query head ``j`` reads KV head ``j // (h / h_kv)``).
      v: the values, shaped like ``k``.
      causal: a query sees only keys at or before its position.
      segment_ids: int ``[T]`` or ``[b, T]`` of packed sequences, or None.
      kv_mask: bool or int ``[T]`` or ``[b, T]``, False or 0 for padding keys (nonzero attends); None: all valid.

    Returns:
      ``[b, T, h, d]`` in ``q``'s dtype; zeros for a query that sees no key.

    Raises:
      ShapeError: for shapes that do not fit together.
      SpmdError: for a ``causal`` that is not a bool.

    Examples:
      >>> from spmdcomm.collectives import attention
      >>> x = jnp.ones((1, 4, 2, 8))
      >>> jax.jit(attention.attention_reference, static_argnames="causal")(x, x, x, causal=True).shape
      (1, 4, 2, 8)
    """
    fn = "attention_reference"
    _check_causal(fn, causal)
    qside, kside = sides(fn, q, k, v, lambda t: jnp.arange(t, dtype=jnp.int32), segment_ids, kv_mask)
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
      An int64 permutation of ``range(T)``; ``np.argsort`` of it undoes it.

    Raises:
      ShapeError: when ``2 c`` does not divide ``T``.

    Examples:
      >>> sc.zigzag_order(8, 2).tolist()   # device 0: chunks 0 and 3; device 1: chunks 1 and 2
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


def sequence_positions(length: int, axis: str, *, layout: Layout | None = None) -> jax.Array:
    """The global positions of the ``length`` tokens this device holds of a sequence split along ``axis``.

    For rotary or learned positions, in the layout given to :func:`ring_attention` (the positions its masks use).

    Args:
      length: the tokens per device, ``t = T / n``.
      axis: the mesh axis the sequence is split over, bound by the enclosing ``spmd`` or ``jax.shard_map``.
      layout: ``"contiguous"`` (device ``i`` holds ``[i t, (i + 1) t)``) or ``"zigzag"`` (chunks ``i`` and
        ``2n - 1 - i`` of ``2n``, as after :func:`zigzag_order`; ``length`` even). None (default): the traced
        train step's layout when its ``sc.ContextParallel`` splits ``axis`` (the only one accepted there), else
        ``"contiguous"``.

    Returns:
      int32 ``[length]``.

    Raises:
      AxisError: if ``axis`` is not bound here.
      SpmdError: for another layout, one other than the traced step's for its context axis, or an odd ``length``
        with ``"zigzag"`` (a :class:`ShapeError`).

    Examples:
      >>> f = sc.spmd(lambda: sc.sequence_positions(4, "data", layout="zigzag"),
      ...             mesh=sc.data_mesh(devices=jax.devices()[:2]), in_specs=(), out_specs=sc.P("data"))
      >>> f().tolist()
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    fn = "sequence_positions"
    return positions(fn, length, axis, resolve(fn, axis, layout))


def _check_causal(fn: str, causal: object) -> None:
    if not isinstance(causal, (bool, np.bool_)):
        raise SpmdError(
            describe(fn, f"causal={causal!r} is not a bool: the mask is fixed when tracing.", fix="True or False.")
        )


def _sides(
    fn: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str,
    causal: object,
    layout: str | None,
    segment_ids: object,
    kv_mask: object,
) -> tuple:
    """Checks every argument of a split kernel; the query and key sides of its mask."""
    if not isinstance(axis, str):
        raise SpmdError(describe(fn, f"axis={axis!r} is not a mesh axis name.", fix='pass one axis name, e.g. "seq".'))
    _check_causal(fn, causal)
    layout = resolve(fn, axis, layout)
    return sides(fn, q, k, v, lambda t: positions(fn, t, axis, layout), segment_ids, kv_mask)
