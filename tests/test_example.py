"""The data-parallel MNIST example (examples/mnist): its training logic in this process, its command line as
one process and as two processes through the launcher, and checkpoint resume. Each run learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import train  # examples/mnist/, on sys.path through tests/conftest.py
from tiny_mnist import write_tiny_mnist

pytestmark = pytest.mark.slow

MAIN = Path(train.__file__).with_name("main.py")


def losses(summary: dict) -> list[float]:
    return [e["train_loss"] for e in summary["epochs"]]


@pytest.fixture
def tiny_mnist(tmp_path):
    """256 train / 64 test images in MNIST's IDX format, learnable in one epoch."""
    write_tiny_mnist(tmp_path / "mnist", n_train=256, n_test=64, gz=True)
    return str(tmp_path / "mnist")


def test_train_and_evaluate_learns_tiny_mnist(tiny_mnist):
    config = train.Config(dataset="mnist", data_dir=tiny_mnist, epochs=2, batch_size=32, progress=False)
    s = train.train_and_evaluate(config)
    assert s["dataset"] == "mnist" and s["devices"] == jax.device_count() and s["processes"] == 1
    assert [e["steps"] for e in s["epochs"]] == [8, 8]  # 256 examples / 32
    first, last = losses(s)
    assert last < 0.1 * first, losses(s)
    assert s["final_test_accuracy"] >= 0.95  # the label is a bright 7x7 block: 100% after one epoch here


def test_command_line_single_process_prints_and_writes_the_summary(tiny_mnist, tmp_path):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(MAIN), "--devices", "4", "--dataset", "mnist", "--data-dir", tiny_mnist]
    cmd += ["--epochs", "1", "--batch-size", "32", "--no-progress", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --devices sets the device count
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout.splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["devices"] == 4 and printed["global_batch"] == 32 and printed["epochs"][0]["steps"] == 8
    assert printed["final_test_accuracy"] >= 0.95


def test_two_processes_train_like_one_process_on_the_digits_fallback(launch, tmp_path):
    # 2 processes x 2 devices split every global batch of 32 as 8 devices in this process do, so the two runs
    # train the same model; only the order of float additions differs.
    args = ["--data-dir", str(tmp_path / "empty"), "--epochs", "2", "--max-steps", "12", "--no-progress"]
    res = launch(MAIN, *args, "--json", tmp_path / "summary.json", timeout=240)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["dataset"] == "digits" and s["processes"] == 2 and s["devices"] == 4
    assert "training on scikit-learn's bundled digits" in res.stdout
    here = train.train_and_evaluate(
        train.Config(data_dir=str(tmp_path / "empty"), epochs=2, max_steps=12, progress=False)
    )
    np.testing.assert_allclose(losses(s), losses(here), rtol=1e-3)
    first, last = losses(s)
    assert last < 0.8 * first, losses(s)
    assert s["final_test_accuracy"] >= 0.6  # 24 steps; guessing gives 0.1, 3 full epochs 0.98
    assert abs(s["final_test_accuracy"] - here["final_test_accuracy"]) <= 2 / 360  # 360 test images


def test_checkpoint_resume_continues_from_the_last_epoch(tiny_mnist, tmp_path, capsys):
    common = dict(dataset="mnist", data_dir=tiny_mnist, batch_size=32, checkpoint_dir=str(tmp_path / "ckpt"))
    first = train.train_and_evaluate(train.Config(epochs=1, progress=False, **common))
    resumed = train.train_and_evaluate(train.Config(epochs=2, progress=False, **common))
    printed = capsys.readouterr().out
    assert f"resumed from {common['checkpoint_dir']} at step 8 (epoch 1)" in printed.split("epoch 1:", 1)[1]
    assert [e["epoch"] for e in resumed["epochs"]] == [2]
    assert resumed["epochs"][0]["train_loss"] < first["epochs"][0]["train_loss"]
