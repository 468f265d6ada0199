"""The data-parallel MNIST example runs briefly, single-process and through the launcher, and learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_mnist import write_tiny_mnist

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "mnist_data_parallel.py")

pytestmark = pytest.mark.slow


def run(args: list[str], tmp_path: Path, *, launcher: list[str] | None = None, timeout: float = 300) -> dict:
    """Runs the example (optionally under spmdcomm-launch); returns its JSON summary."""
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, *(launcher or []), EXAMPLE, *args, "--no-progress", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    summary["stdout"] = proc.stdout
    return summary


def losses(summary: dict) -> list[float]:
    return [e["train_loss"] for e in summary["epochs"]]


def test_single_process_on_tiny_idx_data(tmp_path):
    write_tiny_mnist(tmp_path / "mnist", n_train=256, n_test=64, gz=True)
    s = run(
        [
            "--devices",
            "4",
            "--dataset",
            "mnist",
            "--data-dir",
            str(tmp_path / "mnist"),
            "--epochs",
            "3",
            "--batch-size",
            "32",
        ],
        tmp_path,
    )
    assert s["dataset"] == "mnist" and s["devices"] == 4 and s["processes"] == 1
    first, *_, last = losses(s)
    assert last < 0.7 * first, losses(s)
    assert s["epochs"][-1]["steps"] == 8  # 256 examples / 32
    assert 0.0 <= s["final_test_accuracy"] <= 1.0


def test_two_processes_through_the_launcher_on_digits_fallback(tmp_path):
    launcher = ["-m", "spmdcomm.launch", "-n", "2", "--devices-per-process", "2", "--timeout", "240"]
    s = run(["--data-dir", str(tmp_path / "empty"), "--epochs", "2", "--max-steps", "6"], tmp_path, launcher=launcher)
    assert s["dataset"] == "digits" and s["processes"] == 2 and s["devices"] == 4
    assert "training on scikit-learn's bundled digits" in s["stdout"]
    first, last = losses(s)
    assert last < first, losses(s)


def test_checkpoint_resume_continues_from_the_last_epoch(tmp_path):
    write_tiny_mnist(tmp_path / "mnist", n_train=128, n_test=32, dotted=True, gz=False)
    common = [
        "--devices",
        "2",
        "--dataset",
        "mnist",
        "--data-dir",
        str(tmp_path / "mnist"),
        "--batch-size",
        "32",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    first = run([*common, "--epochs", "1"], tmp_path)
    resumed = run([*common, "--epochs", "2"], tmp_path)
    assert "resumed from" in resumed["stdout"] and "(epoch 1)" in resumed["stdout"]
    assert [e["epoch"] for e in resumed["epochs"]] == [2]
    assert resumed["epochs"][0]["train_loss"] < first["epochs"][0]["train_loss"]
