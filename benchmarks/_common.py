"""What the benchmark scripts share: the fake CPU device count, the bounded timing loop, JSON results and plots.

Every script calls :func:`set_cpu_devices` before it imports JAX. Nothing here imports JAX at import time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Calls in flight at most in every timing loop. XLA:CPU stalls, then aborts the process (SIGABRT after ~40 s),
# when more than about 32 executions containing collectives are queued; 8 keeps the devices busy.
WINDOW = 8

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def set_cpu_devices(default: int) -> int:
    """Gives this process ``--devices N`` fake CPU devices (``N`` from the command line, else ``default``).

    Must run before JAX starts. A count already in ``XLA_FLAGS`` wins (``spmdcomm-launch
    --devices-per-process`` sets one for each process it starts). Ignored on GPU. Returns the count asked for.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--devices", type=int, default=default)
    count = parser.parse_known_args()[0].devices
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()
    return count


def step_caller(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any) -> Callable[[], Any]:
    """``call() -> metrics``: one ``step(state, batch)``, the state threaded from call to call (each step consumes
    the state the previous one returned); ``call.state()`` is the newest state."""
    holder = {"state": state}

    def call() -> Any:
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    call.state = lambda: holder["state"]  # type: ignore[attr-defined]
    return call


def time_calls(call: Callable[[], Any], n: int, *, chained: bool = False, window: int = WINDOW) -> float:
    """Seconds for ``n`` calls of ``call()``, with never more than ``window`` of them in flight.

    Before each call beyond the first ``window``, the loop waits for the result of the call ``window`` calls
    back. With ``chained=True`` each call consumes the previous one's result (a donated buffer, which is gone
    once consumed), so instead the loop waits for the newest result after every ``window`` calls.
    """
    import jax  # here, not at the top: scripts import this module before JAX may start

    pending: collections.deque = collections.deque()
    out = None
    start = time.perf_counter()
    for i in range(n):
        out = call()
        if chained:
            if i % window == window - 1:
                jax.block_until_ready(out)
        else:
            pending.append(out)
            if len(pending) > window:
                jax.block_until_ready(pending.popleft())
    jax.block_until_ready(out if chained else list(pending))
    return time.perf_counter() - start


def jit_once(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.jit(fn)`` for a program that runs once, such as a model's ``init``: on CPU compiled without XLA's
    backend optimisation, which takes about a fifth of the compile time (a one-block transformer's init: 0.6 s
    instead of 3 s) for a slower single run. Its results may differ from the optimised program's in the last bit
    (a parameter initialiser's erf_inv: within 2e-7 of the largest value). Other backends compile it as usual."""
    programs: dict[str, Callable[..., Any]] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        import jax  # here, not at the top: scripts import this module before JAX may start

        backend = jax.default_backend()
        if backend not in programs:
            options = {"xla_backend_optimization_level": 0} if backend == "cpu" else None
            programs[backend] = jax.jit(fn, compiler_options=options)
        return programs[backend](*args, **kwargs)

    return call


def run_facts() -> dict[str, Any]:
    """What every result records of the run: the date, the JAX version, the platform and device count, the cores."""
    import jax

    return {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "cpu_cores": os.cpu_count(),
    }


def write_json(path: str | Path | None, result: dict[str, Any]) -> None:
    """Writes ``result`` to ``path`` as indented JSON (nothing when ``path`` is None) and says so."""
    if path is None:
        return
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", flush=True)


def plot_collectives(result: dict, path: Path) -> Path:
    """busbw against message size, one panel per collective, with the NumPy memcpy line."""
    plt = _pyplot()
    ops = list(dict.fromkeys(r["op"] for r in result["rows"]))
    cols = min(3, len(ops))
    rows_n = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False, layout="constrained")
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
    """Steps/s against loader time / step time for each prefetch mode, I/O-like and CPU-bound loaders."""
    plt = _pyplot()
    lvs = result["loader_vs_step"]
    kinds = [k for k in ("io", "cpu") if k in lvs]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False, layout="constrained")
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
    """Samples/s per train-step configuration, one bar each."""
    plt = _pyplot()
    rows = train_step_rows(result)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.4), layout="constrained")
    ax.barh([r[0] for r in rows], [r[1] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="samples/s")
    # A figure title, centred on the whole figure: over the bars alone it ran past the right edge.
    fig.suptitle("train step, global batch 256: 2 devices in one process, or 2 processes")
    return _save(plt, fig, path)


def plot_strategies(result: dict, path: Path) -> Path:
    """Parameters + optimizer state per device against the device count, per model and strategy (the plain
    ``jax.jit`` program among them), and each one's samples/s relative to DDP."""
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in result["memory"]))
    speed = result.get("speed", {})
    panels = len(models) + bool(speed)
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.8), squeeze=False, layout="constrained")
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["memory"] if r["model"] == model]
        for k, strategy in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
            pts = [(r["devices"], r["persistent_bytes"] / 2**20) for r in rows if r["strategy"] == strategy]
            # Shrinking markers: strategies with equal bytes (ZeRO-1 and ZeRO-2) stay visible on one another.
            label = strategy.replace("reshard_after_forward=False", "no reshard").replace("NamedSharding", "NS")
            ax.plot(*zip(*pts), marker="o", ms=max(11 - 1.5 * k, 2), label=label)
        ddp = [(r["devices"], r["persistent_bytes"] / r["devices"] / 2**20) for r in rows if r["strategy"] == "ddp"]
        ax.plot(*zip(*ddp), color="gray", ls="--", label="DDP / N")
        ax.set(xscale="log", title=model, xlabel="devices N", ylabel="params + optimizer state, MiB/device")
        ax.set_ylim(0, 1.6 * max(r["persistent_bytes"] for r in rows) / 2**20)  # room for the legend on top
        ax.set_xticks([n for n, _ in ddp], [str(n) for n, _ in ddp])
        ax.set_xticks([], minor=True)
        ax.legend(fontsize=7, loc="upper center", ncol=3)
    if speed:
        ax = axes[0][-1]
        names = list(next(iter(speed.values())))
        width = 0.8 / len(speed)
        for i, (model, variants) in enumerate(speed.items()):
            xs = [j + i * width for j in range(len(names))]
            ax.bar(xs, [variants[n]["ratio_vs_ddp"] for n in names], width, label=model)
        ax.axhline(0.85, color="gray", ls="--", label="goal for FSDP: 0.85")
        labels = [
            n.replace(" reshard_after_forward=False", "\nno reshard").replace("jit+NamedSharding ", "jit\n")
            for n in names
        ]
        ax.set_xticks([j + width * (len(speed) - 1) / 2 for j in range(len(names))], labels, fontsize=7)
        ax.set(title=f"samples/s vs DDP, {result['devices']} devices", ylabel="ratio to DDP", ylim=(0, 1.5))
        ax.legend(fontsize=7, loc="upper center", ncol=2)  # above the bars, which stay near 1
    batch = result.get("batch_per_model") or {}
    batches = f"global batch {result['global_batch']}"
    if any(b != result["global_batch"] for b in batch.values()):  # the transformer's batch is smaller
        batches += "".join(f", {m} {b}" for m, b in batch.items() if b != result["global_batch"])
    fig.suptitle(f"Data-parallel strategies, Adam, {batches}, {result['date']}")
    return _save(plt, fig, path)


