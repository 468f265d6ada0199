"""The ResNet example (examples/resnet) from its command line: it learns in float16 with dynamic loss scaling and
synchronised BatchNorm, evaluates every epoch through a hook, and resumed mid-epoch on 2 processes x 1 device from a
checkpoint one process x 2 devices wrote, ends with the numbers of a run that never stopped. (Stopping a run with
``--max-steps`` is the MNIST example's test.)

The example's modules import each other by plain name (``import train``), as the MNIST example's do, so it runs in
subprocesses here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import optax
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resnet"
# Two stages (the second one strided, with a projection shortcut): every kind of block, and a third less to compile.
SMALL = ["--train-size", "200", "--test-size", "90", "--batch-size", "32", "--epochs", "2", "--half-precision"]
SMALL += ["--widths", "16,32"]


def run(args: list[str], tmp_path: Path, *, name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "main.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_half_precision_run_learns_evaluates_every_epoch_and_resumes_across_process_splits(tmp_path, launch):
    # The uninterrupted run also saves at step 9, mid-epoch 2 (and at its end, step 14). With the end's checkpoint
    # removed, the directory is what a run stopped after step 9 leaves: the resumed run starts there.
    ckpt = tmp_path / "ckpt"
    straight = run(["--devices", "2", *SMALL, "--checkpoint-dir", str(ckpt), "--save-every", "9"], tmp_path, name="a")
    rows = straight["epochs"]
    # 200 examples in global batches of 32: 7 steps per epoch, the last one padded (8 real rows).
    assert [(r["epoch"], r["steps"]) for r in rows] == [(1, 7), (2, 7)] and straight["step"] == 14
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    assert all(r["test_accuracy"] is not None for r in rows)
    assert straight["final_test_accuracy"] == rows[-1]["test_accuracy"]
    assert straight["half_precision"] and straight["final_loss_scale"] in {2.0**k for k in range(8, 17)}
    # The warm-up cosine schedule as the optimizer's count saw it: a skipped step keeps the optimizer state, count too.
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=7, decay_steps=14)
    expected_lr = float(schedule(14 - 1 - straight["skipped_steps"]))
    np.testing.assert_allclose(rows[-1]["learning_rate"], expected_lr, rtol=1e-5)

    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [9, 14]
    shutil.rmtree(ckpt / "14")
    res = launch(
        str(EXAMPLE / "main.py"),
        *SMALL,
        "--checkpoint-dir",
        str(ckpt),
        "--json",
        str(tmp_path / "resumed.json"),
        processes=2,
        devices_per_process=1,
    )
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["processes"] == 2 and resumed["step"] == 14, res.stdout
    assert [(r["epoch"], r["steps"]) for r in resumed["epochs"]] == [(2, 5)]
    np.testing.assert_allclose(resumed["final_test_accuracy"], straight["final_test_accuracy"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(resumed["epochs"][0]["test_loss"], rows[-1]["test_loss"], rtol=1e-6)
    # The loss scale (and its count of good steps) came through the checkpoint: the same scale at the end.
    assert resumed["final_loss_scale"] == straight["final_loss_scale"]


def test_generated_data_is_the_same_for_the_same_seed_and_balanced():
    spec = importlib.util.spec_from_file_location("resnet_input_pipeline", EXAMPLE / "input_pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)
    a, b, other = pipeline.make_split(60, seed=3), pipeline.make_split(60, seed=3), pipeline.make_split(60, seed=4)
    assert a["image"].shape == (60, pipeline.SIZE, pipeline.SIZE, 3) and a["image"].dtype == np.float32
    assert np.array_equal(a["image"], b["image"]) and np.array_equal(a["label"], b["label"])
    assert not np.array_equal(a["image"], other["image"])
    assert np.bincount(a["label"]).tolist() == [10] * len(pipeline.CLASSES)
    assert 0.0 <= a["image"].min() and a["image"].max() <= 1.0
