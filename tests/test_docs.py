"""Every code block of README.md is executed, and so are the Python blocks of docs/*.md.

README's Python blocks are doctests (pytest collects README.md with --doctest-glob); its shell blocks are either
the install/test commands, which must be exactly what .ci/run runs, or commands run here as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CI_COMMANDS = {"pip install -e '.[test]'", "ruff check .", "ruff format --check .", "python -m pytest"}


def blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if kind == lang]


def run(argv: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``argv``; fails the test with its whole output on a non-zero exit or after ``timeout`` seconds (kept
    below pytest's 600 s, so that a stuck command is reported with what it printed)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(_report(argv, f"did not end within {timeout:g} s", e.stdout, e.stderr), pytrace=False)
    if proc.returncode:
        pytest.fail(_report(argv, f"exited with status {proc.returncode}", proc.stdout, proc.stderr), pytrace=False)
    return proc


def readme_commands() -> list[str]:
    lines = [ln.split("  #")[0].strip() for b in blocks(ROOT / "README.md", "bash") for ln in b.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_readme_python_blocks_are_doctests():
    assert blocks(ROOT / "README.md", "python")
    for body in blocks(ROOT / "README.md", "python"):
        assert all(ln.startswith((">>>", "...")) or not ln.startswith(" ") for ln in body.splitlines())
        assert body.lstrip().startswith(">>>"), body[:80]


def test_readme_install_and_test_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in CI_COMMANDS:
        assert cmd in readme_commands(), cmd
        assert cmd in ci, cmd


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in readme_commands() if c not in CI_COMMANDS])
def test_readme_command_runs_as_written(command, tmp_path):
    """The example commands, on a machine without MNIST (they fall back to the bundled digits)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        SPMDCOMM_DATA=str(tmp_path / "no-mnist-here"),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "spmdcomm-launch" and shutil.which("spmdcomm-launch") is None:
        argv[:1] = [sys.executable, "-m", "spmdcomm.launch"]  # the same launcher, without the console script
    proc = run(argv, cwd=ROOT, env=env, timeout=450)
    (summary,) = [ln for ln in proc.stdout.splitlines() if '"final_test_accuracy"' in ln]
    summary = json.loads(summary[summary.index("{") :])  # under the launcher, after "[rank 0] "
    assert summary["dataset"] == "digits" and summary["final_test_accuracy"] >= 0.8, summary


@pytest.mark.parametrize(
    "doc", [d for d in sorted((ROOT / "docs").glob("*.md")) if blocks(d, "python")], ids=lambda p: p.name
)
def test_docs_python_blocks_run(doc, tmp_path):
    """Each document's Python blocks, in order, as one script on 8 fake CPU devices."""
    code = "\n\n".join(blocks(doc, "python"))
    script = tmp_path / "doc.py"
    script.write_text(code)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=300)


@pytest.mark.slow
def test_benchmark_entry_point_runs_and_plots(tmp_path):
    """benchmarks/run_all.py at its smoke setting: every benchmark runs, writes JSON, and each plot is drawn."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        timeout=480,
    )
    names = ("collectives", "prefetch", "train_step", "strategies")
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    ops = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    assert {r["op"] for r in results["collectives"]["rows"]} == ops
    assert all(r["time_us"] > 0 for r in results["collectives"]["rows"])
    assert {"io", "cpu"} <= set(results["prefetch"]["loader_vs_step"]) and results["prefetch"]["hidden_transfer"]
    assert results["train_step"]["mlp/ours"] > 0 and results["train_step"]["cnn/hand-written shard_map"] > 0
    memory = results["strategies"]["memory"]
    assert [(r["strategy"], r["devices"]) for r in memory] == [("ddp", 2), ("fsdp", 2), ("jit+NamedSharding fsdp", 2)]
    assert memory[1]["goal_met"] and memory[1]["persistent_bytes vs ddp"] < 0.51
    assert results["strategies"]["speed"]["mlp"]["fsdp"]["samples_per_s"] > 0
    layouts = {r["layout"]: r for r in results["strategies"]["layouts"]}
    assert layouts["fsdp hybrid replica=2 x shard=4"]["goal_met"] and layouts["ddp data=4 x model=2"]["goal_met"]
    assert set(layouts["fsdp hybrid replica=2 x shard=4"]["bytes_over_axis"]) == {"replica", "shard"}
    for name in results:
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def _report(argv: list[str], why: str, out: str | bytes | None, err: str | bytes | None) -> str:
    text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (out, err)]
    return f"{shlex.join(argv)}\n{why}\n--- stdout ---\n{text[0]}\n--- stderr ---\n{text[1]}"
