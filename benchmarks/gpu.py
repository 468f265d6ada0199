"""Everything measured on one GPU, in one run of about 8 minutes: a JSON file with the device's name, and a plot.

    python benchmarks/gpu.py --out benchmarks/results      # on the GPU: results/gpu.json and results/gpu.png
    python benchmarks/gpu.py --tiny --out /tmp/gpu-tiny    # anywhere, CPU included: every section at a tiny size

It installs nothing and needs nothing beyond JAX (the ``gpu`` extra's, or any CUDA build), flax, optax, numpy and
pytest; matplotlib only for the plot (without it the JSON is still written). The checkout's ``spmdcomm`` is imported
whether or not it is installed. Sections, each bounded in time (a share of ``--budget``; what a section leaves
unused goes to the next ones), each recorded in the JSON with its status, seconds and result, or the error that
stopped it, so that one failing section never costs the others:

- ``prefetch``: the copy of a 16, 64 and 256 MiB batch hidden behind a step that takes 1.25 times that copy
  (``prefetch.py``'s ``Bench.hidden_transfer``): ``sc.prefetch_to_device`` (staging through pinned host memory
  where the device has it), the same without that staging ("ours pageable"), flax's ``prefetch_to_device``, a
  plain ``device_put`` loop ("none") and the batch already on the device ("preplaced", a zero-cost loader).
  hidden = (t_none - t_mode) / (t_none - t_preplaced); goal >= 0.9.
- ``train_step``: samples/s of DDP, ZeRO-1 and FSDP (``sc.make_train_step``) next to the plain ``jax.jit`` step
  on one device, MLP, CNN and the small transformer LM, interleaved (``strategies.py``'s ``speed``); goal: within
  3% of the jit step (ratio >= 0.97).
- ``memory``: ``sc.explain``'s memory figures (arguments + temporaries) next to what the device reports:
  ``memory_stats()["peak_bytes_in_use"]`` after compiling and running the step, one fresh process per program so
  that each peak is its own (``None`` where the device has no statistics, as on CPU).
- ``mfu``: model FLOPs utilisation in bfloat16 of ``examples/lm`` once it exists (until then its entry says it
  is not there), and of a stand-in: the benchmarks' transformer LM at a GPU size, our DDP step next to the plain
  ``jax.jit`` step. The FLOPs per step are ``sc.explain``'s count of the plain step's compiled program (its matrix
  multiplications: ``spmdcomm.explain.flops``); MFU = those FLOPs / step time / the GPU's bf16 dense peak (table
  ``PEAK_BF16``, or ``--peak-tflops``). Next to them: our step's own count (``ours_vs_jit_flops``: work our step
  adds), the formula's model FLOPs (6 x parameters that multiply activations x tokens + 12 x layers x sequence x
  width x tokens for attention, ``spmdcomm.explain.model_flops``) and XLA's cost analysis (which counts a loop body
  once).
- ``attention``: one causal attention's forward and backward pass, ms and compiled temporaries, of
  ``jax.nn.dot_product_attention`` against ``sc.ring_attention`` and ``sc.all_to_all_attention`` over a one-device
  axis, at sequences of 4096 to 32768 tokens in bf16.
- ``moe``: a dropless MoE layer's forward and backward pass (``sc.MoE``, 8 MLP experts, top-2, 16384 tokens of
  1024, bf16) over a one-device expert axis, its dispatch by ``sc.ragged_all_to_all``'s native implementation
  (``jax.lax.ragged_all_to_all``) against the padded one, and the collective alone: ms, tokens/s, compiled
  temporaries, native / padded. The values are checked (native against padded, the collective against NumPy):
  a difference beyond bf16's tolerance fails the section. Where the platform has no native collective (CPU) the
  entry says why, and the padded one alone is measured.
- ``weighted``: samples/s of our DDP step on the stand-in LM (2 layers) with a token-weighted loss
  (``sc.weighted``, a quarter of the targets padding) against the same step with a plain mean loss, and the ratio.
- ``suite``: ``pytest`` on the tests that hold on one device of any kind (``SUITE``: the 1-device
  parametrizations, ``-k 1dev``, and ``tests/test_prefetch_pinned.py``), with JAX on the default device.

Collectives on several GPUs (NCCL between devices and processes) need a machine with several; with one device
every collective is the identity, so nothing here measures them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # this checkout's spmdcomm, installed or not, before any installed copy
    sys.path.insert(1, str(ROOT))

from _common import jit_once, set_cpu_devices, step_caller, time_calls, write_json  # noqa: E402

SECTIONS = ("prefetch", "train_step", "memory", "mfu", "attention", "moe", "weighted", "suite")
# Each section's share of the time left when it starts, relative to the sections after it.
SHARES = {
    "prefetch": 0.19,
    "train_step": 0.14,
    "memory": 0.12,
    "mfu": 0.12,
    "attention": 0.09,
    "moe": 0.06,
    "weighted": 0.08,
    "suite": 0.2,
}
STRATEGIES = ("ddp", "zero1", "fsdp")
HIDDEN_GOAL, JIT_GOAL = 0.9, 0.97
MIN_SECTION_S = 5.0  # a section given less is recorded as skipped
# The tests that hold on one device of any kind: the 1-device parametrizations (1dev in their ids) and the
# pinned-staging tests, which take the accelerator's path on a GPU. This file's own test runs this script: left out.
SUITE = ("tests", "-k", "(1dev or test_prefetch_pinned) and not test_gpu_script")
# bf16 dense peak FLOP/s per GPU, from the vendors' datasheets (half the "with sparsity" figures); the first entry
# whose text is in jax.devices()[0].device_kind wins, so the more specific names come first.
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


@dataclasses.dataclass(frozen=True)
class Size:
    """How much each section does: the GPU run's sizes, or ``--tiny``'s."""

    prefetch_mib: tuple[int, ...] = (16, 64, 256)
    prefetch_steps: int = 20
    prefetch_reps: int = 3
    step_vs_copy: float = 1.25  # the synthetic step takes this many times the copy it should hide
    models: tuple[str, ...] = ("mlp", "cnn", "transformer")
    rounds: int = 11
    steps: int = 20
    lm: dict = dataclasses.field(
        default_factory=lambda: {"vocab": 32768, "width": 1024, "layers": 8, "heads": 16, "seq": 1024, "batch": 16}
    )
    lm_rounds: int = 5
    lm_steps: int = 10
    # examples/lm's step timed beside its plain jit program; False (--tiny): its model built and its model FLOPs
    # counted only, the timing being measure_mfu's, which the stand-in runs.
    examples_lm_timed: bool = True
    # Causal attention of one sequence, 16 heads of 128, at these lengths (the last ones are what rings are for).
    attention_lengths: tuple[int, ...] = (4096, 16384, 32768)
    attention_heads: tuple[int, int] = (16, 128)
    # One dropless top-k MoE layer of MLP experts: its tokens, width, the experts' hidden width, experts, k.
    moe: dict = dataclasses.field(
        default_factory=lambda: {"tokens": 16384, "width": 1024, "hidden": 2048, "experts": 8, "k": 2}
    )
    # The stand-in LM of the token-weighted step (mfu's, with fewer layers: the loss's share of a step shows).
    weighted_lm: dict = dataclasses.field(
        default_factory=lambda: {"vocab": 32768, "width": 1024, "layers": 2, "heads": 16, "seq": 1024, "batch": 16}
    )
    suite: tuple[str, ...] = SUITE
    # Sections' time; the imports, JAX's start and the plot come on top, and a section's alarm waits for a compile
    # that is under way: about 8 minutes in all.
    budget_s: float = 450.0


TINY = Size(
    prefetch_mib=(1, 2),
    prefetch_steps=4,
    prefetch_reps=1,
    models=("mlp",),
    rounds=1,
    steps=2,
    lm={"vocab": 64, "width": 32, "layers": 1, "heads": 2, "seq": 16, "batch": 4},
    lm_rounds=1,
    lm_steps=2,
    examples_lm_timed=False,
    attention_lengths=(32,),
    attention_heads=(2, 8),
    moe={"tokens": 16, "width": 8, "hidden": 16, "experts": 2, "k": 2},
    weighted_lm={"vocab": 64, "width": 16, "layers": 0, "heads": 2, "seq": 8, "batch": 4},
    suite=("tests/test_prefetch_pinned.py", "-k", "only_off_cpu or this_platform"),
    budget_s=150.0,
)


class SectionTimeout(Exception):
    """Raised in the main thread when a section outlives its share of the budget."""


# --- the run -------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Runs the sections (or, with ``--memory-worker``, measures the programs it names and prints their rows), then
    draws the plot from the JSON."""
    args = _parser().parse_args(argv)
    _prepare_environment()
    if args.memory_worker:
        print("MEMORY_ROWS " + json.dumps(memory_rows(json.loads(args.memory_worker))), flush=True)
        return
    size = TINY if args.tiny else Size()
    out = Path(args.out or ("bench-results" if args.tiny else HERE / "results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu.json"
    if not args.plot_only:
        result = header(args, size, previous=path if args.only else None)
        names = [n for n in SECTIONS if not args.only or n in args.only.split(",")]
        run_sections(names, size, args, result, path)
    plot(json.loads(path.read_text()), out / "gpu.png")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu.json and gpu.png (default benchmarks/results; --tiny: bench-results)")
    p.add_argument("--tiny", action="store_true", help="every section at a tiny size: checks that all of it runs")
    p.add_argument(
        "--budget",
        type=float,
        help="seconds for all sections (default 450; --tiny: 150); inf: no limit (each section runs to its end)",
    )
    p.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}; the others keep their entries")
    p.add_argument("--peak-tflops", type=float, help="the device's bf16 peak, for a device not in PEAK_BF16")
    p.add_argument("--plot-only", action="store_true", help="redraw gpu.png from gpu.json")
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)  # JSON [[model, strategy], ...]: one fresh process
    return p


