"""The router of a mixture-of-experts layer, as pure functions: top-k routing, where each assignment goes in the global
order (the capacity rule), and the losses and counts over the global batch.

Every function that needs the whole batch takes ``token_axes``, the mesh axes that split the tokens (empty on one
device), and reduces over them with collectives, so its result is the one device's answer on the global batch. The
global batch is the devices' tokens in row-major device order over ``token_axes``, each device's in its own order.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm.collectives.exchanges import all_gather
from spmdcomm.errors import SpmdError, describe

__all__ = [
    "ROUTINGS",
    "Routing",
    "Slots",
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


class Slots(NamedTuple):
    """Each assignment's place: ``global_slot`` ``[T, k]`` among the global batch's assignments to its expert,
    ``group_slot`` among those of the devices of the expert axis that share this device's other coordinates, and
    ``counts`` ``[E]``, the global batch's assignments to each expert (before any drop)."""

    global_slot: jax.Array
    group_slot: jax.Array
    counts: jax.Array


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


def expert_capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """The GShard/Switch capacity: ``ceil(capacity_factor * tokens * k / experts)`` assignments per expert, at
    least 1 and at most ``tokens`` (a token chooses an expert once), for ``tokens`` in the global batch.

    Examples:
      >>> expert_capacity(64, 8, 2, 1.25)
      20
    """
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / experts)))


def assignment_slots(
    experts: jax.Array, num_experts: int, *, token_axes: tuple[str, ...] = (), axis_name: str | None = None
) -> Slots:
    """Each assignment's slot at its expert, in the drop order of the capacity rule.

    The order (GShard's): every token's first choice before any second choice, and within a choice the global
    batch's token order. With a capacity ``C``, an assignment is kept when its ``global_slot`` is below ``C``: one
    device applying the rule to the global batch drops the same ones. Costs two all-gathers of ``k * E`` integers.

    Args:
      experts: ``[T, k]`` expert ids of this device's tokens.
      num_experts: ``E``.
      token_axes: the axes that split the tokens, in the global batch's order (empty on one device).
      axis_name: the expert axis (one of ``token_axes``), or ``None``: the group is then this device.

    Returns:
      The :class:`Slots`.
    """
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [T, k, E]
    local = onehot.sum(0)  # [k, E]
    earlier_tokens = ((jnp.cumsum(onehot, axis=0) - onehot) * onehot).sum(-1)  # [T, k]
    global_before, counts = _earlier(local, token_axes)
    group_before, _ = _earlier(local, (axis_name,) if axis_name is not None else ())
    return Slots(_pick(global_before, experts) + earlier_tokens, _pick(group_before, experts) + earlier_tokens, counts)


def load_balancing_loss(probs: jax.Array, counts: jax.Array, k: int, *, token_axes: tuple[str, ...] = ()) -> jax.Array:
    """The Switch/GShard auxiliary loss over the global batch: ``E * sum_j f_j * P_j``.

    ``f_j`` is the fraction of the global batch's ``N * k`` assignments that chose expert ``j`` (before any drop),
    ``P_j`` the mean over the ``N`` tokens of the router probability of ``j``; a uniform router gives 1. The same
    value on every device, equal to one device's on the global batch (not a mean of per-device losses).

    Args:
      probs: ``[T, E]`` softmax probabilities of this device's tokens.
      counts: ``[E]`` assignments per expert over the global batch (:func:`assignment_slots`).
      k: experts per token.
      token_axes: the axes that split the tokens.

    Returns:
      A float32 scalar.
    """
    tokens = probs.shape[0] * _size(token_axes)
    mean_probs = _psum(probs.sum(0), token_axes) / tokens
    fraction = counts.astype(jnp.float32) / (tokens * k)
    return probs.shape[1] * jnp.sum(fraction * mean_probs)


def router_z_loss(logits: jax.Array, *, token_axes: tuple[str, ...] = ()) -> jax.Array:
    """The router z-loss (ST-MoE) over the global batch: the mean over tokens of ``logsumexp(logits) ** 2``.

    Args:
      logits: ``[T, E]`` router logits of this device's tokens.
      token_axes: the axes that split the tokens.

    Returns:
      A float32 scalar, the same on every device.
    """
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return _psum(jnp.sum(z**2), token_axes) / (z.shape[0] * _size(token_axes))


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


def _earlier(local: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """``(before [k, E], totals [E])``: the assignments that precede this device's choice-``r`` assignments to each
    expert (every earlier choice of every device, then choice ``r`` of the earlier devices), and each expert's
    total over ``axes``."""
    every = all_gather(local, axes, tiled=False) if axes else local[None]  # [devices, k, E], identical everywhere
    me = lax.axis_index(axes) if axes else 0
    per_choice = every.sum(0)
    earlier_choices = jnp.cumsum(per_choice, axis=0) - per_choice
    earlier_devices = (jnp.cumsum(every, axis=0) - every)[me]
    return earlier_choices + earlier_devices, per_choice.sum(0)


def _pick(before: jax.Array, experts: jax.Array) -> jax.Array:
    """``before[r, experts[t, r]]`` for every ``(t, r)``."""
    return before[jnp.arange(experts.shape[1])[None, :], experts]


def _size(axes: tuple[str, ...]) -> int:
    return math.prod(lax.axis_size(a) for a in axes)


def _psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return lax.psum(x, axes) if axes else x
