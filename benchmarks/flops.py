"""The work of examples/lm's train step on each layout: the matmul FLOPs ``sc.explain`` counts in the compiled step,
summed over the mesh's devices, against the one-device step's for the same global batch and against the dense model
FLOPs (``spmdcomm.explain.model_flops``), with the excess split by where it is computed.

Run: ``python benchmarks/flops.py [--layouts ddp,tensor,...] [--experts 8 --top-k 2] [--smoke] [--json PATH]``.

Nothing runs: every number is read from the optimised HLO (``report.flops``: per device, loops times their trip
counts, conditionals at their largest branch). The model is examples/lm's transformer at its defaults (width 128,
4 layers of 4 heads, MLP 512, 256 bytes, 32 windows of 128 bytes; ``--smoke``: width 32, 16 bytes, 16 windows), the
example's AdamW, DDP unless the layout says otherwise. Layouts on 8 fake CPU devices (``LAYOUTS``):

- ``ddp`` / ``fsdp``: ``data=8``;
- ``context ring`` / ``context all-to-all``: ``data=2,context=4`` (zig-zag), attention by ring or all-to-all;
- ``tensor``: ``data=4,model=2`` (heads, MLP units and the vocabulary over ``model``);
- ``gpipe`` / ``gpipe no remat`` / ``1f1b`` / ``zb-h1``: ``data=2,stage=4``, one block per stage, ``m = 8``
  micro-batches per data replica;
- with ``--experts E``: ``moe ddp`` (``data=8``) and ``moe expert`` (``data=2,expert=4``), every block's MLP a
  mixture of ``E`` experts (top-``k``, dropless), against the one-device step of the same mixture (their model FLOPs
  count the active parameters: a token's ``k`` experts). ``--experts 8 --layouts "moe ddp,moe expert"`` runs only
  those.

Per layout: FLOPs per device and over the mesh, ``vs one device`` (``report.flops_ratio``), ``vs model FLOPs``, the
count's bound (``exact``, or ``upper`` where a conditional counts its largest branch), and ``excess``: for each group
of scopes (``blocks``: the transformer blocks, ``head``: the tied embedding's ``attend``, ``other``) the FLOPs over
the mesh beyond the one-device step's, as a fraction of the one-device step's total. ``--markdown`` prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import run_facts, set_cpu_devices, write_json

set_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "lm")
sys.path.insert(0, LM)

import flax.linen as nn  # noqa: E402
import train  # noqa: E402  examples/lm/train.py

import spmdcomm as sc  # noqa: E402
from spmdcomm.explain import Work, model_flops  # noqa: E402
from spmdcomm.parallel.pipeline import one_f_one_b  # noqa: E402

M = 8  # a pipeline's micro-batches per data replica


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row: a mesh, the config fields it changes, and on a stage axis the pipeline (``None``: the example's)."""

    mesh: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    pipeline: Callable[[], sc.Pipeline] | None = None
    moe: bool = False  # a row of the mixture of experts (only with --experts)


LAYOUTS: dict[str, Layout] = {
    "ddp": Layout("data=8"),
    "fsdp": Layout("data=8", {"strategy": "fsdp"}),
    "context ring": Layout("data=2,context=4", {"attention": "ring"}),
    "context all-to-all": Layout("data=2,context=4", {"attention": "all_to_all"}),
    "tensor": Layout("data=4,model=2"),
    "gpipe": Layout("data=2,stage=4", pipeline=lambda: sc.Pipeline(M)),
    "gpipe no remat": Layout("data=2,stage=4", pipeline=lambda: sc.Pipeline(M, remat=False)),
    "1f1b": Layout("data=2,stage=4", pipeline=lambda: sc.Pipeline(M, schedule="1f1b")),
    "zb-h1": Layout("data=2,stage=4", pipeline=lambda: sc.Pipeline(M, schedule="zb-h1")),
    "moe ddp": Layout("data=8", moe=True),
    "moe expert": Layout("data=2,expert=4", moe=True),
}
DEFAULT = dict(width=128, layers=4, heads=4, seq_len=128, batch_size=32)
SMOKE = dict(width=32, layers=4, heads=4, seq_len=16, batch_size=16)