def _prepare_environment() -> None:
    """Before JAX starts: the default device wherever the script runs (the benchmark modules it imports would
    otherwise choose CPU), one CPU device on a machine without an accelerator (the GPU run has one), and memory
    taken as needed rather than 75% of the GPU at start, so that the worker and test processes find room."""
    os.environ.setdefault("JAX_PLATFORMS", "")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    set_cpu_devices(1)
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):  # for the worker and test processes
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), path]))


def header(args: argparse.Namespace, size: Size, previous: Path | None) -> dict:
    """What was measured on: the device's name and platform, the versions, the size and budget. With
    ``previous`` (``--only``), that file's sections are kept where it was measured on the same device."""
    import flax
    import jax
    import jaxlib
    import numpy as np
    import optax

    device = jax.devices()[0]
    result = {
        "device": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "memory_kinds": sorted(m.kind for m in device.addressable_memories()),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "tiny": args.tiny,
        "budget_s": args.budget or size.budget_s,
        "untested": "several GPUs: NCCL between devices and between processes, and the collectives' GPU thresholds "
        "(psum(algorithm='auto') switches on CPU only; broadcast's BROADCAST_SPLIT_MIN_BYTES['gpu'] is an estimate); "
        "on one device every collective is the identity",
        "sections": {},
    }
    if previous is not None and previous.exists():
        old = json.loads(previous.read_text())
        if old.get("device") == result["device"]:
            result["sections"] = old.get("sections", {})
    print(f"{result['device']} ({result['platform']}), jax {result['jax']}, budget {result['budget_s']:.0f} s")
    return result


def run_sections(names: list[str], size: Size, args: argparse.Namespace, result: dict, path: Path) -> None:
    """Runs each section within its share of what is left of the budget, recording it and rewriting ``path``
    after each one. A section that fails or runs out of time keeps what it measured so far (its ``result``)."""
    end = time.monotonic() + result["budget_s"]
    for i, name in enumerate(names):
        left = end - time.monotonic()
        limit = left * SHARES[name] / sum(SHARES[n] for n in names[i:])
        partial: dict = {}
        entry: dict = {"limit_s": round(limit, 1) if math.isfinite(limit) else None}
        if limit < MIN_SECTION_S:
            result["sections"][name] = {**entry, "status": "skipped", "error": "no time left in --budget"}
            write_json(path, result)
            continue
        start = time.monotonic()
        print(f"\n=== {name} (at most {limit:.0f} s) ===" if math.isfinite(limit) else f"\n=== {name} ===", flush=True)
        try:
            with _alarm(limit):
                SECTION_FUNCTIONS[name](size, args, partial, start + limit)
            entry["status"] = "ok"
        except SectionTimeout:
            entry.update(status="timed out", error=f"stopped after its {limit:.0f} s")
        except Exception as e:  # noqa: BLE001 - recorded; the next sections still run
            entry.update(status="failed", error=_clean(f"{type(e).__name__}: {e}"))
            entry["traceback"] = _clean(traceback.format_exc()[-3000:])
        entry.update(seconds=round(time.monotonic() - start, 1), result=partial)
        print(f"=== {name}: {entry['status']} in {entry['seconds']} s ===", flush=True)
        result["sections"][name] = entry
        write_json(path, result)