def plot_pipeline(result: dict, path: Path) -> Path:
    """Pipeline parallelism: the stack's bytes per device against the whole stack's, the step's temporaries
    against m with and without remat, and each variant's step time relative to DDP with the bubble formula."""
    plt = _pyplot()
    speed = result.get("speed", {})
    panels = 2 + bool(speed)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels + (2 if speed else 0), 4.2), squeeze=False)
    fig.set_layout_engine("constrained")
    ax = axes[0][0]
    rows = result["stack_memory"]
    labels = [f"{r['strategy'].replace(' reshard_after_forward=False', ', no reshard')}\n{r['layout']}" for r in rows]
    ax.bar(labels, [r["fraction"] for r in rows], label="measured")
    ax.scatter(labels, [r["goal_fraction"] for r in rows], color="black", marker="_", s=400, label="1/p, 1/(p N)")
    ax.set(title="stack params + Adam state per device", ylabel="fraction of the whole stack", ylim=(0, 1.1))
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7)
    ax = axes[0][1]
    act = result["activation_memory"]
    for color, remat in (("C0", True), ("C1", False)):
        pts = [(r["m"], r["temp_bytes"] / 2**20) for r in act if r.get("ticks") and r["remat"] == remat]
        ax.plot(*zip(*pts), marker="o", color=color, label=f"ours, remat={remat}")
        for r in act:
            if r["variant"].startswith("hand-written") and r["remat"] == remat:
                ax.scatter([r["m"]], [r["temp_bytes"] / 2**20], marker="x", s=80, color=color, label=r["variant"])
    for r in act:
        if r["variant"].startswith("ddp"):
            color = "C0" if r["remat"] else "C1"
            ax.axhline(r["temp_bytes"] / 2**20, color=color, ls="--", lw=1, label=r["variant"])
    ms = sorted({r["m"] for r in act if r.get("ticks")})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xticks([], minor=True)
    ax.set(title="step temporaries per device", xlabel="micro-batches m", ylabel="MiB", ylim=(0, None))
    ax.legend(fontsize=7)
    if speed:
        ax = axes[0][2]
        names = list(speed)
        ax.barh(names, [speed[n]["time_vs_ddp"] for n in names], label="measured step time / DDP")
        bubble = [(speed[n]["bubble_formula"], n) for n in names if "bubble_formula" in speed[n]]
        ax.scatter(*zip(*bubble), color="black", marker="|", s=200, label="bubble formula (v m + p - 1) / (v m)")
        ax.axvline(1.0, color="gray", ls="--")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.set(title="step time relative to DDP data=8 (same remat)", xlabel="ratio")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: bars fill the axes
    cfg = result["config"]
    fig.suptitle(
        f"Pipeline, data 2 x stage 4 vs data 8: {cfg['layers']} blocks of width {cfg['width']}, batch "
        f"{cfg['batch']}, {result['devices']} fake CPU devices, {result['date']}"
    )
    return _save(plt, fig, path)


