"""The data-parallel MNIST example (examples/mnist): its training logic in this process, its command line as
one process and as two processes through the launcher, stopping and resuming mid-epoch (bitwise), a SIGTERM
during the evaluation that ends an epoch, a killed process restarted by the launcher, and the per-step metrics
log with the epoch hook's test metrics. Each run learns."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import train  # examples/mnist/, on sys.path through tests/conftest.py
from tiny_mnist import write_tiny_mnist

import spmdcomm as sc

pytestmark = pytest.mark.slow

MAIN = Path(train.__file__).with_name("main.py")
PHASES = tuple(f"time/{name}" for name in sc.reliability.PHASES)  # every step: data, ..., hooks, other


def losses(summary: dict) -> list[float]:
    return [e["train_loss"] for e in summary["epochs"]]


def records(path: Path) -> dict[int, dict]:
    """The metrics log, the last record of each step (a step re-run after a restart appears again)."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    """256 train / 64 test images in MNIST's IDX format, learnable in one epoch (read, never written, by the runs)."""
    root = tmp_path_factory.mktemp("data") / "mnist"
    write_tiny_mnist(root, n_train=256, n_test=64, gz=True)
    return str(root)


@pytest.fixture(scope="module")
def straight(tiny_mnist, tmp_path_factory):
    """Two epochs that never stop, and their metrics log: what the first test checks and the stopped run repeats."""
    log = tmp_path_factory.mktemp("straight") / "metrics.jsonl"
    config = train.Config(dataset="mnist", data_dir=tiny_mnist, epochs=2, batch_size=32, progress=False)
    return train.train_and_evaluate(dataclasses.replace(config, metrics_log=str(log))), log


def test_train_and_evaluate_learns_tiny_mnist(straight):
    s, _ = straight
    assert s["dataset"] == "mnist" and s["devices"] == jax.device_count() and s["processes"] == 1
    assert [e["steps"] for e in s["epochs"]] == [8, 8] and s["step"] == 16  # 256 examples / 32
    first, last = losses(s)
    assert last < 0.1 * first, losses(s)
    assert s["final_test_accuracy"] >= 0.95  # the label is a bright 7x7 block: 100% after one epoch here
    for row in s["epochs"]:
        assert set(train.PHASE_KEYS) <= set(row) and all(row[k] >= 0 for k in train.PHASE_KEYS), row
        assert row["dispatch_s"] > 0 and row["save_s"] == 0  # no checkpoint_dir: nothing saved
        assert row["hooks_s"] > 0 and row["seconds"] == pytest.approx(8 * sum(row[k] for k in train.PHASE_KEYS))
    assert s["final_test_accuracy"] == s["epochs"][-1]["test_accuracy"]  # the last epoch hook's evaluation
    assert re.fullmatch(r"[0-9a-f]{64}", s["params_sha256"])


