"""Runs every benchmark at a short setting, writes their JSON, and draws the PNG plots.

    python benchmarks/run_all.py --out bench-results          # about 20 minutes on a 2-core CPU
    python benchmarks/run_all.py --out bench-results --plot-only

Each benchmark runs in its own process (the fake device count must be set before JAX starts) and streams its
progress. Plots: busbw vs message size per collective (spmdcomm vs jax.lax vs the memcpy line), steps/s vs
loader latency for prefetch, samples/s per train-step configuration, memory per device and samples/s
relative to DDP per data-parallel strategy, for the pipeline its stack bytes per device, its temporaries
against the micro-batch count and its step time against DDP's with the bubble formula, tokens/s, temporaries
and bytes over the context axis against the sequence length for context parallelism, tokens/s and temporaries
of the MoE layer and the MoE LM step, and the LM step's matmul FLOPs over the mesh per layout against one
device's and the model FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import PLOTS

HERE = Path(__file__).resolve().parent

# name -> arguments of the short setting, and of the smoke setting (seconds; only checks that all runs)
BENCHMARKS = {
    "collectives": ["collectives.py", "--devices", "8", "--trials", "5", "--step", "16"],
    "prefetch": ["prefetch.py", "--reps", "5"],
    "train_step": ["train_step.py", "--rounds", "5"],
    "strategies": ["strategies.py", "--rounds", "5"],
    "pipeline": ["pipeline.py", "--rounds", "5"],
    "context": ["context.py", "--rounds", "3", "--lengths", "128,512,1024"],
    "moe": ["moe.py", "--rounds", "5"],
    "flops": ["flops.py"],
}
SMOKE = {
    "collectives": [
        "collectives.py",
        "--devices",
        "8",
        "--trials",
        "1",
        "--max-bytes",
        "65536",
        "--step",
        "64",
        "--target-seconds",
        "0.001",
    ],
    "prefetch": ["prefetch.py", "--reps", "1", "--steps", "3"],
    "train_step": [
        "train_step.py",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--skip-multiprocess",
        "--models",
        "mlp",
        "--variants",
        "ours,hand-written shard_map",  # what the smoke check reads
    ],
    "strategies": [
        "strategies.py",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--sizes",
        "2",
        "--models",
        "mlp",
        "--strategies",
        "fsdp",
        "--smoke",
    ],
    "pipeline": ["pipeline.py", "--smoke"],
    "context": [
        "context.py",
        "--lengths",
        "32",
        "--rounds",
        "1",
        "--round-tokens",
        "1",
        "--layers",
        "1",
        "--variants",
        "ring4,a2a4",
    ],
    "moe": ["moe.py", "--smoke"],
    # The layout whose count a fix pinned (tensor parallelism's head) against one device, at a tiny size.
    "flops": ["flops.py", "--smoke", "--layouts", "tensor"],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--only", help="comma-separated subset of " + ",".join(BENCHMARKS))
    parser.add_argument("--plot-only", action="store_true", help="redraw the plots from existing JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny settings: checks that everything runs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    if not args.plot_only:
        for i, name in enumerate(names, 1):
            script, *rest = (SMOKE if args.smoke else BENCHMARKS)[name]
            cmd = [sys.executable, str(HERE / script), *rest, "--json", str(args.out / f"{name}.json")]
            print(f"[{i}/{len(names)}] {name}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=_smoke_env() if args.smoke else None)
            print(f"[{i}/{len(names)}] {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    for name in names:
        path = args.out / f"{name}.json"
        if path.exists():
            png = PLOTS[name](json.loads(path.read_text()), args.out / f"{name}.png")
            print(f"plot: {png}")


def _smoke_env() -> dict[str, str]:
    """The smoke run checks that everything runs: its programs compile without XLA:CPU's backend optimisation (a
    third less compile time; values agree within float32 rounding, and the HLO the counts read is the same)."""
    env = dict(os.environ)
    if "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    return env


if __name__ == "__main__":
    main()