def plot_context(result: dict, path: Path) -> Path:
    """Tokens/s, the compiled step's temporaries and the bytes over the context axis per step against the sequence
    length, one line per variant (no split, ring and all-to-all on each context mesh)."""
    plt = _pyplot()
    rows = result["rows"]
    panels = [
        ("tokens_per_s", 1, "tokens/s", "speed"),
        ("temp_bytes", 2**20, "temporaries, MiB/device", "compiled step's temporaries"),
        ("bytes_over_context_per_step", 2**20, "MiB/device per step", "over the context axis"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False, layout="constrained")
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for ax, (key, unit, label, title) in zip(axes[0], panels):
        for k, variant in enumerate(variants):
            pts = [(r["length"], r[key] / unit) for r in rows if r["variant"] == variant and r[key] > 0]
            if pts:  # one colour per variant in every panel; shrinking markers keep equal lines visible
                style = "--" if "all-to-all" in variant else "-"
                ax.plot(*zip(*pts), ls=style, marker="o", ms=9 - 1.5 * k, color=f"C{k}", label=variant)
        lengths = sorted({r["length"] for r in rows})
        ax.set(xscale="log", yscale="log", title=title, xlabel="sequence length (tokens)", ylabel=label)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xticks([], minor=True)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Context parallelism, global batch {result['global_batch']} sequences, {result['devices']} "
        f"{result['platform']} devices, {result['date']}"
    )
    return _save(plt, fig, path)


def plot_moe(result: dict, path: Path) -> Path:
    """Tokens/s and compiled temporaries per variant: the MoE layer's, the MoE LM's against the dense LMs', and
    the MoE LM step against the GShard step."""
    plt = _pyplot()
    groups = [
        ("MoE layer", result["rows"]),
        ("LM step", result.get("lm", [])),
        ("LM vs GShard", result.get("lm_gshard", [])),
    ]
    groups = [(title, rows) for title, rows in groups if rows]
    fig, axes = plt.subplots(2, len(groups), figsize=(5.2 * len(groups), 6.4), squeeze=False, layout="constrained")
    for col, (title, rows) in enumerate(groups):
        names = [r["variant"] for r in rows]
        for row, (key, unit, label) in enumerate([("tokens_per_s", 1, "tokens/s"), ("temp_bytes", 2**20, "MiB")]):
            ax = axes[row][col]
            ax.barh(names, [r[key] / unit for r in rows], color=[f"C{k}" for k in range(len(rows))])
            ax.set(title=f"{title}: {'speed' if row == 0 else 'temporaries per device'}", xlabel=label)
            ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"Expert parallelism, {result['devices']} {result['platform']} devices, {result['date']}")
    return _save(plt, fig, path)


def plot_flops(result: dict, path: Path) -> Path:
    """Per layout, the matmul FLOPs over the mesh against the one-device step's and against the model FLOPs."""
    plt = _pyplot()
    rows = result["rows"]
    names = [f"{r['layout']} ({r['mesh']})" for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.6), layout="constrained")
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["vs_one_device"] for r in rows], height=0.4, label="vs one device")
    ax.barh([y + 0.2 for y in ys], [r["vs_model_flops"] for r in rows], height=0.4, label="vs model FLOPs")
    ax.axvline(1.0, color="gray", ls="--")
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(title=f"examples/lm step: matmul FLOPs over the mesh, {result['date']}", xlabel="ratio")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def train_step_rows(result: dict) -> list[tuple[str, float]]:
    """(configuration, samples/s) pairs from benchmarks/train_step.py's flat JSON (ratios and bytes left out)."""
    skip = ("ratio", "bytes", "(ms)")
    return [
        (name, float(v))
        for name, v in result.items()
        if isinstance(v, (int, float)) and not any(s in name for s in skip)
    ]


PLOTS = {
    "collectives": plot_collectives,
    "prefetch": plot_prefetch,
    "train_step": plot_train_step,
    "strategies": plot_strategies,
    "pipeline": plot_pipeline,
    "context": plot_context,
    "moe": plot_moe,
    "flops": plot_flops,
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
