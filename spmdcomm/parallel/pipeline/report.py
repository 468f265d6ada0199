"""The pipeline's section of :func:`~spmdcomm.explain` (its registry entry's ``explain``): the schedule, and what
crosses the stage axis, read from the state and the compiled step's collectives."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from spmdcomm._format import format_bytes as _format_bytes
from spmdcomm.parallel.registry import Program

__all__ = ["PipelineReport", "pipeline_report"]


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    """A pipelined step's schedule and what crosses its stage axis (``Explanation.pipeline``).

    Attributes:
      axis: the stage axis.
      schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zb-h1"`` (:class:`~spmdcomm.Pipeline`).
      stages: ``p``.
      repeats: ``v``, layer chunks per stage.
      microbatches: ``m``.
      ticks: the schedule's loop length (:meth:`~spmdcomm.Pipeline.ticks`: GPipe ``v m + p - 1`` ticks, the
        table schedules their units, one action of one chunk each: 1F1B ``3 (v m + p - 1)``).
      bubble: its idle fraction (:meth:`~spmdcomm.Pipeline.bubble`: GPipe and 1F1B ``(p - 1) / (v m + p - 1)``,
        ZB-H1 less).
      in_flight: how many micro-batch chunks' activations (``1 / v`` of a stage's layers each) a stage device keeps
        at once for the backward pass, the most of any stage (:meth:`~spmdcomm.Pipeline.in_flight`: GPipe
        ``v m + p - 1``, one per tick; 1F1B and ZB-H1 ``v p``, on stage 0; 1F1B's stage ``s`` keeps ``v p - s``).
      kept: what it keeps of each: ``"stage input"`` under GPipe with ``remat`` (the layers are recomputed from
        it), else ``"every layer's activations"`` (ZB-H1: and the cotangents its weight gradients read, kept from
        each layer's input gradient to its weight gradient).
      recomputed: forward passes of the stack the backward pass runs again (1 under GPipe with ``remat``, else 0).
        No schedule's backward pass runs an equation twice: ZB-H1's weight gradient reads the cotangents its input
        gradient kept (:mod:`spmdcomm.parallel.pipeline.split`).
      stacked_bytes: the bytes of the stacked layers' parameters on one device.
      stack_bytes: the bytes of the whole stack (every layer).
      permutes: collective-permutes over the stage axis per step (each counted once, as in the table).
      permute_bytes: their message bytes per device.
      stage_gathers: all-gathers over the stage axis larger than the model state: 0 in a pipeline whose stages
        keep their own layers (a partial-manual ``shard_map`` has been seen to lower a ``ppermute`` as an
        all-gather and a permute). The stack's own state (BatchNorm's statistics) is gathered over the stage
        axis once per step by design, and is not counted.
    """

    axis: str
    schedule: str
    stages: int
    repeats: int
    microbatches: int
    ticks: int
    bubble: float
    in_flight: int
    kept: str
    recomputed: int
    stacked_bytes: int
    stack_bytes: int
    permutes: int
    permute_bytes: int
    stage_gathers: int

    def __str__(self) -> str:
        line = (
            f"pipeline over {self.axis!r}, {self.schedule}: p={self.stages}, v={self.repeats}, m={self.microbatches}: "
            f"{self.ticks} {'ticks' if self.schedule == 'gpipe' else 'units'}, bubble {self.bubble:.3f}; kept for the "
            f"backward pass: {self.kept} of {self.in_flight} micro-batch{'es' if self.repeats == 1 else ' chunks'}, "
            f"{self.recomputed} forward recomputed; stacked parameters per device "
            f"{_format_bytes(self.stacked_bytes)} of {_format_bytes(self.stack_bytes)}; collective-permutes over "
            f"{self.axis!r}: {self.permutes} ({_format_bytes(self.permute_bytes)})"
        )
        if self.stage_gathers:
            line += f"; WARNING: {self.stage_gathers} all-gather(s) over {self.axis!r} (stage layers gathered?)"
        return line


def pipeline_report(state: Any, program: Program) -> PipelineReport | None:
    """The :class:`PipelineReport` of a step of ``state`` (a ``TrainState``) compiled to ``program`` (its
    collectives); None without a pipeline."""
    pipeline = state.pipeline
    if pipeline is None:
        return None
    stages = int(state.mesh.shape[pipeline.axis])
    leaves = jax.tree.leaves(state.params)
    stacked = [x for x, flag in zip(leaves, state.layout.stacked_over(pipeline.axis, "params"), strict=True) if flag]
    over = [c for c in program.collectives if c.axes is not None and pipeline.axis in c.axes]
    permutes = [c for c in over if c.kind == "collective-permute"]
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state.model_state))
    kept = "stage input" if pipeline.recomputed else "every layer's activations"
    if pipeline.schedule == "zb-h1":
        kept += " and the cotangents its weight gradients read"
    return PipelineReport(
        axis=pipeline.axis,
        schedule=pipeline.schedule,
        stages=stages,
        repeats=pipeline.repeats,
        microbatches=pipeline.microbatches,
        ticks=pipeline.ticks(stages),
        bubble=pipeline.bubble(stages),
        in_flight=pipeline.in_flight(stages),
        kept=kept,
        recomputed=pipeline.recomputed,
        stacked_bytes=sum(x.addressable_shards[0].data.nbytes for x in stacked),
        stack_bytes=sum(x.nbytes for x in stacked),
        permutes=sum(c.count for c in permutes),
        permute_bytes=sum(c.total_bytes for c in permutes),
        stage_gathers=sum(c.count for c in over if c.kind == "all-gather" and c.bytes > state_bytes),
    )