class _alarm:
    """``with _alarm(seconds):`` raises :class:`SectionTimeout` in the main thread once ``seconds`` have passed."""

    def __init__(self, seconds: float):
        self.seconds = max(seconds, 0.01)

    def __enter__(self) -> None:
        def fire(signum, frame):
            raise SectionTimeout

        self.previous = signal.signal(signal.SIGALRM, fire)
        if math.isfinite(self.seconds):  # --budget inf: no alarm
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


# --- prefetch ------------------------------------------------------------------------------------------------


def section_prefetch(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """``out["batches"][mib]``: ``Bench.hidden_transfer`` of a ``mib`` MiB batch; ``out["summary"]``: per size the
    fraction hidden and the fraction of the zero-cost speed of each mode, and whether ours met the goal."""
    import prefetch

    bench = prefetch.Bench(argparse.Namespace(steps=size.prefetch_steps, reps=size.prefetch_reps, step_ms=4.0))
    out["goal"] = f"ours hides >= {HIDDEN_GOAL} of the copy at every size, with the step >= the copy"
    out["batches"], out["summary"] = {}, {}
    for mib in size.prefetch_mib:
        r = bench.hidden_transfer(mib, step_vs_copy=size.step_vs_copy, aligned=False, pageable=True)
        out["batches"][str(mib)] = r
        out["summary"][str(mib)] = hidden_summary(r)


def hidden_summary(r: dict) -> dict:
    """From one ``hidden_transfer`` result: the hidden fractions, each mode's speed as a fraction of the zero-cost
    loader's (t_preplaced / t_mode), whether the step took at least the copy, and whether ours met the goal."""
    ms = r["ms_per_step"]
    return {
        "hidden": r["hidden"],
        "vs_zero_cost": {m: ms["preplaced"] / t for m, t in ms.items() if m != "preplaced"},
        "step_ge_copy": r["step_ms"] >= r["copy_ms"],
        "pinned_host": r["pinned_host"],
        "goal_met": r["hidden"].get("ours", float("nan")) >= HIDDEN_GOAL,
    }


# --- train step ----------------------------------------------------------------------------------------------


def section_train_step(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """``out[model]``: ``strategies.speed`` on one device (samples/s, ratios to DDP and to the jit step, GFLOP per
    step) and ``out["goal"][model][strategy]``: whether the strategy is within 3% of the plain jit step."""
    import jax
    import strategies

    import spmdcomm as sc

    mesh = sc.data_mesh(devices=jax.devices()[:1])
    out["goal"] = {}
    for model in size.models:  # one model at a time: a timeout keeps the models already measured
        speed = strategies.speed([model], list(STRATEGIES), size.rounds, size.steps, mesh=mesh)[model]
        out[model] = speed
        out["goal"][model] = {s: speed[s]["ratio_vs_jit"] >= JIT_GOAL for s in STRATEGIES}


# --- memory --------------------------------------------------------------------------------------------------


def section_memory(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """``out["rows"]``: :func:`memory_rows` of every model x (our strategies, the jit step). Where the device keeps
    statistics, each program runs in a fresh process of its own (a peak is the highest of a process's life), a few
    processes at a time (each process's statistics are its own); where it keeps none, all in one process."""
    import jax

    configs = [[m, s] for m in size.models for s in (*STRATEGIES, "jit")]
    stats = jax.devices()[0].memory_stats() is not None
    out["memory_stats"] = stats or f"None on {jax.devices()[0].platform}: no measured peak to compare"
    out["rows"] = []
    groups = [[c] for c in configs] if stats else [configs]
    script = str(Path(__file__).resolve())
    cmds = [[sys.executable, script, "--memory-worker", json.dumps(group)] for group in groups]
    # Stopped 2 s before the section's alarm: the rows of the programs that finished are still read.
    for group, (text, code) in zip(groups, _run_parallel(cmds, deadline - 2, parallel=4), strict=True):
        rows = [json.loads(ln.split(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("MEMORY_ROWS ")]
        if code != 0 or not rows:
            out["rows"].append({"configs": group, "error": _clean(f"exit status {code}: {text[-2000:]}")})
        else:
            out["rows"].extend(rows[0])


def memory_rows(configs: list[list[str]]) -> list[dict]:
    """For each ``[model, strategy]`` (``strategy`` ``"jit"``: the plain jit step), in this process: ``explain``'s
    per-device memory, the device's bytes in use with the state and batch placed, and its peak after compiling and
    running the step twice; ``peak_vs_explained`` = that peak / (arguments + temporaries)."""
    import jax
    import strategies

    import spmdcomm as sc

    mesh = sc.data_mesh(devices=jax.devices()[:1])
    device = jax.devices()[0]
    rows = []
    for model, strategy in configs:
        batch = jax.device_put(strategies.model_data(model), sc.data_sharding(mesh=mesh))
        if strategy == "jit":
            step, params, opt_state = strategies.jit_program(model, mesh)
            memory = sc.explain(step, params, opt_state, batch).memory
            before = device.memory_stats()
            for _ in range(2):
                params, opt_state, loss = step(params, opt_state, batch)
            jax.block_until_ready(loss)
        else:
            state = strategies.make_state(model, mesh, strategy)
            step = sc.make_train_step(strategies.LOSSES[model])
            memory = sc.explain(step, state, batch).memory
            before = device.memory_stats()
            for _ in range(2):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
        after = device.memory_stats()
        explained = (memory.argument_bytes or 0) + (memory.temp_bytes or 0)
        peak = None if after is None else after.get("peak_bytes_in_use")
        rows.append(
            {
                "model": model,
                "strategy": strategy,
                "explain": dataclasses.asdict(memory),
                "explained_peak_bytes": explained,
                "bytes_in_use_before_step": None if before is None else before.get("bytes_in_use"),
                "peak_bytes_in_use": peak,
                "peak_vs_explained": None if peak is None or not explained else peak / explained,
            }
        )
        del batch, step
    return rows


# --- model FLOPs utilisation ---------------------------------------------------------------------------------


@dataclasses.dataclass
class LMSpec:
    """A language model for :func:`measure_mfu`: a Flax module applied to ``(sequences, tokens)`` int32 tokens,
    its float32 parameters and one global batch (``{"tokens": ...}``), and the shape figures of the attention term
    of its model FLOPs."""

    name: str
    module: Any
    params: dict
    batch: dict
    layers: int
    width: int


def section_mfu(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """``out["examples_lm"]``: examples/lm's MFU, or why there is none; ``out["stand_in"]``: the benchmarks'
    transformer LM at this run's size; ``out["peak_flops"]``: the peak both are divided by, and where it came
    from."""
    import jax

    kind = jax.devices()[0].device_kind
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_bf16_flops(kind)
    out["peak_flops"] = peak
    out["peak_source"] = "--peak-tflops" if args.peak_tflops else ("PEAK_BF16" if peak else f"unknown for {kind!r}")
    lm = ROOT / "examples" / "lm"
    if not lm.exists():
        out["examples_lm"] = "examples/lm not present"
    else:
        try:
            spec = examples_lm_spec(lm, size.lm)
            timed = size.examples_lm_timed
            out["examples_lm"] = measure_mfu(spec, peak, size.lm_rounds, size.lm_steps) if timed else lm_flops(spec)
        except NotImplementedError as e:
            out["examples_lm"] = str(e)
    out["stand_in"] = measure_mfu(stand_in_spec(size.lm), peak, size.lm_rounds, size.lm_steps)


def examples_lm_spec(path: Path, cfg: dict) -> LMSpec:
    """The :class:`LMSpec` of examples/lm's model (``models.Transformer``, byte vocabulary) at ``cfg``'s width,
    layers, heads and sequence length, on random bytes of ``cfg["batch"]`` sequences."""
    import importlib.util

    import flax.linen as nn
    import jax
    import numpy as np

    sys.path.insert(0, str(path))  # the example's modules import each other by name, as a script directory
    spec = importlib.util.spec_from_file_location("lm_models", path / "models.py")
    models = importlib.util.module_from_spec(spec)
    sys.modules["lm_models"] = models  # Flax's dataclasses look their module up while the file runs
    spec.loader.exec_module(models)
    module = models.Transformer(width=cfg["width"], layers=cfg["layers"], heads=cfg["heads"], max_len=cfg["seq"])
    tokens = np.random.default_rng(0).integers(0, 256, (cfg["batch"], cfg["seq"])).astype(np.int32)
    params = jit_once(module.init)(jax.random.PRNGKey(0), tokens[:1])["params"]
    params = jax.tree.map(np.asarray, dict(nn.unbox(params)))  # the logical names matter only to the example
    name = f"examples/lm Transformer {cfg['layers']}x{cfg['width']}, {cfg['batch']}x{cfg['seq']} bytes"
    return LMSpec(name, module, params, {"tokens": tokens}, cfg["layers"], cfg["width"])


def stand_in_spec(cfg: dict) -> LMSpec:
    """``strategies.TransformerLM`` with ``cfg``'s vocabulary, width, layers and heads, on random tokens of
    ``cfg["batch"]`` sequences of ``cfg["seq"]``."""
    import jax
    import numpy as np
    import strategies

    module = strategies.TransformerLM(vocab=cfg["vocab"], width=cfg["width"], layers=cfg["layers"], heads=cfg["heads"])
    tokens = np.random.default_rng(0).integers(0, cfg["vocab"], (cfg["batch"], cfg["seq"])).astype(np.int32)
    params = jit_once(module.init)(jax.random.PRNGKey(0), tokens[:1])["params"]
    name = f"TransformerLM {cfg['layers']}x{cfg['width']}, vocab {cfg['vocab']}, {cfg['batch']}x{cfg['seq']} tokens"
    return LMSpec(name, module, jax.tree.map(np.asarray, dict(params)), {"tokens": tokens}, cfg["layers"], cfg["width"])


def peak_bf16_flops(device_kind: str) -> float | None:
    """The bf16 dense peak FLOP/s of a GPU named ``device_kind`` (``PEAK_BF16``), or None for one not listed."""
    return next((flops for name, flops in PEAK_BF16 if name in device_kind), None)


def model_flops(params: dict, layers: int, width: int, sequences: int, positions: int) -> dict:
    """Training FLOPs of one step of a decoder LM on ``sequences`` x ``positions`` tokens: ``6 x N x tokens``
    for the ``N`` parameters that multiply activations (every ``kernel``: the embedding lookup multiplies
    nothing), plus ``12 x layers x positions x width x tokens`` for the attention scores and their weighted sum
    (forward 4 x positions x width per token and layer, backward twice that; causal masking still computes all)."""
    import jax

    kernels = sum(
        int(x.size)
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if getattr(path[-1], "key", None) == "kernel"
    )
    from spmdcomm.explain import model_flops as formula

    tokens = sequences * positions
    dense = formula(kernels, tokens)
    attention = formula(0, tokens, layers=layers, context=positions, width=width)
    return {"kernel_params": kernels, "tokens": tokens, "dense": dense, "attention": attention}


def xla_flops(compiled) -> float | None:
    """Floating-point operations of one call of a compiled program, by XLA's cost analysis (None if it has none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict on older JAX
    return float(cost["flops"]) if cost and "flops" in cost else None


def mfu(flops_per_step: float, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops_per_step / step_seconds / peak`` (None without a peak)."""
    return None if not peak else flops_per_step / step_seconds / peak


def measure_mfu(spec: LMSpec, peak: float | None, rounds: int, steps: int) -> dict:
    """bfloat16 step time, FLOPs and MFU of ``spec``'s model trained with Adam, for our DDP step on one device and
    for the plain ``jax.jit`` step, interleaved over ``rounds`` (medians). The FLOPs per step are ``sc.explain``'s
    count of the plain step's program (``flops_per_step``), next to our step's (``ours_flops_per_step``), the
    formula's (``model_flops_per_step``) and XLA's cost analysis (``xla_flops_per_step``)."""
    import spmdcomm as sc

    out = lm_flops(spec)
    runs = {"ours (ddp)": _ours_lm(spec, explain=True), "jax.jit": _jit_lm(spec)}
    jit_work = sc.explain(runs["jax.jit"].compiled)
    out["flops_per_step"] = per_step = jit_work.flops
    out["flops_bound"] = jit_work.work.bound
    out["ours_flops_per_step"] = ours = runs["ours (ddp)"].flops
    out["ours_vs_jit_flops"] = ours / per_step
    out["flops_vs_model"] = per_step / out["model_flops_per_step"]
    for run in runs.values():
        run(2)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[name].append(runs[name](steps) / steps)
    out["xla_flops_per_step"] = xla = xla_flops(runs["jax.jit"].compiled)
    for name, ts in times.items():
        step_s = statistics.median(ts)
        out[name] = {
            "step_ms": step_s * 1e3,
            "tflops_per_s": per_step / step_s / 1e12,
            "mfu": mfu(per_step, step_s, peak),
            "xla_flops_utilisation": None if xla is None else mfu(xla, step_s, peak),
        }
        shown = "n/a (no peak known)" if out[name]["mfu"] is None else f"{out[name]['mfu']:.3f}"
        print(
            f"{spec.name}, {name}: {step_s * 1e3:.2f} ms/step, {per_step / step_s / 1e12:.3f} TFLOP/s, MFU {shown}",
            flush=True,
        )
    out["ours_vs_jit_step_time"] = out["ours (ddp)"]["step_ms"] / out["jax.jit"]["step_ms"]
    return out


def _bf16(params):
    """The floating-point leaves of ``params`` in bfloat16: the model computes in bf16 from float32 masters."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda p: p.astype(jnp.bfloat16) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def _lm_losses(spec: LMSpec, params, tokens):
    """Next-token cross-entropy per sequence and position, the model in bf16, the losses in float32."""
    import jax.numpy as jnp
    import strategies

    return strategies.lm_token_losses(spec.module.apply, _bf16(params), tokens).astype(jnp.float32)


def lm_flops(spec: LMSpec) -> dict:
    """``spec``'s model FLOPs per training step (:func:`model_flops` of its batch, the last position predicting
    nothing) and their sum."""
    tokens = spec.batch["tokens"]
    flops = model_flops(spec.params, spec.layers, spec.width, tokens.shape[0], tokens.shape[1] - 1)
    return {"model": spec.name, "model_flops": flops, "model_flops_per_step": flops["dense"] + flops["attention"]}


def _ours_lm(spec: LMSpec, *, weighted: bool = False, explain: bool = False) -> Callable[[int], float]:
    """``run(steps) -> seconds`` of our DDP step on one device, Adam, on one placed batch; ``run.call()`` is one
    step, returning its metrics. The loss: the mean over positions, then over the real sequences; with
    ``weighted``, the token-weighted mean through ``sc.weighted`` of the batch's ``"weights"`` (one per target); with
    ``explain``, ``run.flops`` is ``sc.explain``'s FLOP count of the step (None without)."""
    import jax
    import jax.numpy as jnp
    import optax

    import spmdcomm as sc

    mesh = sc.data_mesh(devices=jax.devices()[:1])

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        losses = _lm_losses(spec, params, batch["tokens"])
        if weighted:
            return sc.weighted(jnp.sum(losses * batch["weights"]), jnp.sum(batch["weights"]))
        return sc.masked_mean(losses.mean(axis=1), mask)

    state = sc.TrainState.create(params=spec.params, tx=optax.adam(1e-4), mesh=mesh)
    batch = jax.device_put(spec.batch, sc.data_sharding(mesh=mesh))
    step = sc.make_train_step(loss_fn)
    flops = sc.explain(step, state, batch).flops if explain else None  # before the first call consumes the state
    call = step_caller(step, state, batch)

    def run(n: int) -> float:
        return time_calls(call, n)

    run.call = call  # type: ignore[attr-defined]
    run.flops = flops  # type: ignore[attr-defined]
    return run


def _jit_lm(spec: LMSpec) -> Callable[[int], float]:
    """``run(steps) -> seconds`` of the plain ``jax.jit`` step a JAX user writes (value_and_grad, optax, donated
    state) on one device; ``run.compiled`` is its compiled program (for XLA's FLOP count)."""
    import jax
    import optax

    tx = optax.adam(1e-4)
    device = jax.devices()[0]

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: _lm_losses(spec, p, batch["tokens"]).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(spec.params, device)
    holder = {"p": params, "o": tx.init(params)}
    batch = jax.device_put(spec.batch, device)
    # Compiled once, ahead of time, for the FLOP count and the calls alike (a transformer compiles slowly).
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(holder["p"], holder["o"], batch).compile()

    def call():
        holder["p"], holder["o"], loss = compiled(holder["p"], holder["o"], batch)
        return loss

    def run(n: int) -> float:
        return time_calls(call, n)

    run.compiled = compiled  # type: ignore[attr-defined]
    return run


# --- attention --------------------------------------------------------------------------------------------


def section_attention(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """``out[length]``: milliseconds and compiled temporaries of one causal attention's forward and backward pass on
    one device, in bf16 where the device has it: ``jax.nn.dot_product_attention`` against ``sc.ring_attention`` and
    ``sc.all_to_all_attention`` over a one-device axis (the ring degenerate: the kernels' own cost, no hop)."""
    import jax
    import jax.numpy as jnp

    import spmdcomm as sc

    dtype = jnp.bfloat16 if jax.devices()[0].platform == "gpu" else jnp.float32
    mesh = sc.make_mesh({"seq": 1}, devices=jax.devices()[:1])
    spec = sc.P(None, "seq")
    variants = {
        "jax.nn.dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        "sc.ring_attention": sc.spmd(
            lambda q, k, v: sc.ring_attention(q, k, v, "seq", causal=True), in_specs=spec, out_specs=spec, mesh=mesh
        ),
        "sc.all_to_all_attention": sc.spmd(
            lambda q, k, v: sc.all_to_all_attention(q, k, v, "seq", causal=True),
            in_specs=spec,
            out_specs=spec,
            mesh=mesh,
        ),
    }
    heads, dim = size.attention_heads
    for length in size.attention_lengths:  # shortest first: a timeout keeps the lengths already measured
        q, k, v = (jax.random.normal(jax.random.key(i), (1, length, heads, dim), dtype) for i in range(3))
        row: dict = {}
        for name, attend in variants.items():
            grad = jax.jit(jax.grad(_summed(attend), argnums=(0, 1, 2)))
            compiled = grad.lower(q, k, v).compile()
            call = functools.partial(grad, q, k, v)
            jax.block_until_ready(call())
            seconds = min(time_calls(call, size.steps) for _ in range(size.rounds)) / size.steps
            row[name] = {"ms": 1e3 * seconds, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
        base = row["jax.nn.dot_product_attention"]
        for entry in row.values():
            entry["time_vs_jax_nn"] = entry["ms"] / base["ms"]
            entry["temp_vs_jax_nn"] = entry["temp_bytes"] / max(base["temp_bytes"], 1)
        out[str(length)] = row


def _summed(attend: Callable) -> Callable:
    """A scalar of ``attend``'s output (float32 sum), to differentiate."""
    return lambda q, k, v: attend(q, k, v).astype("float32").sum()


# --- mixture of experts ----------------------------------------------------------------------------------


def section_moe(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """The dispatch of a MoE layer by each implementation of ``sc.ragged_all_to_all``, ``"padded"`` (every
    backend) and ``"native"`` (``jax.lax.ragged_all_to_all``, GPU and TPU), over a one-device expert axis (the
    exchange degenerate: the kernels' own cost), in bf16 where the device has it.

    ``out["layer"][impl]``: ms, tokens/s and compiled temporaries of ``sc.MoE``'s forward and backward pass (dropless,
    MLP experts, ``size.moe``); ``out["ragged_all_to_all"][impl]``: the same of the collective alone on the layer's
    ``tokens * k`` rows, a quarter of them held back (zeros in their place). ``out["native"]``: whether the native
    one runs here, or why not (then only the padded one is measured, and the ratios are None).
    ``out["max_abs_diff"]``: the layer's outputs and gradients, native against padded, and each collective's against
    NumPy; a difference beyond ``out["tolerance"]`` (relative to the largest value) fails the section.
    ``out["native_vs_padded"]``: the ratios of their ms and temporaries."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from moe import Mlp

    import spmdcomm as sc

    cfg = size.moe
    dtype = jnp.bfloat16 if jax.devices()[0].platform == "gpu" else jnp.float32
    tolerance = 2.0**-6 if dtype == jnp.bfloat16 else 1e-5
    out["config"] = {**cfg, "dtype": jnp.dtype(dtype).name, "capacity_factor": None}
    out["tolerance"] = tolerance
    mesh = sc.make_mesh({"expert": 1}, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    rows = cfg["tokens"] * cfg["k"]
    x, dy = (rng.standard_normal((cfg["tokens"], cfg["width"]), np.float32).astype(dtype) for _ in range(2))
    a, da = (rng.standard_normal((rows, cfg["width"]), np.float32).astype(dtype) for _ in range(2))
    held = rows * 3 // 4  # sent; the rest of the rows stay behind
    expert = Mlp(cfg["width"], cfg["hidden"])
    # The layer's parameters at their shapes, drawn here: Flax's initialisers would compile a program.
    shapes = nn.unbox(jax.eval_shape(sc.MoE(expert, experts=cfg["experts"], k=cfg["k"]).init, jax.random.key(0), x[:1]))
    params = jax.tree_util.tree_map_with_path(lambda path, s: _random_parameter(rng, path, s.shape), shapes["params"])
    params["experts"] = jax.tree.map(lambda p: p.astype(dtype), params["experts"])  # the router stays float32
    # The collective on one device: the first `held` rows where they were, zeros after; its gradient the same.
    want = np.where(np.arange(rows)[:, None] < held, np.stack([a, da]).astype(np.float32), 0.0)
    x, dy, a, da = (jnp.asarray(v) for v in (x, dy, a, da))

    def programs(impl: str) -> dict[str, tuple[Callable, tuple]]:
        layer = sc.MoE(expert, experts=cfg["experts"], k=cfg["k"], axis_name="expert", implementation=impl)
        apply = sc.spmd(
            lambda p, x: layer.apply({"params": p}, x),
            in_specs=({"router": sc.P(), "experts": sc.P("expert")}, sc.P("expert")),
            out_specs=sc.P("expert"),
            mesh=mesh,
        )
        move = sc.spmd(
            lambda a, s: sc.ragged_all_to_all(a, s, "expert", implementation=impl)[0],
            in_specs=sc.P("expert"),
            out_specs=sc.P("expert"),
            mesh=mesh,
        )
        send = jnp.array([held], jnp.int32)
        return {  # the collective first: where there is no native one, it says so before the layer is traced
            "ragged_all_to_all": (_forward_backward(lambda a: move(a, send)), ((a,), da)),
            "layer": (_forward_backward(apply), ((params, x), dy)),
        }

    compiled: dict[str, dict] = {}  # [impl][program]: (compiled, arguments)
    out["ragged_all_to_all"], out["layer"] = {}, {}
    out["native"] = {"available": True, "reason": None}
    failure: Exception | None = None  # of the native implementation where the platform has it: raised at the end
    for impl in ("padded", "native"):  # padded first: measured even where the native one fails
        try:
            built = {name: (fn.lower(*fn_args).compile(), fn_args) for name, (fn, fn_args) in programs(impl).items()}
        except sc.BackendError as e:  # no native collective on this platform: not a failure of the section
            out["native"] = {"available": False, "reason": str(e)}
            continue
        except Exception as e:  # noqa: BLE001 - the padded one is still measured; raised below
            if impl == "padded":
                raise
            failure = e
            out["native"]["error"] = _clean(f"{type(e).__name__}: {e}")[:2000]
            continue
        compiled[impl] = built
        for name, (program, _) in built.items():
            out[name][impl] = {"temp_bytes": program.memory_analysis().temp_size_in_bytes}

    values = {
        impl: {name: jax.device_get(f(*f_args)) for name, (f, f_args) in c.items()} for impl, c in compiled.items()
    }
    out["agreement"] = {
        f"ragged_all_to_all {impl} vs numpy": _agreement(got["ragged_all_to_all"], (want[0], (want[1],)), tolerance)
        for impl, got in values.items()
    }
    if "native" in values:
        out["agreement"]["layer native vs padded"] = _agreement(
            values["native"]["layer"], values["padded"]["layer"], tolerance
        )
    bad = {name: a["beyond_tolerance"] for name, a in out["agreement"].items() if a["beyond_tolerance"]}
    if bad:
        raise AssertionError(
            f"values beyond the tolerance {tolerance:g} x max(1, largest |value|) in {out['config']['dtype']} "
            f"(out['agreement']): {bad}"
        )

    tokens = {"ragged_all_to_all": rows, "layer": cfg["tokens"]}
    times: dict[tuple[str, str], list[float]] = {(impl, name): [] for impl in compiled for name in compiled[impl]}
    for r in range(size.rounds):  # interleaved, the order reversed every other round
        for impl, name in list(times) if r % 2 == 0 else list(times)[::-1]:
            program, p_args = compiled[impl][name]
            call = functools.partial(program, *p_args)
            jax.block_until_ready(call())
            times[impl, name].append(time_calls(call, size.steps) / size.steps)
    for (impl, name), ts in times.items():
        seconds = min(ts)
        out[name][impl].update(ms=1e3 * seconds, tokens_per_s=tokens[name] / seconds)
    out["native_vs_padded"] = None
    if "native" in compiled:
        out["native_vs_padded"] = {
            name: {
                "time": out[name]["native"]["ms"] / out[name]["padded"]["ms"],
                "temp": out[name]["native"]["temp_bytes"] / max(out[name]["padded"]["temp_bytes"], 1),
            }
            for name in tokens
        }
    if failure is not None:
        raise RuntimeError("the native ragged all-to-all failed on a platform that has it") from failure


def _random_parameter(rng: Any, path: tuple, shape: tuple[int, ...]) -> Any:
    """Normal float32 values: a kernel's over the square root of its fan-in (the next-to-last dimension), any other
    parameter's times 0.02."""
    import numpy as np

    kernel = getattr(path[-1], "key", None) in ("kernel", "router")
    scale = 1.0 / math.sqrt(shape[-2]) if kernel else 0.02
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _forward_backward(fn: Callable) -> Callable:
    """``jit(g)`` of ``g(args, cotangent) -> (fn(*args), gradients of args)``: the forward and backward pass."""
    import jax

    def run(args: tuple, cotangent: Any) -> tuple:
        y, pull = jax.vjp(fn, *args)
        return y, pull(cotangent)

    return jax.jit(run)


def _agreement(got: Any, want: Any, tolerance: float) -> dict:
    """``max_abs_diff`` over the leaves of two pytrees of one structure (in float32), and ``beyond_tolerance``: the
    leaves (by path) whose difference exceeds ``tolerance`` times the larger of 1 and the largest ``|want|`` there."""
    import jax
    import numpy as np

    diffs, beyond = [0.0], []
    pairs = zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True)
    for (path, g), w in pairs:
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        diffs.append(float(np.max(np.abs(g - w), initial=0.0)))
        if not diffs[-1] <= tolerance * max(1.0, float(np.max(np.abs(w), initial=0.0))):  # NaN fails too
            beyond.append(jax.tree_util.keystr(path))
    return {"max_abs_diff": float(np.max(diffs)), "beyond_tolerance": beyond}  # NaN shows


# --- token-weighted loss ----------------------------------------------------------------------------------


def section_weighted(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """The token-weighted loss's cost: our DDP step on one device of the stand-in LM (``size.weighted_lm``, bf16)
    with its loss through ``sc.weighted`` (a token mean over the batch's real targets; each sequence's padding at
    its end, a quarter of the targets on average) against the same step with the plain mean loss, interleaved over
    ``lm_rounds``. ``out[loss]``: ms per step and samples/s (medians); ``out["weighted_vs_mean"]``: the ratio of
    samples/s; ``out["tokens"]``: the real targets the weighted step counted (checked against the batch)."""
    import numpy as np

    spec = stand_in_spec(size.weighted_lm)
    sequences, seq = spec.batch["tokens"].shape
    lengths = np.random.default_rng(1).integers(seq // 2, seq, sequences)  # real targets of each sequence
    weights = (np.arange(seq - 1)[None, :] < lengths[:, None]).astype(np.float32)
    spec = dataclasses.replace(spec, batch={**spec.batch, "weights": weights})
    out["model"] = spec.name
    out["padding_fraction"] = float(1.0 - weights.mean())
    runs = {"mean": _ours_lm(spec), "weighted": _ours_lm(spec, weighted=True)}
    metrics = {name: run.call() for name, run in runs.items()}  # compiles; the first step's metrics
    out["tokens"] = float(metrics["weighted"]["tokens"])
    out["first_loss"] = {name: float(m["loss"]) for name, m in metrics.items()}
    if out["tokens"] != weights.sum():
        raise AssertionError(f"the weighted step counted {out['tokens']} tokens; the batch has {weights.sum()}")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(size.lm_rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[name].append(runs[name](size.lm_steps) / size.lm_steps)
    for name, ts in times.items():
        step_s = statistics.median(ts)
        out[name] = {"step_ms": 1e3 * step_s, "samples_per_s": sequences / step_s}
    out["weighted_vs_mean"] = out["weighted"]["samples_per_s"] / out["mean"]["samples_per_s"]
    print(f"{spec.name}: token-weighted / mean loss, samples/s: {out['weighted_vs_mean']:.3f}", flush=True)


# --- suite ---------------------------------------------------------------------------------------------------


def section_suite(size: Size, args: argparse.Namespace, out: dict, deadline: float) -> None:
    """``out``: the pytest command, its exit status, the count of each outcome and the tests that failed, read
    from pytest's verbose lines (so a run stopped at the deadline still counts what it finished)."""
    import jax

    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-v", "-o", "console_output_style=classic"]
    cmd += ["--timeout", "120", *size.suite]
    out["command"] = shlex.join(["python", *cmd[1:]])
    out["jax_platform"] = jax.devices()[0].platform
    # The outcomes are read from -v's lines: options the caller's environment adds (-q) must not change them.
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    text, out["returncode"] = _run_status(cmd, deadline - 5, cwd=ROOT, env=env)
    outcomes = re.findall(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M)
    out["counts"] = {k: sum(1 for _, o in outcomes if o == k) for k in sorted({o for _, o in outcomes})}
    out["failed"] = [t for t, o in outcomes if o in ("FAILED", "ERROR")][:40]
    out["tail"] = _clean(text[text.find("collect") :][-1500:])  # without pytest's header of paths and plugins


# --- subprocesses --------------------------------------------------------------------------------------------


def _run_parallel(cmds: list[list[str]], deadline: float, parallel: int) -> list[tuple[str, int | None]]:
    """Each command's output and exit status (-9: stopped at ``deadline``; None: not started by then), at most
    ``parallel`` running at once, each in a session of its own, so that stopping one stops everything it started,
    and nothing else."""
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]
    procs: list[subprocess.Popen | None] = [None] * len(cmds)
    try:
        for i, cmd in enumerate(cmds):
            while sum(p is not None and p.poll() is None for p in procs) >= parallel:
                time.sleep(0.05)
                if time.monotonic() > deadline:
                    break
            if time.monotonic() > deadline:
                break
            procs[i] = subprocess.Popen(cmd, stdout=logs[i], stderr=subprocess.STDOUT, start_new_session=True)
        for proc in procs:
            if proc is not None:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for proc in procs:
            if proc is not None and proc.poll() is None:  # out of time, or the section's own alarm
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = []
    for proc, log in zip(procs, logs, strict=True):
        log.seek(0)
        out.append((log.read(), None if proc is None else proc.returncode))
        log.close()
    return out


def _run_status(
    cmd: list[str], deadline: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[str, int | None]:
    """``cmd``'s stdout and stderr together, and its exit status (None: stopped at ``deadline``). The process gets
    a session of its own, so that stopping it stops everything it started, and nothing else."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:  # out of time, or the section's own alarm
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return log.read(), code


def _clean(text: str) -> str:
    """``text`` without this machine's paths (results are committed): the checkout becomes ``.``, Python's
    installation ``<python>``, the home folder ``~``."""
    for path, name in ((str(ROOT), "."), (sys.prefix, "<python>"), (sys.base_prefix, "<python>")):
        text = text.replace(path, name)
    return text.replace(str(Path.home()), "~")


# --- plot ----------------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    """gpu.png: hidden fraction per batch size, train-step ratio to the jit step, measured / explained peak, MFU,
    the MoE dispatch's ms per implementation, the token-weighted step's samples/s. Without matplotlib it says so and
    draws nothing (the JSON holds every number)."""
    try:
        from _common import _pyplot, _save

        plt = _pyplot()
    except ImportError as e:
        print(f"no plot: matplotlib is not importable ({e}); the results are in the JSON", flush=True)
        return
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), layout="constrained")
    sections = result.get("sections", {})
    for ax, (name, draw) in zip(axes.flat, PANELS.items(), strict=True):
        entry = sections.get(name, {})
        try:
            draw(ax, entry.get("result") or {})
        except (KeyError, TypeError, ValueError) as e:  # a section that failed early has too little to draw
            ax.text(0.5, 0.5, f"{name}: {entry.get('status', 'not run')}\n{type(e).__name__}", ha="center")
        ax.set_title(f"{ax.get_title() or name} [{entry.get('status', 'not run')}]", fontsize=9)
    fig.suptitle(f"{result['device']} ({result['platform']}), jax {result['jax']}, {result['date']}")
    print(f"plot: {_save(plt, fig, path)}", flush=True)


def _bars(ax, groups: list[str], series: dict[str, list[float]], goal: float | None, ylabel: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups, fontsize=8)
    if goal is not None:
        ax.axhline(goal, color="gray", ls="--", label=f"goal {goal}")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def _panel_prefetch(ax, r: dict) -> None:
    sizes = list(r["summary"])
    modes = ("ours", "ours pageable", "flax")
    series = {m: [r["summary"][s]["hidden"].get(m, float("nan")) for s in sizes] for m in modes}
    _bars(ax, [f"{s} MiB" for s in sizes], series, HIDDEN_GOAL, "fraction of the copy hidden")
    ax.set_title("prefetch: copy hidden behind the step")


def _panel_train_step(ax, r: dict) -> None:
    models = [m for m in r if m != "goal"]
    series = {s: [r[m][s]["ratio_vs_jit"] for m in models] for s in STRATEGIES}
    _bars(ax, models, series, JIT_GOAL, "samples/s / plain jax.jit step")
    ax.set_title("train step, one device")


def _panel_memory(ax, r: dict) -> None:
    rows = [row for row in r["rows"] if "model" in row]  # not the programs whose process failed
    labels = [f"{row['model']}\n{row['strategy']}" for row in rows]
    measured = [row["peak_vs_explained"] for row in rows]
    if all(v is None for v in measured):
        ax.bar(labels, [row["explained_peak_bytes"] / 2**20 for row in rows])
        ax.set_ylabel("explain: arguments + temporaries, MiB")
        ax.set_title("memory (no device statistics)")
    else:
        ax.bar(labels, [float("nan") if v is None else v for v in measured])
        ax.axhline(1.0, color="gray", ls="--")
        ax.set_ylabel("memory_stats peak / explain's")
        ax.set_title("memory: measured peak vs explain")
    ax.tick_params(axis="x", labelsize=6)


def _panel_mfu(ax, r: dict) -> None:
    run = r["stand_in"]
    names = ("ours (ddp)", "jax.jit")
    if r.get("peak_flops"):
        ax.bar(names, [run[n]["mfu"] for n in names])
        ax.set_ylabel("MFU, bf16")
    else:
        # results written before the FLOPs came from sc.explain name the figure model_tflops_per_s
        ax.bar(names, [run[n].get("tflops_per_s", run[n].get("model_tflops_per_s")) for n in names])
        ax.set_ylabel("TFLOP/s (no peak known)")
    ax.set_title("stand-in LM" + ("" if isinstance(r.get("examples_lm"), dict) else "; " + str(r.get("examples_lm"))))


def _panel_moe(ax, r: dict) -> None:
    groups = ("layer", "ragged_all_to_all")
    impls = [i for i in ("padded", "native") if "ms" in r["layer"].get(i, {})]
    _bars(ax, list(groups), {i: [r[g][i]["ms"] for g in groups] for i in impls}, None, "ms, forward + backward")
    ax.set_yscale("log")
    native = "native unavailable" if not r["native"]["available"] else f"native/padded {_ratio(r, 'layer')} (layer)"
    ax.set_title(f"MoE dispatch, one-device expert axis; {native}")


def _ratio(r: dict, name: str) -> str:
    ratios = r.get("native_vs_padded") or {}
    return f"{ratios[name]['time']:.2f}" if name in ratios else "n/a"


def _panel_weighted(ax, r: dict) -> None:
    names = ("mean", "weighted")
    ax.bar(names, [r[n]["samples_per_s"] for n in names])
    ax.set_ylabel("samples/s")
    ax.set_title(f"token-weighted loss: {r['weighted_vs_mean']:.3f}x the mean loss's speed")


PANELS = {
    "prefetch": _panel_prefetch,
    "train_step": _panel_train_step,
    "memory": _panel_memory,
    "mfu": _panel_mfu,
    "moe": _panel_moe,
    "weighted": _panel_weighted,
}
SECTION_FUNCTIONS = {
    "prefetch": section_prefetch,
    "train_step": section_train_step,
    "memory": section_memory,
    "mfu": section_mfu,
    "attention": section_attention,
    "moe": section_moe,
    "weighted": section_weighted,
    "suite": section_suite,
}


if __name__ == "__main__":
    main()