def mesh_of(text: str) -> jax.sharding.Mesh:
    """The mesh ``text`` names (``"data=2,stage=4"``), on the first devices it needs."""
    axes = train.parse_mesh(text)
    return sc.make_mesh(axes, devices=jax.devices()[: math.prod(axes.values())])


def zeros_like_init(config: train.Config) -> Any:
    """Zeros of the model's initial parameters, boxed with their logical names: nothing runs, so their values do not
    matter, and the model's own initialisation would cost a compile per configuration."""
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), np.int32)
    shapes = jax.eval_shape(train.make_model(config).init, jax.random.key(0), tokens)["params"]
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def dense_flops(config: train.Config, params: Any) -> int:
    """``model_flops`` of one step of ``config``'s model: the parameters that multiply activations (every kernel, an
    expert's by its share ``top_k / experts``, and the embedding table once, as the tied head) and attention."""
    active = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params)):
        keys = [getattr(k, "key", None) for k in path]
        if keys[-1] in ("kernel", "embedding"):
            active += leaf.size * (config.top_k / config.experts if "experts" in keys else 1)
    tokens = config.batch_size * config.seq_len
    return model_flops(round(active), tokens, layers=config.layers, context=config.seq_len, width=config.width)


def group(scope: str) -> str:
    """The part of the model a scope belongs to: ``head`` (the tied embedding's ``attend``) or ``blocks`` (the
    rest: the model's other matmuls are the blocks', and some of them lose their scope in the optimised program, e.g.
    attention's einsums after an all-to-all or inside a pipeline's loop)."""
    return "head" if scope.endswith("embed.attend") else "blocks"


def table_shares(work: Work, pipeline: sc.Pipeline, stages: int) -> dict[str, tuple[float, ...]]:
    """Shares for :meth:`Work.weighted` of a table schedule's loop (1F1B, ZB-H1): each unit's ``lax.switch`` over
    the stage's action, by each action's share of the table's (unit, stage) cells (its branches are the actions
    present, in code order: idle, F, B or idle, F, I, W), and each per-micro-batch event's ``lax.cond`` (a micro-batch
    enters, its loss is computed, its cotangent leaves stage 0: ``m`` of the units each), true ``m / units`` of the
    time; inside each event, the ``lax.cond`` that runs the layers outside the stack on the rows' device, true on
    one device of the ``p`` stages. Every device runs the same program, so the mean over the stages times the
    devices is the mesh's total."""
    table = pipeline.table(stages)
    op = table.columns["op"]
    actions = tuple(float(np.mean(op == code)) for code in np.unique(op))
    event = pipeline.microbatches / table.units
    shares: dict[str, tuple[float, ...]] = {}
    for c in work.conditionals:
        if one_f_one_b.ROWS_DEVICE in c.scope.split("/"):  # inside an event: true on the rows' device, 1 of p
            shares[c.name] = (1 - 1 / stages, 1 / stages)
        elif c.runs % table.units == 0 and len(c.flops) == len(actions):
            shares[c.name] = actions
        elif c.runs % table.units == 0 and len(c.flops) == 2:
            shares[c.name] = (1 - event, event)
    return shares


def grouped(by_scope: dict[str, float], devices: int) -> dict[str, float]:
    """FLOPs over ``devices`` devices by :func:`group`."""
    out: dict[str, float] = {}
    for scope, flops in by_scope.items():
        out[group(scope)] = out.get(group(scope), 0) + flops * devices
    return out


def explain(config: train.Config, params: Any, layout: Layout | None) -> Work:
    """The work of the example's step for ``config`` on ``layout`` (``None``: one device), ``sc.explain``'s: as
    counted, or for a table schedule weighted by its table (:func:`table_shares`)."""
    mesh = mesh_of(layout.mesh if layout else "data=1")
    pipeline = layout.pipeline() if layout and layout.pipeline else None
    state, step = train.build_state(config, mesh, params=params, pipeline=pipeline)
    rows, length = config.batch_size, config.seq_len
    batch = {"inputs": np.zeros((rows, length), np.int32), "targets": np.zeros((rows, length), np.int32)}
    work = sc.explain(step, state, batch).work
    if pipeline is not None and pipeline.schedule != "gpipe":
        work = work.weighted(table_shares(work, pipeline, mesh.shape[train.PIPELINE_AXIS]))
    return work


