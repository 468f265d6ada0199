"""Pipeline parallelism: a stack of ``L`` layers split over a ``stage`` mesh axis, ``L / p`` layers per stage, with
micro-batches flowing through the stages so that every stage works at once.

:class:`Pipeline` is the policy, given once to ``TrainState.create(..., pipeline=...)``: the stage axis, the number
of micro-batches ``m`` and of layer chunks per stage ``v`` (the circular / interleaved schedule; ``v = 1`` is GPipe).
It is a :class:`~spmdcomm.train.schedule.Schedule`: a layer stack (:class:`~spmdcomm.PipelineStack`, or
:func:`~spmdcomm.train.schedule.run_stack` from your own module) runs as a plain scan outside a step, and as a
pipeline inside the train and eval steps of a state with a pipeline.

The schedule. The batch is split over the data axes and the stage axis, as over one more data axis: the
embedding, head and loss outside the stack see this device's rows. The stack treats the rows of one data replica
(its ``p`` stage devices' rows) as ``m`` micro-batches; stage ``s`` starts with micro-batches ``[s m/p, (s+1) m/p)``.
One loop of ``v m + p - 1`` ticks: at tick ``t`` stage ``s`` applies its layers of chunk ``(t - s) // m`` to
micro-batch ``(t - s) mod m`` (when ``0 <= t - s < v m``), then the activations move one stage on (one
``ppermute``). Inputs stream in at stage 0 and outputs stream out of the last stage through buffers that stay split
over the stage axis (one micro-batch slot moves one stage per tick), so no device ever holds the replica's batch
and the outputs end where the inputs began. The backward pass is autodiff (the transpose of a ``ppermute`` is the
inverse ``ppermute``). A bubble tick (no work item) runs its stage's layers on a stand-in: the real stack input
in this stage's input buffer at that tick (the slot stage 0 reads, which holds real rows on every stage at every
tick). Its output and state update are dropped by selects, so the cotangent of all it computed is exactly zero,
and that zero multiplies derivatives taken on real rows only, never at zeros or in an empty slot (where
``x / sqrt(mean(x * x))`` or a norm has a NaN derivative, and ``0 * NaN`` is NaN). What a bubble's buffer slot
holds never reaches anything. With ``remat`` (default) each tick's chunk is rematerialised: the backward pass
keeps only each tick's stage input (``v m + p - 1`` micro-batch activations per device) and recomputes the layers.

Layer order. The stacked parameters ``[L, ...]`` keep the canonical layer order in checkpoints and
``full_params()``. With ``v = 1`` stage ``s`` holds layers ``[s L/p, (s+1) L/p)``, which is the canonical order split
over the stage axis. With ``v > 1`` stage ``s`` holds chunks ``s, s + p, ...`` (``k = L / (v p)`` layers each): the
state stores the stack in that stage order (:func:`stage_order`) and the optimizer, which acts on each layer alike,
runs on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.train.schedule import LayerFn, Schedule, scan_layers

__all__ = ["Pipeline", "stage_order", "stack_in_stage_order", "reorder_layers", "check_schedule"]


@dataclasses.dataclass(frozen=True)
class Pipeline(Schedule):
    """How a layer stack is split over the stage axis and scheduled (``TrainState.create(..., pipeline=...)``).

    A :class:`~spmdcomm.train.schedule.Schedule`: the step's loop over ``accum_steps`` groups stays sequential, and
    every layer stack in a group's forward pass runs as a pipeline of ``microbatches`` over the stage axis.

    Args:
      microbatches: ``m``, the micro-batches each data replica's rows are cut into; a multiple of the stage count
        ``p`` (and at least ``p``). The bubble is ``(p - 1) / (v m + p - 1)`` of the step.
      axis: the mesh axis the layers are split over (``"stage"``).
      repeats: ``v``, layer chunks per stage (the circular / interleaved schedule: ``v`` times the point-to-point
        traffic for a ``v`` times smaller bubble); ``1`` is GPipe. ``L`` must be a multiple of ``v p``.
      remat: rematerialise each tick's layers in the backward pass, keeping only the stage input of each tick.

    Raises:
      SpmdError: for a non-positive ``microbatches`` or ``repeats``, or an ``axis`` that is not a string.

    Examples:
      >>> sc.Pipeline(microbatches=8, repeats=2)
      Pipeline(microbatches=8, axis='stage', repeats=2, remat=True)
    """

    microbatches: int
    axis: str = "stage"
    repeats: int = 1
    remat: bool = True

    #: The schedule rematerialises each tick itself (FSDP's policy, which keeps every computed value, would undo it).
    strategy_remat: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("microbatches", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise SpmdError(
                    describe("Pipeline", f"{name}={value!r} must be a positive int.", fix=f"pass e.g. {name}=4.")
                )
        if not isinstance(self.axis, str):
            raise SpmdError(describe("Pipeline", f"axis={self.axis!r} is not a mesh axis name.", fix='axis="stage"'))

    def ticks(self, stages: int) -> int:
        """The length of the schedule's loop.

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          ``v m + p - 1`` ticks.
        """
        return self.repeats * self.microbatches + stages - 1

    def bubble(self, stages: int) -> float:
        """The idle fraction of the schedule's loop (the bubble).

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          ``(p - 1) / (v m + p - 1)``.
        """
        return (stages - 1) / self.ticks(stages)

    def in_flight(self, stages: int) -> int:
        """How many micro-batches' activations a stage device keeps at once for the backward pass (at its peak).

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          ``v m + p - 1``: the backward pass is autodiff of the whole loop, so every tick's (bubbles' too) are kept
          until it starts; with ``remat`` each is the tick's stage input, without it every layer's activations.
        """
        return self.ticks(stages)

    @property
    def recomputed(self) -> int:
        """How many forward passes of each stage's layers the backward pass runs again: 1 with ``remat``, else 0."""
        return int(self.remat)

    def rows_seen(self, count: jax.Array) -> jax.Array:
        """The real-example count of the rows one micro-batch's gradient on this device depends on.

        Every gradient holds the rows of the whole stage group: the stack's through the schedule, the other layers'
        summed over the stage axis by autodiff.

        Args:
          count: this device's real-example count.

        Returns:
          The count summed over the stage axis.
        """
        return lax.psum(count, self.axis)

    def stack(self, layer_fn: LayerFn, params: Any, state: Any, x: jax.Array, *, remat: bool) -> tuple[jax.Array, Any]:
        """Runs a layer stack as this pipeline (module docstring).

        Args:
          layer_fn: one layer, as :func:`~spmdcomm.train.schedule.run_stack` takes it.
          params: this stage's layers (dimension 0), in stored order.
          state: the stack's mutable state, all layers in canonical order.
          x: this device's rows.
          remat: the stack's own setting, which gives way to the schedule's ``remat``.

        Returns:
          ``(h, new_state)``: the stack's output for this device's rows and the whole updated state.
        """
        return _pipelined(layer_fn, params, state, x, self)

    def reorder(self, tree: Any, stacked: tuple[bool, ...], mesh: Mesh, *, to_stage: bool) -> Any:
        """Puts the stacked leaves of ``tree`` in the order a state on ``mesh`` stores them, or back.

        Args:
          tree: a tree of the model's parameters or optimizer state.
          stacked: one flag per leaf of ``tree``: whether it is a stacked leaf (layers on dimension 0).
          mesh: the state's mesh (its stage axis gives ``p``).
          to_stage: from canonical layer order to :func:`stage_order` (True), or back (False).

        Returns:
          ``tree`` reordered by :func:`reorder_layers` (unchanged for ``repeats=1``).
        """
        return reorder_layers(tree, stacked, int(mesh.shape[self.axis]), self.repeats, to_stage=to_stage)