def test_command_line_single_process_prints_and_writes_the_summary_and_metrics(tiny_mnist, tmp_path):
    out, log, tb = tmp_path / "summary.json", tmp_path / "logs" / "metrics.jsonl", tmp_path / "tb"
    # 8 devices, as in the test above: this run's programs are that test's, read from the compilation cache.
    cmd = [sys.executable, str(MAIN), "--devices", "8", "--dataset", "mnist", "--data-dir", tiny_mnist]
    cmd += ["--epochs", "1", "--batch-size", "32", "--no-progress", "--json", str(out)]
    cmd += ["--metrics-log", str(log), "--tensorboard-dir", str(tb)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --devices sets the device count
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout.splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["devices"] == 8 and printed["global_batch"] == 32 and printed["epochs"][0]["steps"] == 8
    assert printed["final_test_accuracy"] >= 0.95
    assert re.search(r"epoch 1: .* ms per step: data [\d.]+, dispatch [\d.]+, devices [\d.]+", proc.stdout)
    # One record per step with the step's loss and its seconds per phase; the epoch row holds their means.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert all({"loss", "accuracy", "examples", *PHASES} <= set(r) for r in lines), lines[0]
    # The epoch hook's evaluation joins the metrics of the epoch's last step, and its time is that step's hooks
    # phase alone: the other steps ran no hook.
    hooked = ["epoch", "test/accuracy", "test/loss"]
    assert [sorted(set(hooked) & set(r)) for r in lines] == [[]] * 7 + [hooked]
    assert [r["time/hooks"] for r in lines[:-1]] == [0.0] * 7 and lines[-1]["time/hooks"] > 0
    row, end = printed["epochs"][0], lines[-1]
    assert [row[k] for k in ("epoch", "test_accuracy", "test_loss")] == [end[k] for k in hooked]
    for key, name in train.PHASE_KEYS.items():
        assert row[key] == pytest.approx(np.mean([r[name] for r in lines]), rel=1e-9), key
    # The row's seconds are its steps' wall time (every phase, the evaluation included); samples/s is training's.
    # The first step compiled the train step; the last one (its hook) the evaluation.
    assert [r["time/compile"] > 0 for r in lines] == [True] + [False] * 6 + [True]
    assert row["seconds"] == pytest.approx(sum(r[k] for r in lines for k in PHASES), rel=1e-9)
    training = sum(r[k] for r in lines for k in PHASES if k not in ("time/hooks", "time/compile"))
    assert row["samples_per_s"] == pytest.approx(256 / training, rel=1e-9)
    assert row["train_loss"] == pytest.approx(np.mean([r["loss"] for r in lines]), rel=1e-6)  # 32 real each
    assert [p.name for p in tb.iterdir() if p.name.startswith("events.out.tfevents")]


def test_run_stopped_mid_epoch_resumes_to_the_same_bits(tiny_mnist, straight, tmp_path, capsys):
    # The run that never stopped is the module's (without a checkpoint_dir: saving changes no bit of the state).
    straight, straight_log = straight
    common = dict(dataset="mnist", data_dir=tiny_mnist, epochs=2, batch_size=32, save_every=3, progress=False)
    log, ckpt = tmp_path / "metrics.jsonl", str(tmp_path / "ckpt")
    stopped = train.train_and_evaluate(train.Config(checkpoint_dir=ckpt, max_steps=5, metrics_log=str(log), **common))
    resumed = train.train_and_evaluate(train.Config(checkpoint_dir=ckpt, metrics_log=str(log), **common))
    printed = capsys.readouterr().out
    assert "stopped at step 5 of 16 (max_steps)" in printed
    assert f"resuming from {ckpt} at step 5 (epoch 1, batch 6 of 8), restart 0" in printed
    assert stopped["step"] == 5 and [e["steps"] for e in stopped["epochs"]] == [5]
    # The partly trained epoch's row: the test metrics of the state fit stopped with, evaluated after it.
    assert stopped["epochs"][0]["test_accuracy"] == stopped["final_test_accuracy"]
    assert [(e["epoch"], e["steps"]) for e in resumed["epochs"]] == [(1, 3), (2, 8)] and resumed["step"] == 16
    # Bitwise the run that never stopped: the same parameters, test metrics and the loss of every step.
    assert resumed["params_sha256"] == straight["params_sha256"] != stopped["params_sha256"]
    assert resumed["epochs"][-1]["test_loss"] == straight["epochs"][-1]["test_loss"]
    assert resumed["final_test_accuracy"] == straight["final_test_accuracy"] >= 0.95
    steps = list(range(1, 17))
    # Each step logged once: the stop at step 5 was saved, so the resumed run re-ran nothing.
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == steps
    assert [records(log)[i]["loss"] for i in steps] == [records(straight_log)[i]["loss"] for i in steps]
    assert sorted(int(p.name) for p in Path(ckpt).iterdir() if p.name.isdigit()) == [12, 15, 16]  # 3 kept
    assert records(log)[12]["time/save"] > 0 and records(log)[11]["time/save"] == 0  # save_every=3
    # Started again once finished: nothing left to train, the final state is restored and reported.
    again = train.train_and_evaluate(train.Config(checkpoint_dir=ckpt, **common))
    assert again["epochs"] == [] and again["step"] == 16
    assert again["params_sha256"] == straight["params_sha256"]
    assert again["final_test_accuracy"] == straight["final_test_accuracy"]


def test_sigterm_during_an_epoch_evaluation_lets_it_finish_then_stops_with_a_checkpoint(
    tiny_mnist, tmp_path, monkeypatch, capsys
):
    common = dict(dataset="mnist", data_dir=tiny_mnist, epochs=2, batch_size=32, progress=False)
    ckpt, log = str(tmp_path / "ckpt"), tmp_path / "metrics.jsonl"
    evaluate, calls = sc.evaluate, []

    def preempted_while_evaluating(*args):  # SIGTERM, as a scheduler sends it, during the first evaluation
        calls.append(len(calls))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args)

    monkeypatch.setattr(sc, "evaluate", preempted_while_evaluating)
    with pytest.raises(sc.Preempted) as stop:
        train.train_and_evaluate(train.Config(checkpoint_dir=ckpt, metrics_log=str(log), **common))
    # Stopped at the step boundary after the evaluation (epoch 1's last step, 8), saved there, status 143.
    assert (stop.value.code, stop.value.step, sc.latest_checkpoint_step(ckpt)) == (143, 8, 8)
    assert calls == [0] and "epoch 1: train loss" in capsys.readouterr().out  # the evaluation finished
    assert [r["step"] for r in records(log).values() if "test/accuracy" in r] == [8]
    resumed = train.train_and_evaluate(train.Config(checkpoint_dir=ckpt, **common))
    assert f"resuming from {ckpt} at step 8 (epoch 2, batch 1 of 8)" in capsys.readouterr().out
    assert [(e["epoch"], e["steps"]) for e in resumed["epochs"]] == [(2, 8)] and resumed["step"] == 16


