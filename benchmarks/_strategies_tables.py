"""The Markdown tables of ``strategies.py``'s results: memory per device, the memory goals per device count, the 2-D
layouts and the speed with its goals. Nothing here imports JAX: ``strategies.py --markdown PATH`` renders a JSON
it wrote before, and the tables in docs/sharded.md and benchmarks/README.md are this rendering.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

JIT = "jit+NamedSharding fsdp"  # the plain jax.jit program, a column next to our strategies
# Speed goals: (strategy, baseline, least ratio)
SPEED_GOALS = [
    ("fsdp", JIT, 0.9),
    ("fsdp", "ddp", 0.85),
    ("zero1", "ddp", 0.95),
]
MODEL_NAMES = {"mlp": "MLP", "cnn": "CNN", "odd-mlp": "odd MLP", "transformer": "transformer"}
KIB = 1024


def speed_goals(variants: dict) -> list[tuple[str, str, float, float, bool]]:
    """``(strategy, baseline, ratio, least ratio, met)`` of each speed goal whose two variants ran."""
    out = []
    for name, base, bound in SPEED_GOALS:
        if name in variants and base in variants:
            key = "ratio_vs_jit" if base == JIT else "ratio_vs_ddp"
            ratio = variants[name][key]
            out.append((name, base, ratio, bound, ratio >= bound))
    return out


def markdown(result: dict[str, Any]) -> str:
    """Every table of ``result``, each under a line that says what it holds."""
    n = max((r["devices"] for r in result["memory"]), default=None)
    facts = f"{result['date']}, jax {result['jax']}, {result['cpu_cores']} CPU cores, {result['devices']} devices"
    parts = [
        f"Memory per device on {n} devices, KiB (the largest device); {facts}:",
        memory_table(result, n),
        "Memory goals of the FSDP rows, KiB per device (`fsdp / no reshard` where the two differ):",
        goals_table(result),
    ]
    if result.get("layouts"):
        parts += [f"2-D layouts on {result['devices']} devices, KiB per device:", layouts_table(result)]
    if result.get("speed"):
        parts += [
            f"Speed on {result.get('speed_devices', result['devices'])} devices (medians over rounds; ratios: medians"
            " of each round's ratio):",
            speed_table(result),
            "Speed goals:",
            speed_goals_table(result),
        ]
    return "\n\n".join(parts)


def _kib(value: float | None) -> str:
    """KiB with a space between thousands (``7 848``); ``-`` for None."""
    return "-" if value is None else f"{value / KIB:,.0f}".replace(",", " ")


def _verdict(met: bool) -> str:
    return "met" if met else "**MISSED**"


def _strategy(name: str) -> str:
    return name.replace(" reshard_after_forward=False", ", no reshard")


def _each(rows: list[dict], fmt: Callable[[dict], str]) -> str:
    """``fmt`` of each row, joined by `` / ``; once where every row gives the same text."""
    cells = [fmt(r) for r in rows]
    return cells[0] if len(set(cells)) == 1 else " / ".join(cells)


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def memory_table(result: dict[str, Any], devices: int | None) -> str:
    """One row per model and strategy on ``devices`` devices."""
    header = [
        "model",
        "strategy",
        "params + optimizer state",
        "vs DDP",
        "gradient",
        "compiled arguments",
        "temporaries, global batch",
        "peak",
        "peak vs DDP",
        "temporaries, 1 example per device",
        "same, `accum_steps=4`",
    ]
    rows = [
        [
            MODEL_NAMES.get(r["model"], r["model"]),
            _strategy(r["strategy"]),
            _kib(r["persistent_bytes"]),
            f"{r['persistent_bytes vs ddp']:.3f}",
            _kib(r["grad_bytes"]),
            _kib(r["argument_bytes"]),
            _kib(r["temp_bytes"]),
            _kib(r["peak_bytes"]),
            f"{r['peak_bytes vs ddp']:.3f}",
            _kib(r["temp_bytes_1_per_device"]),
            _kib(r["temp_bytes_accum_1_per_device"]),
        ]
        for r in result["memory"]
        if r["devices"] == devices
    ]
    return _table(header, ["---", "---", *["---:"] * 9], rows)


def goals_table(result: dict[str, Any]) -> str:
    """One row per model and device count: the FSDP rows' persistent state against its bound, their peak saving
    against half the ideal one (``fsdp / no reshard`` where the FSDP variants differ, one value where they agree)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in result["memory"]:
        if "goal_met" in r:
            groups.setdefault((r["model"], r["devices"]), []).append(r)
    header = [
        "model",
        "N",
        "FSDP params + optimizer state",
        "bound",
        "goal",
        "peak",
        "vs DDP",
        "peak saving",
        "at least",
        "peak goal",
    ]
    rows = []
    for (model, n), rs in groups.items():
        each = functools.partial(_each, rs)
        rows.append(
            [
                MODEL_NAMES.get(model, model),
                str(n),
                each(lambda r: _kib(r["persistent_bytes"])),
                each(lambda r: _kib(r["goal_bound_bytes"])),
                each(lambda r: _verdict(r["goal_met"])),
                each(lambda r: _kib(r["peak_bytes"])),
                each(lambda r: f"{r['peak_bytes vs ddp']:.3f}"),
                each(lambda r: _kib(r["peak_saving_bytes"])),
                _kib(rs[0]["peak_goal_saving_bytes"]),
                each(lambda r: _verdict(r["peak_goal_met"])),
            ]
        )
    return _table(header, ["---", "---:", *["---:"] * 2, "---", *["---:"] * 4, "---"], rows)


