"""Where a pipeline's layers live and what it can run: the stage order of the stacked layers (stage ``s`` holds
chunks ``s, s + p, ...``), the reordering between it and the canonical order, and the checks of a schedule's numbers
against the mesh, the layers and the batch. The config (:class:`~spmdcomm.Pipeline`) and its loops import these."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdcomm.errors import ShapeError, SpmdError, describe

if TYPE_CHECKING:
    from spmdcomm.parallel.pipeline.pipeline import Pipeline

__all__ = ["GROUPS", "check_schedule", "stage_order", "stack_in_stage_order", "reorder_layers"]

#: How many of the step's micro-batches (``accum_steps``) a device's block holds one after the other, while the
#: loop runs them (1 outside it: the eval step): the rows of one that the next stage device holds begin ``GROUPS``
#: micro-batches' rows after this device's, which the per-example keys of those rows must count.
GROUPS: contextvars.ContextVar[int] = contextvars.ContextVar("spmdcomm_pipeline_groups", default=1)


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
    stacked = layout.stacked_over(pipeline.axis, "params")
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