KILLER = """
import os, signal, sys
sys.path.insert(0, {example!r})
import main
import spmdcomm as sc

fit = sc.fit


def fit_killed_on_the_first_attempt(*args, callback, **kwargs):
    def die_mid_epoch(i, metrics):  # rank 1 of the first attempt, when step {kill_at}'s metrics arrive
        if sc.restart_count() == 0 and sc.process_index() == 1 and i + 1 == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        callback(i, metrics)

    return fit(*args, callback=die_mid_epoch, **kwargs)


sc.fit = fit_killed_on_the_first_attempt
main.main()
"""


def test_two_processes_killed_mid_epoch_restart_and_train_like_one_process(launch, tmp_path):
    # Rank 1 SIGKILLs itself in the first attempt's step 13 of 24 (checkpoints every 5 steps); the launcher
    # restarts both processes, which resume from the latest checkpoint. 2 processes x 2 devices split every
    # global batch of 32 as 8 devices in this process do, so the job trains the same model as the run here;
    # only the order of float additions differs.
    script = tmp_path / "killed_main.py"
    script.write_text(KILLER.format(example=str(MAIN.parent), kill_at=13))
    ckpt, empty = tmp_path / "ckpt", str(tmp_path / "empty")
    args = ["--data-dir", empty, "--epochs", "1", "--max-steps", "24", "--no-progress", "--checkpoint-dir", ckpt]
    args += ["--save-every", "5", "--watchdog-timeout", "60", "--metrics-log", tmp_path / "metrics.{process}.jsonl"]
    res = launch(script, *args, "--json", tmp_path / "summary.json", timeout=300, max_restarts=1)
    output = res.stdout + res.stderr
    assert "training on scikit-learn's bundled digits" in output
    # The first failure the launcher polls: rank 1's SIGKILL, or rank 0's collective losing it (exit 1 at once).
    assert re.search(r"was killed by SIGKILL|exited with status 1", output) and "restart 1 of 1" in output
    resumed_at = int(re.search(r"\[rank 0\] resuming from \S+ at step (\d+) \(epoch 1, ", res.stdout)[1])
    assert resumed_at in (5, 10, 15, 20)  # a checkpoint mid-epoch (44 steps), before the stop at 24
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["dataset"] == "digits" and s["processes"] == 2 and s["devices"] == 4 and s["restarts"] == 1
    assert s["step"] == 24 and [e["steps"] for e in s["epochs"]] == [24 - resumed_at]

    here_log = tmp_path / "here.jsonl"
    here = train.train_and_evaluate(
        train.Config(data_dir=empty, epochs=1, max_steps=24, metrics_log=str(here_log), progress=False)
    )
    job, job_1, mine = (records(p) for p in (tmp_path / "metrics.0.jsonl", tmp_path / "metrics.1.jsonl", here_log))
    # Each process logs every step it ran after the restart. Before the kill, a step's record is written one
    # in-flight window after its dispatch, so the records of the steps just before the checkpoint the job
    # resumed from may be missing; every step that is there has the same (global) metrics on both processes.
    assert sorted(mine) == list(range(1, 25)) and set(range(1, 14)) | set(range(resumed_at + 1, 25)) <= set(job_1)
    assert set(range(resumed_at + 1, 25)) <= set(job) and all(set(PHASES) <= set(r) for r in job.values())
    assert all(job_1[i]["loss"] == job[i]["loss"] for i in set(job) & set(job_1))
    logged = sorted(job)
    job_losses, my_losses = ([m[i]["loss"] for i in logged] for m in (job, mine))
    np.testing.assert_allclose(job_losses, my_losses, rtol=1e-3)
    assert np.mean(job_losses[-4:]) < 0.8 * np.mean(job_losses[:4]), job_losses
    assert s["final_test_accuracy"] >= 0.6  # 24 steps; guessing gives 0.1, 3 full epochs 0.98
    assert abs(s["final_test_accuracy"] - here["final_test_accuracy"]) <= 2 / 360  # 360 test images


def test_tensorboard_dir_without_tensorboardX_says_what_to_install(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("mnist_main", MAIN)
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    with pytest.raises(SystemExit) as exit_info:
        main.main(["--tensorboard-dir", "tb"])
    assert exit_info.value.code == 2
    assert "--tensorboard-dir needs tensorboardX: pip install 'spmdcomm[tensorboard]'" in capsys.readouterr().err