def _layout(name: str, devices: int) -> str:
    """``fsdp hybrid replica=2 x shard=4`` as ``fsdp hybrid `replica` 2 x `shard` 4``; DDP's one axis named."""
    return f"ddp `data` {devices}" if name == "ddp" else re.sub(r"(\w+)=(\d+)", r"`\1` \2", name)


def layouts_table(result: dict[str, Any]) -> str:
    header = ["model", "layout", "params", "params + optimizer state", "vs DDP", "peak", "over each axis", "goal"]
    rows = []
    for r in result["layouts"]:
        goal = f"<= {_kib(r['goal_bound_bytes'])}: {_verdict(r['goal_met'])}" if "goal_met" in r else ""
        rows.append(
            [
                MODEL_NAMES.get(r["model"], r["model"]),
                _layout(r["layout"], result["devices"]),
                _kib(r["param_bytes"]),
                _kib(r["persistent_bytes"]),
                f"{r['persistent_bytes vs ddp']:.3f}",
                _kib(r["peak_bytes"]),
                ", ".join(f"{axis} {_kib(b)}" for axis, b in r["bytes_over_axis"].items()),
                goal,
            ]
        )
    return _table(header, ["---", "---", *["---:"] * 4, "---", "---"], rows)


def speed_table(result: dict[str, Any]) -> str:
    header = ["model", "strategy", "samples/s", "vs DDP", "vs jit", "GFLOP/device"]
    rows = []
    for model, variants in result["speed"].items():
        for name, v in variants.items():
            rows.append(
                [
                    MODEL_NAMES.get(model, model),
                    _strategy(name),
                    f"{v['samples_per_s']:,.0f}".replace(",", " "),
                    f"{v['ratio_vs_ddp']:.3f}",
                    f"{v['ratio_vs_jit']:.3f}" if "ratio_vs_jit" in v else "-",
                    "-" if v["gflops_per_device"] is None else f"{v['gflops_per_device']:.3f}",
                ]
            )
    return _table(header, ["---", "---", *["---:"] * 4], rows)


def speed_goals_table(result: dict[str, Any]) -> str:
    """One column per goal of :data:`SPEED_GOALS`, one row per model: the ratio and whether it is met."""
    header = ["model"] + [f"{s} vs {'jit' if b == JIT else b} (>= {bound})" for s, b, bound in SPEED_GOALS]
    rows = []
    for model, variants in result["speed"].items():
        cells = {(s, b): f"{ratio:.3f}, {_verdict(met)}" for s, b, ratio, _, met in speed_goals(variants)}
        rows.append([MODEL_NAMES.get(model, model)] + [cells.get((s, b), "-") for s, b, _ in SPEED_GOALS])
    return _table(header, ["---", *["---"] * len(SPEED_GOALS)], rows)
