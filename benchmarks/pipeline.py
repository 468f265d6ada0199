"""Pipeline parallelism: memory per device from the compiled step, and samples/s next to DDP, FSDP and the
hand-written ``shard_map`` GPipe program a JAX user writes instead.

Run: ``python benchmarks/pipeline.py [--rounds 7] [--steps 2] [--batch 1024] [--variants A,B] [--skip-memory]
[--skip-speed] [--smoke] [--json PATH]``.

The model: a dense embedding (``features`` -> ``width``), ``sc.PipelineStack`` of ``L`` pre-LayerNorm residual
MLP blocks (``width`` -> ``hidden`` -> ``width``, GELU), a final LayerNorm and a dense head to ``classes`` logits,
cross-entropy, Adam. The full setting: width 256, hidden 1024, L = 8 (4.2 M stacked parameters), 128 features,
10 classes, global batch 1024; ``--smoke``: width 32, hidden 64, L = 4, batch 64, one round of one step, m = 4
only, what its check reads (speed: DDP, the hand-written GPipe, the jit program and ours; temporaries: GPipe, DDP,
the hand-written and the jit program).
8 fake CPU devices; pipelines on ``data 2 x stage 4`` (p = 4 stages, N = 2 replicas).
The batch is 1024 rather than 256 because at 256 the step's cost on fake devices is mostly what does not grow
with the batch (DDP's step on 8 rows took 0.6-0.7 of its time on 256): the bubble, which is compute, hid in it.

Memory, from the compiled step (``sc.explain(step, state, batch)``: ``.memory``, ``.pipeline``;
``state.memory()``), per device; the tables print as markdown, ready for docs/pipeline.md:

- the stacked layers' parameters + Adam state against the whole stack's, with the step's temporaries and peak.
  Goals: 1/p = 0.25 with DDP over ``data`` and 1/(p N) = 0.125 with FSDP over ``data`` (GPipe, m = 8, remat;
  FSDP also with ``reshard_after_forward=False``, whose temporaries keep the pipeline's remat); DDP on
  ``data 8`` holds the whole stack;
- the step's temporaries (its activation peak) for m = 4, 8, 16, GPipe with ``remat=True`` and ``remat=False``,
  1F1B and ZB-H1 (and interleaved 1F1B, v = 2, at m = 8), with the micro-batch chunks each keeps and the forward
  passes it recomputes (``explain``), next to DDP on ``data 8`` and the hand-written program at m = 8 with and
  without remat; and each step's matmul FLOPs per device (:func:`step_flops`: XLA's cost analysis counts a loop's
  body once, so the FLOPs are read from the HLO, each loop body times its trip count, each branch of a table
  schedule by its share of the units).

Speed: the variants are interleaved round by round (the order reversed every other round, each of ours next to
the hand-written program it is compared with), each number is a median over rounds, each ratio the median over
rounds of that round's ratio; every loop keeps at most 8 steps in flight (``_common.time_calls``):

- ours on ``data 2 x stage 4``: GPipe with m = 4 and m = 8, each with and without remat (ours defaults to
  ``remat=True``), the circular schedule with v = 2, m = 8, and 1F1B, interleaved 1F1B (v = 2) and ZB-H1 with
  m = 8 (which recompute nothing: set against the programs without remat);
- the hand-written GPipe program (:func:`handwritten`) with the same four m / remat settings;
- DDP of the same model on ``data 8`` (no stage axis: the stack runs as a scan), with each layer rematerialised
  and without (the stack's own default); FSDP on ``data 8``; and DDP on 8 rows (one per device), the part of
  DDP's step that does not grow with the batch (Adam on every device's copy of the parameters, the gradient
  all-reduce, reading the weights).

Every variant but the last is first checked to train the same model as DDP (its first two losses: the first
within 1e-4, the second, which goes through the gradients and Adam, within 1e-3). Goal: ours at least as fast as
the hand-written program of the same m and remat (ratio >= 1 up to the machine's noise; the circular schedule is
compared with the hand-written GPipe). The step time relative to DDP with the same remat is set against the bubble
formula ``(v m + p - 1) / (v m)``, and each pipeline's time relative to the same program at m = 8 against the
formula's ratio, which leaves out what the schedule does not change (embedding, head, Adam, the all-reduce).

What fake CPU devices can and cannot show. The 8 devices are threads sharing the machine's cores (2 here): a step
costs about its total work, and a bubble tick, which computes on zeros, costs what a real tick costs, so the
bubble shows up as extra work, not as idle time. Stages never run at the same time on their own hardware, and a
``ppermute`` is a memory copy on the same cores that no compute can hide behind, so the overlap of stages and of
transfers with compute, which is what a pipeline is for on accelerators, cannot be measured here; nor can the
cost of real links (DDP's all-reduce is also a copy here). What can be measured is the schedule's work and
overhead against the hand-written program's, the bubble's cost against the formula, and the memory per device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import time
from pathlib import Path

from _common import jit_once, run_facts, set_cpu_devices, step_caller, time_calls, write_json

set_cpu_devices(8)  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.core import meta  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmdcomm as sc  # noqa: E402

LR = 1e-4
PIPELINE_MESH = {"data": 2, "stage": 4}
FLAT_MESH = {"data": 8}
MEMORY_MICROBATCHES = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 256
    hidden: int = 1024
    layers: int = 8
    features: int = 128
    classes: int = 10
    batch: int = 1024


# The smoke setting: one block per stage (what every table needs; more blocks only lengthen each compile).
FULL, SMOKE = Config(), Config(width=32, hidden=64, layers=4, features=16, batch=64)


class Block(nn.Module):
    """A pre-LayerNorm residual MLP block: ``x + Dense(width)(gelu(Dense(hidden)(LayerNorm(x))))``."""

    width: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.hidden)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class Net(nn.Module):
    """Embedding, a ``PipelineStack`` of ``layers`` blocks, LayerNorm and a dense head. ``remat``: the stack's own
    setting, for the plain scan it runs as without a stage axis (a pipeline has its own)."""

    cfg: Config
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        h = nn.Dense(cfg.width, name="embed")(x)
        h = sc.PipelineStack(Block(cfg.width, cfg.hidden), layers=cfg.layers, remat=self.remat, name="stack")(h)
        return nn.Dense(cfg.classes, name="head")(nn.LayerNorm(name="norm")(h))


def data(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((cfg.batch, cfg.features)).astype(np.float32),
        "y": rng.integers(0, cfg.classes, cfg.batch).astype(np.int32),
    }


@functools.cache
def init_params(cfg: Config) -> dict:
    """The model's parameters as NumPy arrays, the stacked leaves still boxed (``TrainState.create`` reads the
    boxes: dimension 0 of the stack is the layers). Made once: every variant starts from these."""
    params = jit_once(Net(cfg).init)(jax.random.PRNGKey(0), data(cfg)["x"][:2])["params"]
    return jax.tree.map(np.asarray, params)


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["x"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)


TX = optax.adam(LR)  # one transformation and one step: states of one layout share a compiled program
STEP = sc.make_train_step(loss_fn)
_STATES: dict = {}


def new_state(
    cfg: Config, strategy: str = "ddp", m: int | None = None, v: int = 1, remat: bool = True, schedule: str = "gpipe"
):
    """Our state of ``strategy`` on ``data 8`` (``m`` None; the stack a scan rematerialising each layer with
    ``remat``) or with ``sc.Pipeline(m, repeats=v, remat=remat, schedule=schedule)`` on ``data 2 x stage 4``."""
    return sc.TrainState.create(
        params=init_params(cfg),
        apply_fn=Net(cfg, remat=remat and m is None).apply,
        tx=TX,
        mesh=sc.make_mesh(FLAT_MESH if m is None else PIPELINE_MESH),
        strategy=strategy,
        pipeline=None if m is None else sc.Pipeline(microbatches=m, repeats=v, remat=remat, schedule=schedule),
    )


def state_for(
    cfg: Config, strategy: str = "ddp", m: int | None = None, v: int = 1, remat: bool = True, schedule: str = "gpipe"
):
    """:func:`new_state`, made once and kept, so that the memory tables and the speed loop compile its step once
    (a speed runner takes it: its steps consume it)."""
    key = (cfg, strategy, m, v, remat, schedule)
    if key not in _STATES:
        _STATES[key] = new_state(*key)
    return _STATES[key]


# --- the hand-written GPipe program ------------------------------------------------------------------------


@functools.cache
def handwritten(cfg: Config, m: int, remat: bool = False):
    """The GPipe program a JAX user writes by hand, on ``data 2 x stage 4``: ``(step, start)``;
    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` donates its first two arguments, and
    ``start()`` places the initial parameters, Adam state and the batch: ``(params, opt_state, batch)``.

    One ``jax.jit`` of a ``jax.shard_map`` manual over both axes. The stacked weights ``[L, ...]`` are split over
    ``stage`` (stage s holds layers ``[s L/p, (s+1) L/p)``), everything else is replicated, and the batch is split
    over ``data`` only: every stage of a replica holds the replica's rows and embeds them all. The embedded rows
    are cut into ``m`` micro-batches; a ``lax.scan`` over ``m + p - 1`` ticks lets stage 0 take micro-batch ``t``
    at tick ``t`` and every other stage what its left neighbour passed it (one non-cyclic ``ppermute`` per tick),
    and the last stage writes micro-batch ``t - p + 1`` into an output buffer. After the loop a ``psum`` over
    ``stage`` of the last stage's buffer gives every stage the outputs, and each computes the head and the loss
    (the replica's mean). ``jax.grad`` of that loss, a ``pmean`` of the gradients over ``data``, Adam, in the same
    program. Parameters are cast to varying over ``data`` once at the top and the embedded rows to varying over
    ``stage`` before the loop, so that the gradient reductions stay outside the loops (one ``psum`` over
    ``stage`` of the embedding's cotangent, one ``pmean`` per parameter over ``data``). ``remat``: each tick's
    layers are rematerialised in the backward pass (``jax.checkpoint``), as ours does by default.
    """
    mesh = sc.make_mesh(PIPELINE_MESH)
    p = mesh.shape["stage"]
    block, embed, norm = Block(cfg.width, cfg.hidden), nn.Dense(cfg.width), nn.LayerNorm()
    head = nn.Dense(cfg.classes)
    params = meta.unbox(init_params(cfg))
    specs = jax.tree.map(lambda _: P(), params)  # replicated, but the stack: split over "stage" by layers
    specs["stack"] = jax.tree.map(lambda _: P("stage"), params["stack"])

    def stage_layers(layers, h):
        def one(h, layer):
            return block.apply({"params": layer}, h), None

        return lax.scan(one, h, layers)[0]

    run = jax.checkpoint(stage_layers) if remat else stage_layers

    def loss(params, x, y):
        s = lax.axis_index("stage")
        h = embed.apply({"params": params["embed"]}, x)
        rows = h.shape[0]
        inputs = lax.pcast(h.reshape(m, rows // m, cfg.width), "stage", to="varying")
        layers = params["stack"]["layers"]

        def tick(carry, t):
            received, outputs = carry
            h = jnp.where(s == 0, inputs[jnp.minimum(t, m - 1)], received)
            out = run(layers, h)
            j = t - (p - 1)  # the micro-batch the last stage finishes at this tick
            write = (s == p - 1) & (j >= 0)
            outputs = outputs.at[j % m].set(jnp.where(write, out, outputs[j % m]))
            received = lax.ppermute(out, "stage", [(i, i + 1) for i in range(p - 1)])
            return (received, outputs), None

        carry = (jnp.zeros_like(inputs[0]), jnp.zeros_like(inputs))
        (_, outputs), _ = lax.scan(tick, carry, jnp.arange(m + p - 1))
        outputs = lax.psum(jnp.where(s == p - 1, outputs, 0.0), "stage").reshape(rows, cfg.width)
        logits = head.apply({"params": params["head"]}, norm.apply({"params": params["norm"]}, outputs))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def body(params, opt_state, batch):
        local = lax.pcast(params, "data", to="varying")
        value, grads = jax.value_and_grad(loss)(local, batch["x"], batch["y"])
        value, grads = lax.pmean((value, grads), "data")
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_specs = _opt_specs(params, specs)
    batch_specs = {"x": P("data"), "y": P("data")}
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, opt_specs, batch_specs), out_specs=(specs, opt_specs, P()))
    return jax.jit(mapped, donate_argnums=(0, 1)), _start(cfg, mesh, params, specs, opt_specs, batch_specs)


@functools.cache
def jit_program(cfg: Config):
    """The program ``jax.jit`` gives a JAX user who splits the stacked layers over ``stage`` and leaves the rest to
    XLA, on ``data 2 x stage 4``: ``(step, start)`` as :func:`handwritten`. The model is the plain scan over its
    layers (each rematerialised, as DDP's default here), the stacked weights ``NamedSharding`` ``P("stage")``, the
    rest replicated, the batch split over ``data`` and ``stage``; one ``jax.jit`` of the loss's gradient and Adam,
    and XLA inserts the collectives. No schedule: what XLA does with layers split over devices (it moves the
    weights to the rows, not micro-batches through the stages)."""
    mesh = sc.make_mesh(PIPELINE_MESH)
    net = Net(cfg, remat=True)
    params = meta.unbox(init_params(cfg))
    specs = jax.tree.map(lambda _: P(), params)
    specs["stack"] = jax.tree.map(lambda _: P("stage"), params["stack"])
    opt_specs = _opt_specs(params, specs)
    batch_specs = {"x": P(("data", "stage")), "y": P(("data", "stage"))}

    def step(params, opt_state, batch):
        def loss(params):
            logits = net.apply({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    shard = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)
    shardings = (shard(specs), shard(opt_specs), shard(batch_specs))
    jitted = jax.jit(step, in_shardings=shardings, out_shardings=shardings[:2] + (None,), donate_argnums=(0, 1))
    return jitted, _start(cfg, mesh, params, specs, opt_specs, batch_specs)


def _opt_specs(params, specs):
    """Adam's state split as the parameters are (its count replicated)."""
    return optax.tree_map_params(TX, lambda _, spec: spec, TX.init(params), specs, transform_non_params=lambda _: P())


def _start(cfg: Config, mesh, params, specs, opt_specs, batch_specs):
    """``start()``: the initial parameters, Adam state and batch, placed as the specs say."""
    shard = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)
    init = jax.jit(TX.init, out_shardings=shard(opt_specs))

    def start():
        placed = jax.device_put(params, shard(specs))
        return placed, init(placed), jax.device_put(data(cfg), shard(batch_specs))

    return start


# --- runners: each returns run(steps) -> seconds --------------------------------------------------------------


def ours_runner(cfg: Config, state: sc.TrainState, rows: int = 0):
    """``run(steps) -> seconds`` for our steps from ``state`` on one placed batch (its first ``rows`` rows, all
    with 0); ``run.losses(n)``: the losses of ``n`` steps."""
    batch = {k: v[: rows or None] for k, v in data(cfg).items()}
    call = step_caller(STEP, state, jax.device_put(batch, sc.data_sharding(mesh=state.mesh, axis=state.axis)))

    def run(n: int) -> float:
        return time_calls(call, n)

    run.losses = lambda n: [float(call()["loss"]) for _ in range(n)]
    return run


def program_runner(step, start):
    """The steps of a program made by :func:`handwritten` or :func:`jit_program` on one placed batch, as
    :func:`ours_runner`."""
    params, opt_state, batch = start()
    holder = {"p": params, "o": opt_state}

    def call():
        holder["p"], holder["o"], loss = step(holder["p"], holder["o"], batch)
        return loss

    def run(n: int) -> float:
        return time_calls(call, n)

    run.losses = lambda n: [float(call()) for _ in range(n)]
    return run


@dataclasses.dataclass(frozen=True)
class Variant:
    """A speed variant: ``kind`` "ours", "handwritten" (both GPipe or circular on ``data 2 x stage 4``; ours also
    1F1B, ``schedule="1f1b"``), "jit" (:func:`jit_program`, no schedule, on ``data 2 x stage 4``), "ddp" or "fsdp"
    (on ``data 8``)."""

    kind: str
    m: int = 0
    v: int = 1
    remat: bool = True
    rows: int = 0  # the global batch's first rows only (0: all of them)
    schedule: str = "gpipe"

    @property
    def name(self) -> str:
        if self.kind in ("ddp", "fsdp"):
            name = f"{self.kind} data=8"
        elif self.kind == "jit":
            name = "jit + NamedSharding stage=4"
        else:
            schedule = {"1f1b": "1F1B", "zb-h1": "ZB-H1"}.get(self.schedule, "GPipe")
            if self.v > 1:
                schedule = f"interleaved {schedule}" if self.schedule != "gpipe" else "circular"
                schedule += f" v={self.v}"
            name = f"{'ours' if self.kind == 'ours' else 'hand-written'} {schedule} m={self.m}"
        remat = self.remat or self.schedule != "gpipe"  # the tables' schedules recompute nothing: no remat to name
        return name + ("" if remat else " no remat") + (f" batch={self.rows}" if self.rows else "")

    @property
    def pipelined(self) -> bool:
        return self.kind in ("ours", "handwritten")

    @property
    def baseline(self) -> str | None:
        """The hand-written program ours is compared with: GPipe of the same m and remat."""
        return Variant("handwritten", self.m, 1, self.remat).name if self.kind == "ours" else None

    @property
    def ddp(self) -> str:
        """DDP with the same remat: the stack as a scan, each layer rematerialised or not."""
        return Variant("ddp", remat=self.remat).name

    @property
    def reference(self) -> str | None:
        """The same program's GPipe with m = 8 and the same remat: the bubble's cost, within one program."""
        return Variant(self.kind, 8, 1, self.remat).name if self.pipelined else None

    def bubble_factor(self, stages: int) -> float | None:
        """The bubble formula's step time against a step without one, ``(v m + p - 1) / (v m)`` (1F1B's too)."""
        return (self.v * self.m + stages - 1) / (self.v * self.m) if self.pipelined else None

    def runner(self, cfg: Config):
        if self.kind == "handwritten":
            return program_runner(*handwritten(cfg, self.m, self.remat))
        if self.kind == "jit":
            return program_runner(*jit_program(cfg))
        if self.rows:  # a step of other shapes: a state of its own
            return ours_runner(cfg, new_state(cfg, self.kind, remat=self.remat), self.rows)
        ours = (cfg, "ddp", self.m, self.v, self.remat, self.schedule)
        key = ours if self.kind == "ours" else (cfg, self.kind, None, 1, self.remat, "gpipe")
        state_for(*key)
        return ours_runner(cfg, _STATES.pop(key))  # its steps consume it


VARIANTS = {
    v.name: v
    for v in [
        Variant("ddp"),
        Variant("ddp", remat=False),  # the stack's own default
        Variant("ddp", rows=8),  # one row per device: the step's cost that does not scale with the batch
        Variant("fsdp"),
        # Each of ours next to the hand-written program it is compared with (closest in time in every round).
        *(Variant(kind, 4, 1, remat) for remat in (True, False) for kind in ("handwritten", "ours")),
        Variant("handwritten", 8, 1, True),
        Variant("ours", 8, 1, True),
        Variant("jit"),  # the stacked layers split over "stage" with no schedule: XLA decides
        Variant("ours", 8, 2, True),
        Variant("handwritten", 8, 1, False),
        Variant("ours", 8, 1, False),
        # The tables' schedules recompute nothing: next to the hand-written program without remat.
        Variant("ours", 8, 1, False, schedule="1f1b"),
        Variant("ours", 8, 2, False, schedule="1f1b"),
        Variant("ours", 8, 1, False, schedule="zb-h1"),
    ]
}
JIT = Variant("jit").name
# What the smoke check reads: ours against the hand-written program and the jax.jit + NamedSharding program, and
# DDP (every variant's reference).
SMOKE_VARIANTS = ["ddp data=8", "hand-written GPipe m=4 no remat", "ours GPipe m=4 no remat", JIT]


def check_same_model(runs: dict, steps: int) -> dict[str, list[float]]:
    """The first ``steps`` losses of every variant; raises unless each equals DDP's (first step within 1e-4, the
    later ones, which test the gradients and Adam, within 1e-3). A variant on fewer rows only warms up."""
    losses = {name: run.losses(steps) for name, run in runs.items()}
    reference = losses["ddp data=8"]
    for name, values in losses.items():
        if VARIANTS[name].rows:
            continue
        first, later = abs(values[0] - reference[0]), max(abs(a - b) for a, b in zip(values, reference, strict=True))
        if first > 1e-4 or later > 1e-3:
            raise AssertionError(f"{name} does not train the same model as DDP: losses {values} against {reference}")
    return losses


def speed(cfg: Config, names: list[str], rounds: int, steps: int) -> dict:
    """Samples/s of each variant of ``names``, interleaved; medians and paired ratios (module docstring)."""
    runs = {name: VARIANTS[name].runner(cfg) for name in names}
    losses = check_same_model(runs, 2)  # also compiles and warms up every variant
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # reversed every other round: no order bias
            seconds[name].append(runs[name](steps) / steps)
    stages = PIPELINE_MESH["stage"]
    t = {name: np.array(values) for name, values in seconds.items()}
    out = {}
    for name in names:
        variant = VARIANTS[name]
        ddp = variant.ddp if variant.ddp in t else "ddp data=8"  # DDP with the same remat where it ran
        row = {
            "samples_per_s": float(np.median((variant.rows or cfg.batch) / t[name])),
            "ms_per_step": float(np.median(t[name]) * 1e3),
            "ddp": ddp,
            "ratio_vs_ddp": float(np.median(t[ddp] / t[name])),  # of speeds: > 1 is faster than DDP
            "time_vs_ddp": float(np.median(t[name] / t[ddp])),
            "first_losses": losses[name],
        }
        if variant.pipelined:
            row.update(m=variant.m, v=variant.v, remat=variant.remat, bubble_formula=variant.bubble_factor(stages))
        if variant.baseline in t:
            row["baseline"] = variant.baseline
            row["ratio_vs_handwritten"] = float(np.median(t[variant.baseline] / t[name]))
        if variant.pipelined and JIT in t:
            row["ratio_vs_jit"] = float(np.median(t[JIT] / t[name]))
        if variant.reference in t:
            row["reference"] = variant.reference
            row["time_vs_reference"] = float(np.median(t[name] / t[variant.reference]))
            reference_bubble = VARIANTS[variant.reference].bubble_factor(stages)
            row["bubble_formula_vs_reference"] = row["bubble_formula"] / reference_bubble
        out[name] = row
    return out


# --- memory --------------------------------------------------------------------------------------------------


def device_bytes(leaves) -> int:
    """Bytes of ``leaves``' shards on one device: the largest, where devices hold different amounts."""
    per: dict = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


#: The layouts of the stack memory table: (strategy label, strategy, pipelined, goal fraction of the stack).
STACK_LAYOUTS = [
    ("ddp", "ddp", False, 1.0),
    ("ddp", "ddp", True, 1 / 4),
    ("fsdp", "fsdp", True, 1 / 8),
    # FSDP's default (reshard_after_forward=True) runs the step under a jax.checkpoint policy that keeps every
    # computed value, which also keeps what the pipeline's remat would drop; without it the remat holds.
    ("fsdp reshard_after_forward=False", sc.FSDP(reshard_after_forward=False), True, 1 / 8),
]


def stack_memory(cfg: Config, m: int, *, remat: bool = True, compiled: bool = True, layouts=STACK_LAYOUTS) -> list:
    """Per device, the stacked layers' parameters + Adam state against the whole stack's, for each of ``layouts``:
    DDP on ``data 8`` (no stage axis: every device holds the stack), and DDP and FSDP with GPipe (``m``
    micro-batches, ``remat``) on ``data 2 x stage 4`` (module docstring); with ``compiled``, the compiled step's
    arguments, temporaries and peak (their sum)."""
    batch = data(cfg)
    whole = 3 * sum(x.nbytes for x in jax.tree.leaves(meta.unbox(init_params(cfg)["stack"])))  # params, mu, nu
    rows = []
    for label, strategy, pipelined, goal in layouts:
        # (DDP on data 8 with the same remat: the same state as the speed loop's.)
        state = state_for(cfg, strategy, m if pipelined else None, remat=remat)
        if pipelined:
            axis = state.pipeline.axis
            flags = state.layout.stacked_over(axis, "params") + state.layout.stacked_over(axis, "opt")
        else:  # no stage axis: the stack is the "stack" subtree of the parameters and of Adam's moments
            flags = [any(getattr(k, "key", None) == "stack" for k in path) for path, _ in _paths(state)]
        every = jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)
        memory = state.memory()
        row = {
            "layout": " x ".join(f"{k} {v}" for k, v in state.mesh.shape.items()),
            "strategy": label,
            "pipeline": None if state.pipeline is None else repr(state.pipeline),
            "stack_bytes_per_device": device_bytes([x for x, flag in zip(every, flags, strict=True) if flag]),
            "stack_bytes_whole": whole,
            "goal_fraction": goal,
            "state_bytes_per_device": memory.params + memory.opt_state,
        }
        row["fraction"] = row["stack_bytes_per_device"] / whole
        row["goal_met"] = abs(row["fraction"] - goal) < 1e-9
        if compiled:
            report = sc.explain(STEP, state, batch)
            row.update(argument_bytes=report.memory.argument_bytes, temp_bytes=report.memory.temp_bytes)
            row["peak_bytes"] = row["argument_bytes"] + row["temp_bytes"]
            if report.pipeline is not None:
                row["explain_stacked_param_bytes"] = report.pipeline.stacked_bytes
                row["explain_stack_param_bytes"] = report.pipeline.stack_bytes
                row["stage_gathers"] = report.pipeline.stage_gathers
        rows.append(row)
    return rows


def _paths(state: sc.TrainState) -> list:
    """(path, leaf) of the state's parameters, then of its optimizer state."""
    return jax.tree_util.tree_leaves_with_path(state.params) + jax.tree_util.tree_leaves_with_path(state.opt_state)


def activation_memory(
    cfg: Config,
    microbatches: tuple[int, ...],
    handwritten_: tuple[tuple[int, bool], ...],
    ddp_remats: tuple[bool, ...] = (True, False),
    *,
    smoke: bool = False,
) -> list[dict]:
    """The compiled step's temporaries (its activation peak) per device for each m, GPipe with and without remat
    and 1F1B, on ``data 2 x stage 4``, then DDP on ``data 8`` (each remat of ``ddp_remats``), the hand-written
    program (each ``(m, remat)`` of ``handwritten_``) and the ``jax.jit`` program for reference; each set against
    DDP's with the same remat. ``smoke``: GPipe only (what the smoke check reads)."""
    batch = data(cfg)
    rows = []
    for m in microbatches:
        tables = [Variant("ours", m, 1, False, schedule=s) for s in ("1f1b", "zb-h1")]
        for variant in (
            Variant("ours", m),
            Variant("ours", m, remat=False),
            *([] if smoke else tables),
            *([Variant("ours", m, 2, False, schedule="1f1b")] if m == 8 else []),
        ):
            state = state_for(cfg, "ddp", m, variant.v, remat=variant.remat, schedule=variant.schedule)
            report = sc.explain(STEP, state, batch)
            pipe = report.pipeline
            rows.append(
                {
                    "variant": variant.name,
                    "m": m,
                    "remat": variant.remat,
                    "schedule": variant.schedule,
                    "ticks": pipe.ticks,
                    "bubble": pipe.bubble,
                    "in_flight": pipe.in_flight,
                    "kept": pipe.kept,
                    "recomputed": pipe.recomputed,
                    "permutes": pipe.permutes,
                    "permute_bytes": pipe.permute_bytes,
                    "stage_gathers": pipe.stage_gathers,
                    "argument_bytes": report.memory.argument_bytes,
                    "temp_bytes": report.memory.temp_bytes,
                    "flops": schedule_flops(report, state.pipeline, PIPELINE_MESH["stage"]),
                }
            )
    for remat in ddp_remats:
        report = sc.explain(STEP, state_for(cfg, "ddp", remat=remat), batch)
        rows.append(
            {
                "variant": Variant("ddp", remat=remat).name,
                "remat": remat,
                "argument_bytes": report.memory.argument_bytes,
                "temp_bytes": report.memory.temp_bytes,
                "flops": schedule_flops(report, None, PIPELINE_MESH["stage"]),
            }
        )
    programs = [(Variant("handwritten", m, 1, remat), handwritten(cfg, m, remat)) for m, remat in handwritten_]
    for variant, (step, start) in [*programs, (Variant("jit"), jit_program(cfg))]:
        compiled = step.lower(*start()).compile()
        analysis = compiled.memory_analysis()
        rows.append(
            {
                "variant": variant.name,
                "m": variant.m,
                "remat": variant.remat,
                "argument_bytes": int(analysis.argument_size_in_bytes),
                "temp_bytes": int(analysis.temp_size_in_bytes),
                "flops": step_flops(compiled.as_text(), [], 0.0),
            }
        )
    ddp_temp = {r["remat"]: r["temp_bytes"] for r in rows if r["variant"].startswith("ddp")}
    for row in rows:
        row["temp_vs_ddp"] = row["temp_bytes"] / ddp_temp.get(row["remat"], ddp_temp[True])
    return rows


# --- work per step ----------------------------------------------------------------------------------------

_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .*\{$")
_PARAM = re.compile(r"([\w.-]+): \w+\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (?:\w+\[([\d,]*)\]\S*|\(.*?\)) ([\w-]+)\((.*?)\)(.*)$")


def step_flops(hlo: str, switch: list[float], event: float) -> float:
    """The matmul FLOPs one device runs per step, read from the optimised HLO ``hlo``: ``2 * rows * columns *
    contracted`` per ``dot``, each ``while`` body counted its known trip count times (XLA's cost analysis counts a
    loop body once), each ``conditional`` branch weighted by the share of the loop's units it runs: a table
    schedule's action switch (3 or 4 branches) by ``switch`` (idle, F, B or idle, F, I, W: the table's counts per
    stage over its units, the same on every stage), its events (2 branches: input, loss, back) by ``event`` (m
    of the units)."""
    shapes: dict[str, list[int]] = {}
    bodies: dict[str, list[tuple[str, list[int], str, str, str]]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            bodies[current] = []
            for name, dims in _PARAM.findall(header.group(2)):
                shapes[f"{current}/{name}"] = [int(d) for d in dims.split(",") if d]
            continue
        found = _INSTRUCTION.match(line)
        if current is None or not found:
            continue
        name, dims, op, operands, attributes = found.groups()
        shapes[f"{current}/{name}"] = [int(d) for d in (dims or "").split(",") if d]
        bodies[current].append((name, shapes[f"{current}/{name}"], op, operands, attributes))

    @functools.cache
    def flops(computation: str) -> float:
        total = 0.0
        for _, out, op, operands, attributes in bodies.get(computation, []):
            if op == "dot":
                lhs = shapes[f"{computation}/{operands.split(',')[0].strip().lstrip('%')}"]
                contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes).group(1)
                total += 2.0 * float(np.prod(out)) * float(np.prod([lhs[int(d)] for d in contracted.split(",") if d]))
            elif op == "while":
                body = re.search(r"body=%([\w.-]+)", attributes).group(1)
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', attributes)
                if trips is None:
                    raise ValueError(f"a while loop without a known trip count: {body}")
                total += int(trips.group(1)) * flops(body)
            elif op == "conditional":
                branches = re.findall(r"%([\w.-]+)", re.search(r"branch_computations=\{([^}]*)\}", attributes).group(1))
                weights = [1 - event, event] if len(branches) == 2 else switch
                total += sum(w * flops(b) for w, b in zip(weights, branches, strict=True))
            else:
                for called in re.findall(r"(?:calls|to_apply)=%([\w.-]+)", attributes):
                    total += flops(called)
        return total

    entry = next(line for line in hlo.splitlines() if line.startswith("ENTRY"))
    return flops(_HEADER.match(entry).group(1))


def schedule_flops(report, pipeline: sc.Pipeline | None, stages: int) -> float:
    """:func:`step_flops` of an explained step, the weights from ``pipeline``'s table (None or GPipe: no
    conditionals expected)."""
    if pipeline is None or pipeline.schedule == "gpipe":
        return step_flops(report.hlo, [], 0.0)
    table = pipeline.table(stages)
    op = table.columns["op"][:, 0]
    counts = [np.count_nonzero(op == a) for a in (0, 1, 2, 3, 4)]
    switch = [counts[0], counts[1], counts[2]] if table.kind == "1f1b" else [counts[0], counts[1], counts[3], counts[4]]
    return step_flops(report.hlo, [c / table.units for c in switch], pipeline.microbatches / table.units)


# --- report --------------------------------------------------------------------------------------------------


def tables(result: dict) -> str:
    """The result as markdown tables (the memory tables are the ones for docs/pipeline.md)."""
    kib = 1024
    cfg = result["config"]
    out = [
        f"Model: embedding {cfg['features']} -> {cfg['width']}, {cfg['layers']} residual MLP blocks "
        f"({cfg['width']} -> {cfg['hidden']} -> {cfg['width']}), head to {cfg['classes']}; Adam; global batch "
        f"{cfg['batch']}; {result['devices']} fake CPU devices on {result['cpu_cores']} cores, jax {result['jax']}.",
    ]
    if "stack_memory" in result:
        out += [
            "",
            "| layout | strategy | stack params + Adam state per device (KiB) | whole stack (KiB) | fraction | goal |"
            " params + optimizer state per device (KiB) | step temporaries (KiB) | peak (KiB) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    for r in result.get("stack_memory", []):
        out.append(
            f"| {r['layout']} | {r['strategy']} | {r['stack_bytes_per_device'] / kib:,.1f} |"
            f" {r['stack_bytes_whole'] / kib:,.1f} | {r['fraction']:.3f} | {r['goal_fraction']:.3f}"
            f" ({'met' if r['goal_met'] else 'MISSED'}) | {r['state_bytes_per_device'] / kib:,.1f} |"
            + "".join(f" {r[k] / kib:,.1f} |" if k in r else " |" for k in ("temp_bytes", "peak_bytes"))
        )
    if "activation_memory" in result:
        out += [
            "",
            "| step (data 2 x stage 4 unless named) | ticks / units | bubble | micro-batch chunks kept (what of each) |"
            " forwards recomputed | temporaries per device (KiB) | vs DDP data 8 (same remat) |"
            " matmul GFLOPs per device per step | vs GPipe with remat (same m) |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
    rows = result.get("activation_memory", [])
    remat_flops = {r["m"]: r["flops"] for r in rows if r.get("schedule") == "gpipe" and r["remat"]}
    for r in rows:
        ticks, recomputed = r.get("ticks", ""), r.get("recomputed", "")
        bubble = f"{r['bubble']:.3f}" if "bubble" in r else ""
        kept = f"{r['in_flight']} ({r['kept']})" if "in_flight" in r else ""
        versus = f"{r['flops'] / remat_flops[r['m']]:.2f}" if r.get("m") in remat_flops else ""
        out.append(
            f"| {r['variant']} | {ticks} | {bubble} | {kept} | {recomputed} | {r['temp_bytes'] / kib:,.1f} |"
            f" {r['temp_vs_ddp']:.2f} | {r['flops'] / 1e9:.2f} | {versus} |"
        )
    if "speed" in result:
        out += [
            "",
            "| variant | samples/s | ms/step | vs hand-written (same m, remat) | vs jit + NamedSharding |"
            " vs DDP (same remat) | time / DDP | bubble formula (v m + p - 1) / (v m) | time / same program at m = 8 |"
            " formula / formula at m = 8 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, r in result["speed"].items():
            cells = [
                f"{r['ratio_vs_handwritten']:.3f}" if "ratio_vs_handwritten" in r else "",
                f"{r['ratio_vs_jit']:.3f}" if "ratio_vs_jit" in r else "",
                f"{r['ratio_vs_ddp']:.3f}",
                f"{r['time_vs_ddp']:.2f}",
                f"{r['bubble_formula']:.3f}" if "bubble_formula" in r else "",
                f"{r['time_vs_reference']:.2f}" if "time_vs_reference" in r else "",
                f"{r['bubble_formula_vs_reference']:.3f}" if "bubble_formula_vs_reference" in r else "",
            ]
            out.append(f"| {name} | {r['samples_per_s']:,.0f} | {r['ms_per_step']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 round, a few variants")
    parser.add_argument("--variants", help="comma-separated subset of " + ", ".join(VARIANTS))
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--batch", type=int, help="the global batch (default 1024; 64 with --smoke)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = SMOKE if args.smoke else FULL
    cfg = dataclasses.replace(cfg, batch=args.batch) if args.batch else cfg
    names = args.variants.split(",") if args.variants else SMOKE_VARIANTS if args.smoke else list(VARIANTS)
    if "ddp data=8" not in names:
        names = ["ddp data=8", *names]
    start = time.perf_counter()
    result = {
        **run_facts(),
        "config": dataclasses.asdict(cfg),
        "mesh": PIPELINE_MESH,
    }
    if not args.skip_memory:
        smoke = args.smoke
        if smoke:
            result["stack_memory"] = stack_memory(cfg, 4, remat=False, compiled=False, layouts=STACK_LAYOUTS[:3])
        else:
            result["stack_memory"] = stack_memory(cfg, 8)
        microbatches = (4,) if smoke else MEMORY_MICROBATCHES
        handwritten_ = ((4, False),) if smoke else ((8, True), (8, False))
        ddp_remats = (True,) if smoke else (True, False)
        result["activation_memory"] = activation_memory(cfg, microbatches, handwritten_, ddp_remats, smoke=smoke)
    if not args.skip_speed:
        result["speed"] = speed(cfg, names, 1 if args.smoke else args.rounds, 1 if args.smoke else args.steps)
    result["seconds"] = time.perf_counter() - start
    result["markdown"] = tables(result)
    print(result["markdown"], flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
