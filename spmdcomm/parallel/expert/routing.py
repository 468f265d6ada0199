"""A mixture of experts as pure functions: the router, where each assignment goes in the global order (the capacity
rule), the losses and counts over the global batch, and the dispatch, expert compute and combine (:func:`moe`).

Every function that needs the whole batch takes ``token_axes``, the mesh axes that split the tokens (empty on one
device), and reduces over them with collectives, so its result is the one device's answer on the global batch. The
global batch is the devices' tokens in row-major device order over ``token_axes``, each device's in its own order;
when a context axis splits every sequence (``sequence=``), it is one device's order on the unsplit batch instead:
rows, then each row's positions in the original sequence order.

How :func:`moe` moves the tokens, per device of an expert axis of size ``n`` holding ``E / n`` experts and ``T``
tokens: the ``T * k`` assignments are sorted by destination device and sent with one
:func:`~spmdcomm.ragged_all_to_all` (with their local expert), run through the local experts, each on the rows it
received only (:mod:`~spmdcomm.parallel.expert.grouped`), and sent back with a second one. Given a buffer function
instead of :class:`Experts`, the received rows are written into a static buffer ``[E / n, B, d]`` (``B`` the capacity,
or ``n * T`` dropless: every expert computes as many rows as the expert axis holds tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm.collectives.ragged import RaggedImplementation, ragged_all_to_all
from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.parallel.expert.capacity import (
    SequenceSplit,
    Slots,
    assignment_slots,
    axes_size,
    capacity_of,
    expert_capacity,
    psum_over,
)
from spmdcomm.parallel.expert.grouped import grouped_apply, tile_rows

__all__ = [
    "ROUTINGS",
    "MoEStats",
    "Experts",
    "moe",
    "Routing",
    "Slots",
    "SequenceSplit",
    "route",
    "expert_capacity",
    "assignment_slots",
    "load_balancing_loss",
    "router_z_loss",
    "check_routing",
]

RoutingName = Literal["softmax_topk", "topk_softmax"]
# softmax_topk: softmax over the E experts, then the k largest probabilities are the weights (Switch, GShard k=1,
# DeepSeek); topk_softmax: the k largest logits, then a softmax over those k (Mixtral).
ROUTINGS: tuple[str, ...] = ("softmax_topk", "topk_softmax")


class Routing(NamedTuple):
    """Where each token goes: ``experts`` and ``weights`` ``[T, k]`` (choice ``r`` is the ``r``-th largest), the
    probabilities ``[T, E]`` of the softmax over every expert, and the float32 ``logits`` ``[T, E]``."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


class Experts(NamedTuple):
    """The local experts as parameters and a function, for :func:`moe` to run each on the rows it received only
    (:func:`~spmdcomm.parallel.expert.grouped.grouped_apply`): every leaf of ``params`` is ``[E / n, ...]``, and
    ``apply(one_expert_params, rows [b, d]) -> [b, d_out]`` runs one expert row by row."""

    params: Any
    apply: Callable[[Any, jax.Array], jax.Array]


class MoEStats(NamedTuple):
    """What a MoE layer reports, each over the global batch and the same on every device: the Switch/GShard
    ``load_balancing_loss``, the ``router_z_loss``, ``expert_counts`` ``[E]`` (assignments per expert before any
    drop) and the ``dropped_fraction`` of the ``N * k`` assignments (0 in the dropless layer)."""

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    expert_counts: jax.Array
    dropped_fraction: jax.Array


