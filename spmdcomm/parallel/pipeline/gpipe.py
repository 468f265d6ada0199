"""The GPipe loop of :class:`~spmdcomm.Pipeline` (and its circular form, ``repeats > 1``): one forward loop of
``v m + p - 1`` ticks over a data replica's micro-batches, differentiated by autodiff (the module docstring of
:mod:`spmdcomm.parallel.pipeline.pipeline` describes the schedule, its bubbles and its layer order). Also the
forward pass of the 1F1B schedule's eval step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.errors import ShapeError, describe
from spmdcomm.parallel.pipeline.layer_order import GROUPS, check_schedule, reorder_layers
from spmdcomm.parallel.pipeline.schedule import PIPELINED, LayerFn, scan_layers
from spmdcomm.parallel.real_rows import UNKNOWN, Unknown, real_rows, rows_of

if TYPE_CHECKING:
    from spmdcomm.parallel.pipeline.pipeline import Pipeline

__all__ = ["micro_batch_rows", "pipelined", "stage_rows", "whole_state"]


#: What the loop's buffers hold before anything is written to them. Bubble ticks read such slots; they compute on a
#: stand-in instead and their results are never written, so NaN here must change nothing (tests/test_pipeline.py).
_FILL = 0.0


def pipelined(layer_fn: LayerFn, params: Any, state: Any, x: jax.Array, pipeline: Pipeline) -> tuple[jax.Array, Any]:
    """Runs a layer stack as ``pipeline``'s GPipe loop: ``(h, new_state)``, as
    :meth:`~spmdcomm.parallel.pipeline.schedule.Schedule.stack` (``params``: this stage's layers, in stored order)."""
    axis, m, v = pipeline.axis, pipeline.microbatches, pipeline.repeats
    p = lax.axis_size(axis)
    s = lax.axis_index(axis)
    local = jax.tree.leaves(params)[0].shape[0]
    check_schedule("PipelineStack", pipeline, p, local * p, x.shape[0] * p)
    k, q = local // v, m // p
    mb = x.shape[0] // q
    chunks = jax.tree.map(lambda a: a.reshape((v, k) + a.shape[1:]), params)
    # Every buffer the loop carries varies over the same manual axes as the activations (shard_map's typing).
    axes = tuple(sorted(set(varying_axes(x)) | {axis}))
    zeros = lambda shape: vary(jnp.full(shape, _FILL, x.dtype), axes)
    io_in = x.reshape((q, mb) + x.shape[1:])
    io_out = zeros(io_in.shape)
    loop = zeros((m, mb) + x.shape[1:]) if v > 1 else None
    carry = zeros((mb,) + x.shape[1:])
    # The state is whole (all L layers, canonical order) on every device: this stage's layers, as its chunks.
    own = stage_rows(state, local, p, v, s)
    layer_state = vary(jax.tree.map(lambda a: a.reshape((v, k) + a.shape[1:]), own), axes)
    micro_rows = micro_batch_rows(real_rows(), x.shape[0], q, mb, axis)
    left = [(i, (i - 1) % p) for i in range(p)]
    right = [(i, (i + 1) % p) for i in range(p)] if v > 1 else [(i, i + 1) for i in range(p - 1)]

    def chunk(r: jax.Array, i: jax.Array, chunk_state: Any, h: jax.Array) -> tuple[jax.Array, Any]:
        layers = jax.tree.map(lambda a: a[r] if v > 1 else a[0], chunks)
        # Micro-batch i is part i mod q of stage device i // q's rows, which begin (i // q - s) block lengths
        # (GROUPS of this device's rows) after this device's.
        row = (i // q - s) * (GROUPS.get() * q * mb) + (i % q) * mb
        return scan_layers(layer_fn, layers, chunk_state, h, offset=(r * p + s) * k, row=row, remat=False)

    run = jax.checkpoint(chunk) if pipeline.remat else chunk

    def tick(carried: Any, t: jax.Array) -> tuple[Any, Any]:
        io_in, io_out, loop, carry, layer_state = carried
        w = t - s  # the work item of this stage: micro-batch w mod m of chunk w // m
        valid = (w >= 0) & (w < v * m)
        r, i = jnp.clip(w, 0, v * m - 1) // m, jnp.clip(w, 0, v * m - 1) % m
        if v > 1:
            # Stage 0 keeps what the last stage finished of an earlier chunk until its micro-batch's turn.
            back = t - p
            keep = (s == 0) & (back >= 0) & (back < (v - 1) * m)
            loop = loop.at[back % m].set(jnp.where(keep, carry, loop[back % m]))
            first = jnp.where(t < m, io_in[t % q], loop[i])
        else:
            first = io_in[t % q]
        h = jnp.where(s == 0, first, carry)
        # A bubble computes on real rows (stage 0's input of this tick), never on zeros or an empty slot: its result
        # is dropped, so its cotangent is zero, and a zero times a block's derivative at real rows stays zero.
        h = jnp.where(valid, h, io_in[t % q])
        with rows_of(micro_rows(i)):  # the real rows of the micro-batch this stage runs (a bubble's: unread)
            out, new_state = run(r, i, jax.tree.map(lambda a: a[r] if v > 1 else a[0], layer_state), h)
        sown = {c: new_state.pop(c) for c in list(new_state) if c not in layer_state}
        # A chunk's state moves on once per real micro-batch, in micro-batch order (a bubble's update is dropped).
        layer_state = jax.tree.map(lambda a, n: a.at[r].set(jnp.where(valid, n, a[r])), layer_state, new_state)
        # The slot stage 0 read moves one stage back, bringing the next micro-batches to stage 0 in turn.
        io_in = io_in.at[t % q].set(lax.ppermute(io_in[t % q], axis, left))
        # The output slot moves one stage back before the last stage writes a finished micro-batch into it, so
        # that micro-batch j ends on stage j // (m / p), where its rows began.
        u = t - (p - 1) - (v - 1) * m
        slot = u % q
        moved = lax.ppermute(io_out[slot], axis, left)
        done = (s == p - 1) & valid & (r == v - 1)
        io_out = io_out.at[slot].set(jnp.where(done, out, moved))
        carry = lax.ppermute(out, axis, right)
        return (io_in, io_out, loop, carry, layer_state), sown

    initial = (io_in, io_out, loop, carry, layer_state)
    # v m + p - 1 ticks, also for a 1F1B pipeline's eval step (whose own loop is longer).
    token = PIPELINED.set(axis)
    try:
        (_, io_out, _, _, layer_state), sown = lax.scan(tick, initial, jnp.arange(v * m + p - 1))
    finally:
        PIPELINED.reset(token)
    whole = whole_state(layer_state, local, p, v, axis)
    return io_out.reshape(x.shape), {**whole, **_per_micro_batch(sown, s, m, v, p, axis)}


def micro_batch_rows(rows: Any, held: int, q: int, mb: int, axis: str) -> Callable[[jax.Array], Any]:
    """``f(i)``: the real-row mask of micro-batch ``i`` (``[mb]``, part ``i mod q`` of stage device ``i // q``'s
    rows), from this device's mask ``rows`` of its ``held`` rows (gathered over the stage axis: small); ``None`` for
    an unmasked batch, :data:`~spmdcomm.parallel.real_rows.UNKNOWN` when the stack's input is not the batch's rows."""
    if rows is None or isinstance(rows, Unknown):
        return lambda i: rows
    if rows.shape[0] != held:
        return lambda i: UNKNOWN
    every = lax.all_gather(vary(rows, (axis,)), axis, tiled=False).reshape(-1, mb)  # [p q, mb], stage-major
    return lambda i: every[i]


def _per_micro_batch(sown: Any, stage: jax.Array, m: int, v: int, p: int, axis: str) -> Any:
    """What the layers sowed at each tick ``[ticks, k, ...]`` as ``[L, m, ...]`` on every device, canonical layer
    order: this stage's work item ``w`` (chunk ``w // m``, micro-batch ``w mod m``) ran at tick ``w + stage``; the
    bubbles' values are never read."""

    def one(a: jax.Array) -> jax.Array:
        k = a.shape[1]
        mine = lax.dynamic_slice_in_dim(a, stage, v * m).reshape((v, m, k) + a.shape[2:])
        mine = jnp.swapaxes(mine, 1, 2).reshape((v * k, m) + a.shape[2:])
        return lax.all_gather(mine, axis, tiled=True)

    gathered = jax.tree.map(one, sown)
    return reorder_layers(gathered, _every_leaf(gathered), p, v, to_stage=False)


def stage_rows(state: Any, local: int, stages: int, repeats: int, stage: jax.Array) -> Any:
    """The rows of ``state`` (whole, canonical layer order) that stage ``stage`` holds, in its stored order."""
    for a in jax.tree.leaves(state):
        if a.shape[0] != local * stages:
            raise ShapeError(
                describe(
                    "PipelineStack",
                    f"a state leaf of the stack has {a.shape[0]} layers on dimension 0, the parameters "
                    f"{local * stages}.",
                    fix="keep the stack's mutable state (BatchNorm's statistics) whole: one row per layer.",
                )
            )
    stored = reorder_layers(state, _every_leaf(state), stages, repeats, to_stage=True)
    return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, stage * local, local), stored)


def whole_state(layer_state: Any, local: int, stages: int, repeats: int, axis: str) -> Any:
    """Every stage's updated rows gathered over the stage axis (small: statistics) and put back in canonical order,
    so each device holds the whole state, as the step stores it."""
    gathered = jax.tree.map(lambda a: lax.all_gather(a.reshape((local,) + a.shape[2:]), axis, tiled=True), layer_state)
    return reorder_layers(gathered, _every_leaf(gathered), stages, repeats, to_stage=False)


def _every_leaf(tree: Any) -> tuple[bool, ...]:
    return (True,) * len(jax.tree.leaves(tree))
