"""Pipeline parallelism: a stack of ``L`` layers split over a ``stage`` mesh axis, ``L / p`` layers per stage, with
micro-batches flowing through the stages so that every stage works at once. The schedules: GPipe (below; its loop
is :mod:`spmdcomm.parallel.pipeline.gpipe`), and 1F1B, interleaved 1F1B and ZB-H1 (``schedule="1f1b"`` or
``"zb-h1"``: tables, :mod:`spmdcomm.parallel.pipeline.tables`, run by
:mod:`spmdcomm.parallel.pipeline.one_f_one_b`).

:class:`Pipeline` is the policy, given once to ``TrainState.create(..., pipeline=...)``: the stage axis, the number
of micro-batches ``m`` and of layer chunks per stage ``v`` (the circular / interleaved schedule; ``v = 1`` is GPipe).
It is a :class:`~spmdcomm.parallel.pipeline.schedule.Schedule`: a layer stack (:class:`~spmdcomm.PipelineStack`, or
:func:`~spmdcomm.parallel.pipeline.schedule.run_stack` from your module) runs as a plain scan outside a step, and as a
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
import numpy as np
from jax import lax
from jax.sharding import Mesh

from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.pipeline import gpipe, one_f_one_b, pieces, tables
from spmdcomm.parallel.pipeline.layer_order import GROUPS, check_schedule, reorder_layers, stack_in_stage_order
from spmdcomm.parallel.pipeline.report import pipeline_report
from spmdcomm.parallel.pipeline.schedule import LayerFn, MicroPieces, MicroStep, Schedule, schedule_context
from spmdcomm.parallel.registry import Parallelism

__all__ = ["Pipeline", "PARALLELISM"]


@dataclasses.dataclass(frozen=True)
class Pipeline(Schedule):
    """How a layer stack is split over the stage axis and scheduled (``TrainState.create(..., pipeline=...)``).

    A :class:`~spmdcomm.parallel.pipeline.Schedule`: the step's loop over ``accum_steps`` groups stays sequential, and
    every layer stack in a group's forward pass runs as a pipeline of ``microbatches`` over the stage axis.

    Args:
      microbatches: ``m``, the micro-batches each data replica's rows are cut into; a multiple of the stage count
        ``p`` (and at least ``p``). The bubble is ``(p - 1) / (v m + p - 1)`` of the step (ZB-H1: less).
      axis: the mesh axis the layers are split over (``"stage"``).
      repeats: ``v``, layer chunks per stage (the circular / interleaved schedule: ``v`` times the point-to-point
        traffic for a ``v`` times smaller bubble). ``L`` must be a multiple of ``v p``.
      remat: GPipe: rematerialise each tick's layers in the backward pass, keeping only the stage input of each
        tick. The other schedules keep every layer's activations of at most ``p`` micro-batches (``v p`` chunks)
        and recompute none; they ignore it.
      schedule: ``"gpipe"`` (the forward loop, differentiated by autodiff); ``"1f1b"`` (each micro-batch's
        backward pass as soon as its forward pass leaves the last stage, torch's ``Schedule1F1B``; with
        ``repeats=v`` torch's ``ScheduleInterleaved1F1B``, also named ``"interleaved_1f1b"``); ``"zb-h1"`` (1F1B
        with the backward pass split into input and weight gradients, the weight gradients filling the bubble,
        torch's ``ScheduleInterleavedZeroBubble``). The last two take any loss the step takes (a per-row mean or
        :func:`~spmdcomm.weighted`) and any model state: the layers before and after the stack run once per
        micro-batch, in micro-batch order, and move their state (BatchNorm's statistics) on each time, as the
        stack's layers do under both schedules. With a context or expert axis they run a lockstep table (every
        stage runs each unit's action, masked where it has none); what the stack's blocks sow reaches each call of
        the loss per micro-batch, ``[L, 1, ...]``.

    Raises:
      SpmdError: for a non-positive ``microbatches`` or ``repeats``, an ``axis`` that is not a string, or an
        unknown ``schedule``.

    Examples:
      >>> sc.Pipeline(microbatches=8, repeats=2)
      Pipeline(microbatches=8, axis='stage', repeats=2, remat=True, schedule='gpipe')
    """

    microbatches: int
    axis: str = "stage"
    repeats: int = 1
    remat: bool = True
    schedule: str = "gpipe"

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
        if self.schedule != "gpipe" and self.schedule not in tables.SCHEDULES:
            names = ", ".join(repr(n) for n in ("gpipe", *tables.SCHEDULES))
            raise SpmdError(
                describe(
                    "Pipeline",
                    f"schedule={self.schedule!r} is not a schedule: the schedules are {names} (each with any repeats).",
                    fix="pass schedule='gpipe', '1f1b' (with repeats=v: interleaved 1F1B) or 'zb-h1'.",
                )
            )

    def ticks(self, stages: int) -> int:
        """The length of the schedule's loop.

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          GPipe: ``v m + p - 1`` forward ticks (and as many backward). The tables' schedules: the table's units
          (one action of one chunk per stage each; :mod:`spmdcomm.parallel.pipeline.tables`), 1F1B
          ``3 (v m + p - 1)``.
        """
        if self.schedule == "gpipe":
            return self.repeats * self.microbatches + stages - 1
        return self.table(stages).units

    def bubble(self, stages: int) -> float:
        """The idle fraction of the schedule's loop (the bubble).

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          GPipe and 1F1B (interleaved too): ``(p - 1) / (v m + p - 1)``; ZB-H1: its table's, with a forward, an
          input gradient and a weight gradient of a chunk taking one unit each (at ``m = p`` a third of 1F1B's).
        """
        if self.schedule == "gpipe":
            return (stages - 1) / (self.repeats * self.microbatches + stages - 1)
        return self.table(stages).bubble

    def in_flight(self, stages: int) -> int:
        """How many micro-batch chunks' activations (``1 / v`` of the stage's layers each) a stage keeps at once.

        At the peak, for the backward pass.

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          GPipe: ``v m + p - 1``: the backward pass is autodiff of the whole loop, so every tick's (bubbles' too)
          are kept until it starts; with ``remat`` each is the tick's stage input, without it every layer's
          activations. The tables' schedules: ``v p``, every layer's activations (``p`` micro-batches' worth), the
          peak of stage 0; 1F1B's stage ``s`` keeps ``v p - s`` and ZB-H1's every stage ``v p``
          (``table(stages).in_flight_per_stage``).
        """
        if self.schedule == "gpipe":
            return self.ticks(stages)
        return self.table(stages).in_flight

    @property
    def recomputed(self) -> int:
        """How many forward passes of each stage's layers the backward pass runs again (GPipe with remat: 1)."""
        return int(self.remat and self.schedule == "gpipe")

    def table(self, stages: int) -> tables.Table:
        """The schedule's table of actions (:mod:`spmdcomm.parallel.pipeline.tables`).

        Args:
          stages: ``p``, the size of the stage axis.

        Returns:
          The table of ``"1f1b"`` or ``"zb-h1"`` for ``p``, ``m`` and ``v`` (GPipe's loop is autodiff's: no table).

        Raises:
          SpmdError: for ``m`` not a multiple of ``p``, or a schedule without a table (``"gpipe"``).
        """
        if self.schedule == "gpipe":
            raise SpmdError(describe("Pipeline.table", "schedule='gpipe' has no table.", fix="use Pipeline.ticks."))
        check_schedule("Pipeline", self, stages, None, None)
        return tables.table(self.schedule, stages=stages, microbatches=self.microbatches, repeats=self.repeats)

    def loop(
        self, step: MicroStep, model_state: Any, micro: Any, axes: tuple[str, ...], *, pieces: MicroPieces | None = None
    ) -> tuple[Any, ...]:
        """Runs the step's micro-batches, each as one pipeline.

        GPipe runs them in order, each one's layer stacks as pipelines; 1F1B runs each as one 1F1B pipeline of
        ``pieces`` (:mod:`spmdcomm.parallel.pipeline.one_f_one_b`).

        Args:
          step: the gradient of one micro-batch.
          model_state: the model state before the first micro-batch.
          micro: ``(batch, mask)``, every leaf with the micro-batches on dimension 0.
          axes: the manual axes the sums vary over.
          pieces: the micro-batch's pieces (1F1B differentiates them itself).

        Returns:
          ``(grad_sum, metric_sums, model_state, count)``, as the sequential schedule's.
        """
        if self.schedule == "gpipe" or pieces is None:
            token = GROUPS.set(int(micro[1].shape[0]))
            try:
                return super().loop(step, model_state, micro, axes)
            finally:
                GROUPS.reset(token)
        check_schedule(
            "make_train_step", self, lax.axis_size(self.axis), None, micro[1].shape[1] * lax.axis_size(self.axis)
        )
        return one_f_one_b.loop(self, pieces, model_state, micro, axes)

    def parts(self, rows: int) -> int:
        """Into how many parts the loop cuts a device's micro-batch of ``rows`` rows.

        Args:
          rows: the rows of one of the step's micro-batches on this device.

        Returns:
          1F1B: ``m / p``, this device's micro-batches of the pipeline; GPipe: 1 (the stack cuts the rows itself).
        """
        return 1 if self.schedule == "gpipe" else self.microbatches // lax.axis_size(self.axis)

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
          layer_fn: one layer, as :func:`~spmdcomm.parallel.pipeline.schedule.run_stack` takes it.
          params: this stage's layers (dimension 0), in stored order.
          state: the stack's mutable state, all layers in canonical order.
          x: this device's rows.
          remat: the stack's own setting, which gives way to the schedule's ``remat``.

        Returns:
          ``(h, new_state)``: the stack's output for this device's rows and the whole updated state.
        """
        if self.schedule != "gpipe":
            piece = pieces.stack_piece(layer_fn, params, state, x)
            if piece is not None:
                return piece
        return gpipe.pipelined(layer_fn, params, state, x, self)

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


#: The pipeline's entry of the registry (:mod:`spmdcomm.parallel.registry`): its stage axis splits the rows and
#: owns the stacked layers; the steps run layer stacks as its schedule says.
PARALLELISM = Parallelism(
    role="stage",
    keyword="pipeline",
    config=Pipeline,
    axis_words="the pipeline's stage axis",
    example="sc.Pipeline(microbatches=...)",
    stacks=True,
    check=lambda fn, pipeline, mesh: check_schedule(fn, pipeline, int(mesh.shape[pipeline.axis]), None, None),
    prepare=lambda fn, pipeline, params, layout: stack_in_stage_order(fn, params, layout, pipeline),
    step_context=lambda pipeline, roles: schedule_context(pipeline),
    explain=pipeline_report,
)