def route(logits: jax.Array, k: int, *, routing: RoutingName = "softmax_topk") -> Routing:
    """The top ``k`` experts of each token and their weights, from router ``logits`` ``[T, E]`` (float32 math).

    Args:
      logits: ``[T, E]``, one row per token.
      k: experts per token.
      routing: ``"softmax_topk"`` (weights: the softmax probabilities of the chosen experts, not renormalised) or
        ``"topk_softmax"`` (weights: a softmax over the chosen experts' logits, summing to 1).

    Returns:
      The :class:`Routing`; ties go to the lower expert index (``jax.lax.top_k``).

    Examples:
      >>> r = route(jnp.array([[0.0, 2.0, 1.0]]), 2, routing="topk_softmax")
      >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0].tolist()]
      ([[1, 2]], [0.731, 0.269])
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if routing == "softmax_topk":
        weights, experts = lax.top_k(probs, k)
    else:
        top, experts = lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    return Routing(experts.astype(jnp.int32), weights, probs, logits)


def load_balancing_loss(
    probs: jax.Array,
    counts: jax.Array,
    k: int,
    *,
    token_axes: tuple[str, ...] = (),
    valid: jax.Array | None = None,
) -> jax.Array:
    """The Switch/GShard auxiliary loss over the global batch: ``E * sum_j f_j * P_j``.

    ``f_j`` is the fraction of the global batch's ``N * k`` assignments that chose expert ``j`` (before any drop),
    ``P_j`` the mean over the ``N`` tokens of the router probability of ``j``; a uniform router gives 1. The same
    value on every device, equal to one device's on the global batch (not a mean of per-device losses). With
    ``valid``, ``N`` counts the real tokens only and the others add nothing (0 when there is none).

    Args:
      probs: ``[T, E]`` softmax probabilities of this device's tokens.
      counts: ``[E]`` assignments per expert over the global batch (:func:`assignment_slots`, with the same
        ``valid``).
      k: experts per token.
      token_axes: the axes that split the tokens.
      valid: ``[T]``, the real tokens (``None``: all of them).

    Returns:
      A float32 scalar.
    """
    probs = probs if valid is None else jnp.where(valid[:, None], probs, 0.0)
    # Every real token made k of the assignments counted: the global count follows, with no collective of its own.
    tokens = probs.shape[0] * axes_size(token_axes) if valid is None else jnp.sum(counts) // k
    mean_probs = psum_over(probs.sum(0), token_axes) / jnp.maximum(tokens, 1)
    fraction = counts.astype(jnp.float32) / jnp.maximum(tokens * k, 1)
    return probs.shape[1] * jnp.sum(fraction * mean_probs)


def router_z_loss(logits: jax.Array, *, token_axes: tuple[str, ...] = (), valid: jax.Array | None = None) -> jax.Array:
    """The router z-loss (ST-MoE) over the global batch: the mean over tokens of ``logsumexp(logits) ** 2``.

    Args:
      logits: ``[T, E]`` router logits of this device's tokens.
      token_axes: the axes that split the tokens.
      valid: ``[T]``, the real tokens, the only ones the mean is over (``None``: all of them; 0 without any).

    Returns:
      A float32 scalar, the same on every device.
    """
    z2 = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
    if valid is None:
        return psum_over(jnp.sum(z2), token_axes) / (z2.shape[0] * axes_size(token_axes))
    # The sum and the real tokens' count in one all-reduce.
    total, real = jnp.sum(jnp.where(valid, z2, 0.0)), jnp.sum(valid, dtype=jnp.float32)
    total, real = lax.psum((total, real), token_axes) if token_axes else (total, real)
    return total / jnp.maximum(real, 1.0)


def check_routing(fn: str, *, experts: int, k: int, routing: str, capacity_factor: float | None) -> None:
    """Raises :class:`SpmdError` for ``k`` outside ``[1, experts]``, an unknown routing or a capacity factor that is
    not positive: before anything traces."""
    if not isinstance(experts, int) or experts < 1:
        raise SpmdError(describe(fn, f"experts={experts!r} is not a positive integer.", fix="pass E >= 1."))
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise SpmdError(
            describe(
                fn,
                f"k={k!r} experts per token with experts={experts}: k must be in [1, {experts}].",
                fix=f"pass k <= {experts} (k=1 for Switch, k=2 for GShard/Mixtral), or more experts.",
            )
        )
    if routing not in ROUTINGS:
        raise SpmdError(
            describe(fn, f"routing={routing!r} is not one of {ROUTINGS}.", fix="pick one of those routings.")
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise SpmdError(
            describe(
                fn,
                f"capacity_factor={capacity_factor!r} is not positive.",
                fix="pass a capacity factor > 0 (1.0 to 2.0 is usual), or None for the dropless layer.",
            )
        )


def moe(
    x: jax.Array,
    logits: jax.Array,
    apply_experts: Experts | Callable[[jax.Array], jax.Array],
    *,
    experts: int,
    k: int,
    routing: RoutingName = "softmax_topk",
    capacity_factor: float | None = None,
    axis_name: str | None = None,
    token_axes: tuple[str, ...] | None = None,
    implementation: RaggedImplementation = "auto",
    mask: jax.Array | None = None,
    sequence: SequenceSplit | None = None,
) -> tuple[jax.Array, MoEStats]:
    """``sum_r weight[t, r] * expert_{e[t, r]}(x[t])`` for this device's tokens, the experts split over ``axis_name``.

    On one device (``axis_name=None``) every expert is local. Inside ``spmd``/``jax.shard_map`` over an expert axis
    of size ``n``, each device holds experts ``[i * E / n, (i + 1) * E / n)`` and its own tokens, and the result
    equals one device running the layer on the global batch (the devices' tokens in order), forward and gradients.
    With a ``capacity_factor``, each expert takes at most :func:`~spmdcomm.parallel.expert.routing.expert_capacity`
    assignments of the global batch, first choices before second ones, then in token order; a dropped assignment
    adds nothing, so a token that loses all its experts gives zeros (the caller's residual passes it on).
    With ``mask``, only the real tokens are routed: the others give zeros, take no capacity slot and count in no
    loss or statistic, and the capacity is the one of the global batch's real tokens; the result is one device's on
    the real tokens alone. With ``sequence`` (every sequence split over a context axis, one of the token axes), the
    token order of the capacity rule is one device's on the unsplit batch: rows, then each row's positions in the
    original sequence order, whatever the layout (:func:`~spmdcomm.parallel.expert.routing.assignment_slots`).

    Args:
      x: ``[T, d]`` tokens of this device.
      logits: ``[T, E]`` router logits of those tokens.
      apply_experts: the local :class:`Experts`, each run on the rows it received only (grouped: the work of the
        routed rows), or a function mapping a buffer ``[E / n, B, d]`` to ``[E / n, B, d_out]``, local expert ``l``
        on row block ``l``, each row on its own (rows that hold no token are discarded): every expert runs on ``B``
        rows, whatever the routing.
      experts: ``E``, over all devices.
      k: experts per token.
      routing: ``"softmax_topk"`` or ``"topk_softmax"`` (:func:`~spmdcomm.parallel.expert.routing.route`).
      capacity_factor: ``None`` (dropless, default) or the factor of the capacity rule.
      axis_name: the mesh axis the experts are split over, or ``None``.
      token_axes: every axis that splits the tokens, in the global batch's order (default: ``axis_name`` alone);
        the losses, counts and the capacity rule are over all of them.
      implementation: of the two all-to-alls (:func:`~spmdcomm.ragged_all_to_all`).
      mask: ``[T]``, which tokens are real (bool, or 0/1 numbers), or ``None``: every token is.
      sequence: how the ``T`` tokens lie in sequences split over a context axis
        (:class:`~spmdcomm.parallel.expert.capacity.SequenceSplit`: ``rows x length x inner``), or ``None``; read
        by the capacity rule only (the dropless layer needs no order).

    Returns:
      ``(y [T, d_out], stats)``: the combined expert outputs in float32 math, cast to ``x``'s dtype, and the
      :class:`MoEStats`.

    Raises:
      SpmdError: for ``k`` outside ``[1, E]``, an unknown routing, a capacity factor that is not positive,
        ``token_axes`` without ``axis_name``, or a ``sequence`` axis that is not a token axis.
      ShapeError: when ``E`` does not divide by the size of ``axis_name``, ``mask`` is not ``[T]``, or the tokens do
        not fit ``sequence``.
    """
    check_routing("moe", experts=experts, k=k, routing=routing, capacity_factor=capacity_factor)
    axes = _token_axes(axis_name, token_axes)
    n = lax.axis_size(axis_name) if axis_name is not None else 1
    if experts % n:
        raise ShapeError(
            describe(
                "moe",
                f"experts={experts} do not divide by the {n} devices of expert axis {axis_name!r}.",
                fix=f"use a multiple of {n} experts, or an expert axis whose size divides {experts}.",
            )
        )
    local = experts // n
    x, tokens = jnp.asarray(x), x.shape[0]
    valid = None if mask is None else _token_mask(mask, tokens)
    placed = None if capacity_factor is None else _check_sequence(sequence, axes, tokens)
    r = route(logits, k, routing=routing)
    slots = assignment_slots(r.experts, experts, token_axes=axes, axis_name=axis_name, valid=valid, sequence=placed)
    group_tokens = n * tokens
    real = jnp.ones((tokens, 1), bool) if valid is None else valid[:, None]
    # The global batch's real tokens: k assignments each in the global counts (static without a mask).
    real_tokens = tokens * axes_size(axes) if valid is None else jnp.sum(slots.counts) // k
    if capacity_factor is None:
        kept = jnp.broadcast_to(real, r.experts.shape)
        buffer = group_tokens
    else:
        capacity = expert_capacity(tokens * axes_size(axes), experts, k, capacity_factor)
        if valid is not None:
            # The capacity of the real tokens (at most the static one, which sizes the buffer).
            real_capacity = capacity_of(jnp.asarray(real_tokens), experts, k, capacity_factor)
            kept = real & (slots.global_slot < real_capacity)
        else:
            kept = slots.global_slot < capacity
        buffer = min(capacity, group_tokens)  # a kept assignment's group slot is at most its global slot
    # Sorted by destination device; dropped assignments last, never sent.
    dest = jnp.where(kept, r.experts // local, n).reshape(-1)
    order = jnp.argsort(dest, stable=True)
    send_sizes = jnp.sum(jax.nn.one_hot(dest, n + 1, dtype=jnp.int32)[:, :n], axis=0)
    rows = x[order // k]
    grouped = isinstance(apply_experts, Experts)
    # Each assignment's local expert, and (for the buffer) its slot there.
    columns = [(r.experts % local).reshape(-1)] + ([] if grouped else [slots.group_slot.reshape(-1)])
    where = jnp.stack(columns, axis=-1)[order]
    bound = min(n * tokens * k, local * buffer)
    if axis_name is None:
        (got, got_where), recv_sizes = (rows, where), send_sizes
    else:
        (got, got_where), recv_sizes = ragged_all_to_all(
            (rows, where), send_sizes, axis_name, out_rows=bound, implementation=implementation
        )
    received = jnp.arange(got.shape[0]) < jnp.sum(recv_sizes)
    if isinstance(apply_experts, Experts):
        # Tiles sized for the rows a device receives on average (T k), not for the bound (n T k, any routing).
        tile = tile_rows(tokens * k, local)
        # (Tiles of one row: XLA turns their matmuls into elementwise products, which explain cannot count as
        # matmuls; the scope says so.)
        with jax.named_scope("grouped_experts" if tile > 1 else "grouped_experts_one_row"):
            back = grouped_apply(apply_experts.apply, apply_experts.params, got, got_where[:, 0], received, tile=tile)
    else:
        # The buffer and its read-out in the scope too, as grouped_apply's sorting: every op next to an expert's
        # matmuls is in it (sc.explain's expert section checks that no matmul without metadata sits next to them).
        with jax.named_scope("buffered_experts"):
            expert_of, slot_of = jnp.where(received, got_where[:, 0], local), got_where[:, 1]  # row `local`: dropped
            held = jnp.zeros((local, buffer) + x.shape[1:], x.dtype).at[expert_of, slot_of].set(got, mode="drop")
            done = apply_experts(held)
            back = jnp.where(received[:, None], done.at[expert_of, slot_of].get(mode="fill", fill_value=0), 0)
    if axis_name is not None:
        back, _ = ragged_all_to_all(back, recv_sizes, axis_name, out_rows=tokens * k, implementation=implementation)
    per_assignment = back[jnp.argsort(order)].reshape(tokens, k, -1)
    gate = jnp.where(kept, r.weights, 0.0)
    y = jnp.einsum("tk,tkd->td", gate, per_assignment.astype(jnp.float32)).astype(x.dtype)
    dropped = psum_over(jnp.sum(real & ~kept), axes) / jnp.maximum(real_tokens * k, 1)
    stats = MoEStats(
        load_balancing_loss(r.probs, slots.counts, k, token_axes=axes, valid=valid),
        router_z_loss(r.logits, token_axes=axes, valid=valid),
        slots.counts,
        dropped.astype(jnp.float32),
    )
    return y, stats


def _check_sequence(sequence: SequenceSplit | None, axes: tuple[str, ...], tokens: int) -> SequenceSplit | None:
    """``sequence``, checked against the token axes and the ``tokens`` this device holds."""
    if sequence is None:
        return None
    if sequence.axis not in axes:
        raise SpmdError(
            describe(
                "moe",
                f"sequence splits every sequence over {sequence.axis!r}, which is not one of the token axes {axes}.",
                fix=f"list {sequence.axis!r} in token_axes (every axis that splits the tokens).",
            )
        )
    rows, length, chunks = sequence.rows, sequence.length, sequence.chunks()
    if rows < 1 or length < 1 or tokens % (rows * length) or length % chunks:
        raise ShapeError(
            describe(
                "moe",
                f"{tokens} tokens do not lie as {rows} rows of {length} positions each ({sequence.layout} layout over "
                f"{sequence.axis!r}: {chunks} whole chunk(s) of every sequence per device).",
                fix="give the layer its input as [rows, tokens, ..., d], the tokens of every sequence on dimension 1 "
                "as the step split them.",
            )
        )
    return sequence


def _token_mask(mask: jax.Array, tokens: int) -> jax.Array:
    """``mask`` as a ``[tokens]`` bool array (nonzero: real), or :class:`ShapeError`."""
    mask = jnp.asarray(mask)
    if mask.shape != (tokens,):
        raise ShapeError(
            describe(
                "moe",
                f"mask has shape {mask.shape}, but x holds {tokens} tokens.",
                fix=f"pass one entry per token: a [{tokens}] mask, True (or 1) where the token is real.",
            )
        )
    return mask if mask.dtype == jnp.bool_ else mask != 0


def _token_axes(axis_name: str | None, token_axes: tuple[str, ...] | None) -> tuple[str, ...]:
    if token_axes is None:
        return () if axis_name is None else (axis_name,)
    axes = tuple(token_axes)
    if axis_name is not None and axis_name not in axes:
        raise SpmdError(
            describe(
                "moe",
                f"token_axes={axes} leaves out the expert axis {axis_name!r}: its devices hold different tokens.",
                fix=f"list every axis that splits the tokens, {axis_name!r} included, in the global batch's order.",
            )
        )
    return axes