def check_schedule(fn: str, pipeline: Pipeline, stages: int, layers: int | None, rows: int | None) -> None:
    """Raises :class:`SpmdError` (:class:`ShapeError` for the batch) naming the numbers, before anything compiles,
    unless ``pipeline`` can run ``layers`` layers (None: not known yet) on ``stages`` stages over ``rows`` rows per
    data replica (None: not known yet)."""
    m, v, p = pipeline.microbatches, pipeline.repeats, stages
    if m < p or m % p:
        raise SpmdError(
            describe(
                fn,
                f"microbatches={m} on {p} stages (mesh axis {pipeline.axis!r}): every stage starts with m / p of "
                "the micro-batches, so m must be a multiple of p and at least p (with fewer, stages would wait for "
                "micro-batches that never come).",
                fix=f"pass sc.Pipeline(microbatches={max(p, -(-m // p) * p)}, ...) or a multiple of {p}.",
            )
        )
    if layers is not None and layers % (v * p):
        raise SpmdError(
            describe(
                fn,
                f"{layers} layers do not split into {v} chunk(s) per stage on {p} stages (repeats={v}): L must be a "
                f"multiple of v * p = {v * p}.",
                fix=f"use a multiple of {v * p} layers, or repeats= a divisor of {layers // p if layers >= p else 1}.",
            )
        )
    if rows is not None and rows % m:
        raise ShapeError(
            describe(
                fn,
                f"a data replica's {rows} rows do not split into microbatches={m} equal micro-batches.",
                fix=f"make the batch per data replica a multiple of {m} (sc.pad_batch pads with masked rows).",
            )
        )


