"""Runs every benchmark at a short setting, writes their JSON, and draws the PNG plots.

    python benchmarks/run_all.py --out bench-results          # about 10 minutes on a 2-core CPU
    python benchmarks/run_all.py --out bench-results --plot-only

Each benchmark runs in its own process (the fake device count must be set before JAX starts) and streams its
progress. Plots: busbw vs message size per collective (spmdcomm vs jax.lax vs the memcpy line), steps/s vs
loader latency for prefetch, samples/s per train-step configuration.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> arguments of the short setting, and of the smoke setting (seconds; only checks that all runs)
BENCHMARKS = {
    "collectives": ["collectives.py", "--devices", "8", "--trials", "5", "--step", "16"],
    "prefetch": ["prefetch.py", "--reps", "5"],
    "train_step": ["train_step.py", "--rounds", "5"],
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
    "train_step": ["train_step.py", "--rounds", "1", "--steps", "2", "--skip-multiprocess"],
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
            subprocess.run(cmd, check=True)
            print(f"[{i}/{len(names)}] {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    for name in names:
        path = args.out / f"{name}.json"
        if path.exists():
            png = PLOTS[name](json.loads(path.read_text()), args.out / f"{name}.png")
            print(f"plot: {png}")


def plot_collectives(result: dict, path: Path) -> Path:
    plt = _pyplot()
    ops = list(dict.fromkeys(r["op"] for r in result["rows"]))
    cols = min(3, len(ops))
    rows_n = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax in axes.flat[len(ops) :]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        rows = [r for r in result["rows"] if r["op"] == op]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = [(r["bytes"], r["busbw_gbps"]) for r in rows if r["variant"] == variant]
            ax.plot(*zip(*pts), marker="o", label=variant)
        ax.axhline(result["memcpy_gbps"], color="gray", ls="--", label="NumPy memcpy")
        ax.set(xscale="log", yscale="log", title=op, xlabel="message bytes", ylabel="busbw GB/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['devices']} {result['platform']} devices, jax {result['jax']}, {result['date']}")
    return _save(plt, fig, path)


def plot_prefetch(result: dict, path: Path) -> Path:
    plt = _pyplot()
    lvs = result["loader_vs_step"]
    kinds = [k for k in ("io", "cpu") if k in lvs]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = lvs[kind]
        ratios = sorted(rows, key=float)
        modes = [m for m in rows[ratios[0]] if not m.endswith("_vs_zero_cost")]
        for mode in modes:
            ax.plot([float(r) for r in ratios], [rows[r][mode] for r in ratios], marker="o", label=mode)
        ax.set(
            title=f"{'I/O-like' if kind == 'io' else 'CPU-bound'} loader",
            xlabel="loader time / step time",
            ylabel="steps/s",
        )
        ax.legend(fontsize=8)
    fig.suptitle(
        f"prefetch, {lvs.get('batch_mib', 0):.0f} MiB batches, S = {lvs.get('step_ms', 0):.1f} ms, "
        f"{result.get('devices')} devices, {result.get('date')}"
    )
    return _save(plt, fig, path)


def plot_train_step(result: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = train_step_rows(result)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([r[0] for r in rows], [r[1] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="samples/s", title="train step, global batch 256 (2 devices in one process, or 2 processes)")
    return _save(plt, fig, path)


def train_step_rows(result: dict) -> list[tuple[str, float]]:
    """(configuration, samples/s) pairs from benchmarks/train_step.py's flat JSON (ratios and bytes left out)."""
    skip = ("ratio", "bytes", "(ms)")
    return [
        (name, float(v))
        for name, v in result.items()
        if isinstance(v, (int, float)) and not any(s in name for s in skip)
    ]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTS = {"collectives": plot_collectives, "prefetch": plot_prefetch, "train_step": plot_train_step}


if __name__ == "__main__":
    main()
