"""The mixture-of-experts layer: dispatch to the devices that hold each expert, each device running its local experts
on the tokens it received, and the weighted combine (:func:`moe`), and its Flax Linen module (:class:`MoE`).

How the tokens move, per device of an expert axis of size ``n`` holding ``E / n`` experts and ``T`` tokens: the
``T * k`` assignments are sorted by destination device and sent with one :func:`~spmdcomm.ragged_all_to_all` (with
their expert and slot), written into a buffer ``[E / n, B, d]``, run through the local experts, and sent back with a
second one. ``B`` is the capacity with a ``capacity_factor``, and ``n * T`` (every token of the expert axis) in the
dropless layer: a static shape that holds any routing, at the cost of computing ``E * T`` rows per device, as if
every expert saw every token; a grouped matmul over only the received rows is a follow-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from jax import lax

from spmdcomm.collectives.ragged import RaggedImplementation, ragged_all_to_all
from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.parallel.expert.routing import (
    RoutingName,
    _psum,
    _size,
    assignment_slots,
    check_routing,
    expert_capacity,
    load_balancing_loss,
    route,
    router_z_loss,
)

__all__ = ["MoE", "MoEStats", "moe", "MOE_COLLECTION"]

MOE_COLLECTION = "moe"  # the Flax collection MoE layers sow their losses and metrics into


class MoEStats(NamedTuple):
    """What a MoE layer reports, each over the global batch and the same on every device: the Switch/GShard
    ``load_balancing_loss``, the ``router_z_loss``, ``expert_counts`` ``[E]`` (assignments per expert before any
    drop) and the ``dropped_fraction`` of the ``N * k`` assignments (0 in the dropless layer)."""

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    expert_counts: jax.Array
    dropped_fraction: jax.Array


def moe(
    x: jax.Array,
    logits: jax.Array,
    apply_experts: Callable[[jax.Array], jax.Array],
    *,
    experts: int,
    k: int,
    routing: RoutingName = "softmax_topk",
    capacity_factor: float | None = None,
    axis_name: str | None = None,
    token_axes: tuple[str, ...] | None = None,
    implementation: RaggedImplementation = "auto",
) -> tuple[jax.Array, MoEStats]:
    """``sum_r weight[t, r] * expert_{e[t, r]}(x[t])`` for this device's tokens, the experts split over ``axis_name``.

    On one device (``axis_name=None``) every expert is local. Inside ``spmd``/``jax.shard_map`` over an expert axis
    of size ``n``, each device holds experts ``[i * E / n, (i + 1) * E / n)`` and its own tokens, and the result
    equals one device running the layer on the global batch (the devices' tokens in order), forward and gradients.
    With a ``capacity_factor``, each expert takes at most :func:`~spmdcomm.parallel.expert.routing.expert_capacity`
    assignments of the global batch, first choices before second ones, then in token order; a dropped assignment
    adds nothing, so a token that loses all its experts gives zeros (the caller's residual passes it on).

    Args:
      x: ``[T, d]`` tokens of this device.
      logits: ``[T, E]`` router logits of those tokens.
      apply_experts: maps a buffer ``[E / n, B, d]`` to ``[E / n, B, d_out]``, local expert ``l`` on row block
        ``l``, each row on its own (rows that hold no token are discarded).
      experts: ``E``, over all devices.
      k: experts per token.
      routing: ``"softmax_topk"`` or ``"topk_softmax"`` (:func:`~spmdcomm.parallel.expert.routing.route`).
      capacity_factor: ``None`` (dropless, default) or the factor of the capacity rule.
      axis_name: the mesh axis the experts are split over, or ``None``.
      token_axes: every axis that splits the tokens, in the global batch's order (default: ``axis_name`` alone);
        the losses, counts and the capacity rule are over all of them.
      implementation: of the two all-to-alls (:func:`~spmdcomm.ragged_all_to_all`).

    Returns:
      ``(y [T, d_out], stats)``: the combined expert outputs in float32 math, cast to ``x``'s dtype, and the
      :class:`MoEStats`.

    Raises:
      SpmdError: for ``k`` outside ``[1, E]``, an unknown routing, a capacity factor that is not positive, or
        ``token_axes`` without ``axis_name``.
      ShapeError: when ``E`` does not divide by the size of ``axis_name``.
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
    r = route(logits, k, routing=routing)
    slots = assignment_slots(r.experts, experts, token_axes=axes, axis_name=axis_name)
    group_tokens = n * tokens
    if capacity_factor is None:
        kept = jnp.ones_like(r.experts, dtype=bool)
        buffer = group_tokens
    else:
        capacity = expert_capacity(tokens * _size(axes), experts, k, capacity_factor)
        kept = slots.global_slot < capacity
        buffer = min(capacity, group_tokens)  # a kept assignment's group slot is at most its global slot
    # Sorted by destination device; dropped assignments last, never sent.
    dest = jnp.where(kept, r.experts // local, n).reshape(-1)
    order = jnp.argsort(dest, stable=True)
    send_sizes = jnp.sum(jax.nn.one_hot(dest, n + 1, dtype=jnp.int32)[:, :n], axis=0)
    rows = x[order // k]
    where = jnp.stack([(r.experts % local).reshape(-1), slots.group_slot.reshape(-1)], axis=-1)[order]
    bound = min(n * tokens * k, local * buffer)
    if axis_name is None:
        (got, got_where), recv_sizes = (rows, where), send_sizes
    else:
        (got, got_where), recv_sizes = ragged_all_to_all(
            (rows, where), send_sizes, axis_name, out_rows=bound, implementation=implementation
        )
    valid = jnp.arange(got.shape[0]) < jnp.sum(recv_sizes)
    expert_of, slot_of = jnp.where(valid, got_where[:, 0], local), got_where[:, 1]  # row `local`: out of range
    held = jnp.zeros((local, buffer) + x.shape[1:], x.dtype).at[expert_of, slot_of].set(got, mode="drop")
    done = apply_experts(held)
    back = jnp.where(valid[:, None], done.at[expert_of, slot_of].get(mode="fill", fill_value=0), 0)
    if axis_name is not None:
        back, _ = ragged_all_to_all(back, recv_sizes, axis_name, out_rows=tokens * k, implementation=implementation)
    per_assignment = back[jnp.argsort(order)].reshape(tokens, k, -1)
    gate = jnp.where(kept, r.weights, 0.0)
    y = jnp.einsum("tk,tkd->td", gate, per_assignment.astype(jnp.float32)).astype(x.dtype)
    dropped = _psum(jnp.sum(~kept), axes) / (tokens * _size(axes) * k)
    stats = MoEStats(
        load_balancing_loss(r.probs, slots.counts, k, token_axes=axes),
        router_z_loss(r.logits, token_axes=axes),
        slots.counts,
        dropped.astype(jnp.float32),
    )
    return y, stats


class MoE(nn.Module):
    """A mixture-of-experts layer: a router choosing ``k`` of ``experts`` copies of ``expert`` for each token.

    ``y[t] = sum_r w[t, r] * expert_{e[t, r]}(x[t])`` over the last dimension of ``x`` (the tokens are every other
    position). The router is a ``[d, E]`` kernel (parameter ``"router"``, float32 math); the experts' parameters are
    stacked ``[E, ...]`` under ``"experts"`` (PipelineStack's convention: dimension 0 the experts), each initialised
    from its own key. With ``axis_name``, call it inside ``spmd``/``jax.shard_map`` with dimension 0 of every
    ``"experts"`` leaf split over that axis (``P(axis_name)``) and the tokens split too: the result equals the layer on
    one device on the global batch (:func:`moe`). Initialise it outside (it then runs as one device, every expert
    local). Each call sows its :class:`MoEStats` into the ``"moe"`` collection (``MOE_COLLECTION``); a loss function
    reads them with ``y, state = model.apply(variables, x, mutable=["moe"])`` and adds, for example,
    ``0.01 * sum(jax.tree.leaves(state["moe"]["load_balancing_loss"]))`` (one entry per layer and call).

    Attributes:
      expert: the expert, an unbound Flax module mapping ``[rows, d]`` to ``[rows, d_out]`` row by row.
      experts: ``E``, over all devices.
      k: experts per token (default 2).
      routing: ``"softmax_topk"`` (default) or ``"topk_softmax"``.
      capacity_factor: ``None`` (dropless, default) or the factor of the GShard/Switch capacity rule.
      axis_name: the mesh axis the experts are split over, or ``None`` (every expert on this device).
      token_axes: every axis that splits the tokens, in the global batch's order (default: ``axis_name``).
      implementation: of the all-to-alls: ``"auto"``, ``"native"`` or ``"padded"``.
      router_init: the router kernel's initializer.
      parent: Flax's module parent.
      name: Flax's module name.

    Examples:
      >>> layer = sc.MoE(nn.Dense(4), experts=4, k=2)
      >>> variables = layer.init(jax.random.key(0), jnp.ones((3, 4)))
      >>> variables["params"]["experts"]["kernel"].shape, layer.apply(variables, jnp.ones((3, 4))).shape
      ((4, 4, 4), (3, 4))
    """

    expert: nn.Module
    experts: int
    k: int = 2
    routing: RoutingName = "softmax_topk"
    capacity_factor: float | None = None
    axis_name: str | None = None
    token_axes: tuple[str, ...] | None = None
    implementation: RaggedImplementation = "auto"
    router_init: Callable[..., Any] = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Routes every position of ``x`` (features last) to its experts and returns their weighted outputs.

        Args:
          x: ``[..., d]``.

        Returns:
          ``[..., d_out]``, in ``x``'s dtype.
        """
        check_routing("MoE", experts=self.experts, k=self.k, routing=self.routing, capacity_factor=self.capacity_factor)
        x = jnp.asarray(x)
        lead, h = x.shape[:-1], x.reshape(-1, x.shape[-1])
        router = self.param("router", self.router_init, (x.shape[-1], self.experts), jnp.float32)
        expert = self.expert.clone(parent=None)
        if not self.has_variable("params", "experts"):
            keys = jax.random.split(self.make_rng("params"), self.experts)
            created = jax.vmap(lambda key: expert.init(key, h[:1])["params"])(keys)
            self.param("experts", lambda _: created)
        # Read without Flax's shape check: inside a mapping this device holds E / n of the experts.
        params = meta.unbox(self.get_variable("params", "experts"))
        run = lambda buf: jax.vmap(lambda p, rows: cast(jax.Array, expert.apply({"params": p}, rows)))(params, buf)
        axis = None if self.is_initializing() else self.axis_name
        _check_held(jax.tree.leaves(params)[0].shape[0], self.experts, axis)
        y, stats = moe(
            h,
            h.astype(jnp.float32) @ router,
            run,
            experts=self.experts,
            k=self.k,
            routing=self.routing,
            capacity_factor=self.capacity_factor,
            axis_name=axis,
            token_axes=None if axis is None else self.token_axes,
            implementation=self.implementation,
        )
        for field, value in stats._asdict().items():
            self.sow(MOE_COLLECTION, field, value)
        return y.reshape(*lead, y.shape[-1])


def _check_held(held: int, experts: int, axis: str | None) -> None:
    """:class:`ShapeError` unless this device holds ``experts / n`` of the stacked experts."""
    n = 1 if axis is None else lax.axis_size(axis)
    if held * n != experts:
        where = "on one device" if axis is None else f"on each of the {n} devices of expert axis {axis!r}"
        raise ShapeError(
            describe(
                "MoE",
                f"the stacked expert parameters hold {held} experts {where} ({held * n} in all), but "
                f"experts={experts}.",
                fix="split dimension 0 of every 'experts' leaf over the expert axis (P(axis_name)), and pass the "
                "parameters of a layer with the same number of experts.",
            )
        )


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