def stage_order(layers: int, stages: int, repeats: int) -> np.ndarray:
    """``order[g]``: the canonical layer stored at row ``g`` of a stack split over ``stages`` with ``repeats`` chunks
    per stage (stage ``s`` holds chunks ``s, s + p, ...`` in its contiguous block). The identity for ``repeats=1``.

    >>> stage_order(8, 2, 2).tolist()   # stage 0: chunks 0 and 2; stage 1: chunks 1 and 3
    [0, 1, 4, 5, 2, 3, 6, 7]
    """
    k = layers // (stages * repeats)
    g = np.arange(layers)
    s, rest = g // (repeats * k), g % (repeats * k)
    r, j = rest // k, rest % k
    return (r * stages + s) * k + j


def stack_in_stage_order(fn: str, params: Any, layout: Any, pipeline: Pipeline) -> Any:
    """``params`` (the model's tree, layers in canonical order) with every leaf split over the stage axis checked
    (its layers a multiple of ``v p``) and, with ``v > 1``, its layers put in :func:`stage_order`. Raises
    :class:`SpmdError` when no leaf is split over the stage axis."""
    p = dict(zip(layout.mesh_axes, layout.mesh_sizes, strict=True))[pipeline.axis]
    stacked = layout.stage_stacked("params")
    if not any(stacked):
        raise SpmdError(
            describe(
                fn,
                f"pipeline={pipeline!r} but no parameter is split over the stage axis {pipeline.axis!r}.",
                fix="build the model's repeated layers with sc.PipelineStack(block, layers=L), or give the stacked "
                f"leaves the spec P({pipeline.axis!r}, ...) (param_specs= or nn.with_partitioning).",
            )
        )
    for x, is_stacked in zip(jax.tree.leaves(params), stacked, strict=True):
        if is_stacked:
            check_schedule(fn, pipeline, p, int(x.shape[0]), None)
    return reorder_layers(params, stacked, p, pipeline.repeats, to_stage=True)


def reorder_layers(tree: Any, stacked: tuple[bool, ...], stages: int, repeats: int, *, to_stage: bool) -> Any:
    """``tree`` with the leaves flagged in ``stacked`` reordered along dimension 0: from the canonical layer order to
    :func:`stage_order` (``to_stage``), or back. Any other leaf, and every leaf for ``repeats=1``, is unchanged."""
    if repeats == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x, flag in zip(leaves, stacked, strict=True):
        if flag:
            order = stage_order(int(x.shape[0]), stages, repeats)
            x = jnp.take(x, jnp.asarray(order if to_stage else np.argsort(order)), axis=0)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


#: What the loop's buffers hold before anything is written to them. Bubble ticks read such slots; they compute on a
#: stand-in instead and their results are never written, so NaN here must change nothing (tests/test_pipeline.py).
_FILL = 0.0


def _pipelined(layer_fn: LayerFn, params: Any, state: Any, x: jax.Array, pipeline: Pipeline) -> tuple[jax.Array, Any]:
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
    own = _stage_rows(state, local, p, v, s)
    layer_state = vary(jax.tree.map(lambda a: a.reshape((v, k) + a.shape[1:]), own), axes)
    left = [(i, (i - 1) % p) for i in range(p)]
    right = [(i, (i + 1) % p) for i in range(p)] if v > 1 else [(i, i + 1) for i in range(p - 1)]

    def chunk(r: jax.Array, i: jax.Array, chunk_state: Any, h: jax.Array) -> tuple[jax.Array, Any]:
        layers = jax.tree.map(lambda a: a[r] if v > 1 else a[0], chunks)
        # Micro-batch i holds the replica's rows [i mb, (i + 1) mb); this device's rows begin at s q mb.
        return scan_layers(layer_fn, layers, chunk_state, h, offset=(r * p + s) * k, row=(i - s * q) * mb, remat=False)

    run = jax.checkpoint(chunk) if pipeline.remat else chunk

    def tick(carried: Any, t: jax.Array) -> tuple[Any, None]:
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
        out, new_state = run(r, i, jax.tree.map(lambda a: a[r] if v > 1 else a[0], layer_state), h)
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
        return (io_in, io_out, loop, carry, layer_state), None

    initial = (io_in, io_out, loop, carry, layer_state)
    (_, io_out, _, _, layer_state), _ = lax.scan(tick, initial, jnp.arange(pipeline.ticks(p)))
    return io_out.reshape(x.shape), _whole_state(layer_state, local, p, v, axis)


def _stage_rows(state: Any, local: int, stages: int, repeats: int, stage: jax.Array) -> Any:
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


def _whole_state(layer_state: Any, local: int, stages: int, repeats: int, axis: str) -> Any:
    """Every stage's updated rows gathered over the stage axis (small: statistics) and put back in canonical order,
    so each device holds the whole state, as the step stores it."""
    gathered = jax.tree.map(lambda a: lax.all_gather(a.reshape((local,) + a.shape[2:]), axis, tiled=True), layer_state)
    return reorder_layers(gathered, _every_leaf(gathered), stages, repeats, to_stage=False)


def _every_leaf(tree: Any) -> tuple[bool, ...]:
    return (True,) * len(jax.tree.leaves(tree))