def measure(names: list[str], size: dict[str, int], experts: int, top_k: int) -> list[dict[str, Any]]:
    """One row per layout in ``names``, each against the one-device step of the same model (dense or MoE), which
    comes first."""
    rows = []
    references: dict[bool, tuple[Any, Work, int]] = {}
    for name in names:
        layout = LAYOUTS[name]
        model = dict(size, experts=experts, top_k=top_k) if layout.moe else dict(size)
        base = train.Config(**model)
        if layout.moe not in references:
            params, t0 = zeros_like_init(base), time.perf_counter()
            one = explain(base, params, None)
            dense = dense_flops(base, params)
            references[layout.moe] = (params, one, dense)
            rows.append(row("one device" + (" moe" if layout.moe else ""), "data=1", one, one, dense))
            print(f"{rows[-1]['layout']}: {time.perf_counter() - t0:.1f} s", flush=True)
        params, one, dense = references[layout.moe]
        microbatches = M if layout.pipeline else 1
        config = dataclasses.replace(base, mesh=layout.mesh, microbatches=microbatches, **layout.config)
        t0 = time.perf_counter()
        rows.append(row(name, layout.mesh, explain(config, params, layout), one, dense))
        print(f"{name}: ratio {rows[-1]['vs_one_device']:.4f}, {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def row(name: str, mesh: str, work: Work, one: Work, dense: int) -> dict[str, Any]:
    """The JSON row of ``work`` against the one-device step's ``one`` and the model FLOPs ``dense``."""
    mine, ref = grouped(work.by_scope, work.devices), grouped(one.by_scope, 1)
    excess = {g: (mine.get(g, 0) - ref.get(g, 0)) / one.total for g in sorted(set(mine) | set(ref))}
    return {
        "layout": name,
        "mesh": mesh,
        "devices": work.devices,
        "flops_per_device": work.flops,
        "flops_total": work.total,
        "vs_one_device": work.total / one.total,
        "vs_model_flops": work.total / dense,
        "model_flops": dense,
        "bound": work.bound,
        "excess": {g: round(v, 4) for g, v in excess.items()},
        "by_scope": work.by_scope,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the markdown table of docs/explain.md."""
    lines = [
        "| layout | mesh | GFLOP per device | GFLOP over the mesh | vs one device | vs model FLOPs | bound | excess "
        "(blocks / head) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        ex = r["excess"]
        parts = " / ".join(f"{100 * ex.get(g, 0):+.1f}%" for g in ("blocks", "head"))
        lines.append(
            f"| {r['layout']} | `{r['mesh']}` | {r['flops_per_device'] / 1e9:.2f} | {r['flops_total'] / 1e9:.2f} | "
            f"{r['vs_one_device']:.3f} | {r['vs_model_flops']:.3f} | {r['bound']} | {parts} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dense = [n for n, layout in LAYOUTS.items() if not layout.moe]
    parser.add_argument("--layouts", default=",".join(dense), help="a subset of " + ",".join(LAYOUTS))
    parser.add_argument("--experts", type=int, default=0, help="> 0: add the MoE layouts, this many experts")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny model: checks that everything runs")
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("--devices", type=int, default=8)  # read by set_cpu_devices
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    names = args.layouts.split(",")
    names += [n for n, layout in LAYOUTS.items() if layout.moe and args.experts and n not in names]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}: choose from {list(LAYOUTS)}")
    if any(LAYOUTS[n].moe for n in names) and not args.experts:
        parser.error("the moe layouts need --experts")
    size = SMOKE if args.smoke else DEFAULT
    rows = measure(names, size, args.experts, args.top_k)
    table = markdown(rows)
    if args.markdown:
        print(table)
    write_json(args.json, {**run_facts(), "model": size, "microbatches": M, "rows": rows, "markdown": table})


if __name__ == "__main__":
    main()
