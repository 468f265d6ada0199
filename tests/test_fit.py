"""fit's view of a run: where each step's time goes (metrics, JSON lines, TensorBoard), a SIGTERM that stops at
a checkpoint and resumes bitwise, and a stuck step that the watchdog reports.

The training job (model, data, loader) is tests/workers/resume_job.py, shared with tests/test_resume.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("resume_job", ROOT / "tests" / "workers" / "resume_job.py")
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

PHASES = sorted(f"time/{name}" for name in sc.PHASES)  # data, dispatch, devices, sync, save, other


def mesh():
    return sc.data_mesh(devices=jax.devices()[:2])


def leaves(state):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(state)]


def test_every_step_reports_its_phase_times_and_the_log_continues_after_a_resume(tmp_path):
    log = tmp_path / "metrics.{process}.jsonl"
    step = sc.make_train_step(job.loss_fn)
    state, history = sc.fit(
        step,
        job.fresh_state(mesh()),
        job.loader(mesh()),
        checkpoint_dir=tmp_path / "ckpt",
        save_every=4,
        metrics_log=log,
    )
    assert all(sorted(k for k in h if k.startswith("time/")) == PHASES for h in history)
    assert all(all(h[k] >= 0 for k in PHASES) for h in history)
    # Saves block the loop: the steps that saved (4, 8, ...) spent time saving, the others none.
    saved = [i + 1 for i, h in enumerate(history) if h["time/save"] > 0]
    assert saved == list(range(4, len(history) + 1, 4)), saved
    records = [json.loads(line) for line in (tmp_path / "metrics.0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(history) + 1))
    assert [r["loss"] for r in records] == [h["loss"] for h in history]
    # A second fit on the finished run resumes from its last checkpoint: nothing left to train or to log.
    _, again = sc.fit(
        step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=tmp_path / "ckpt", metrics_log=log
    )
    assert again == [] and len((tmp_path / "metrics.0.jsonl").read_text().splitlines()) == len(history)


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tensorboard extra (pip install 'spmdcomm[tensorboard]')")
    step = sc.make_train_step(job.loss_fn)
    sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), tensorboard_dir=tmp_path / "tb{process}")
    # tests/test_phases.py reads the records back; here: fit's scalars reached an event file.
    (events,) = (tmp_path / "tb0").glob("events.out.tfevents.*")
    data = events.read_bytes()
    assert b"loss" in data and b"time/data" in data and b"time/devices" in data


def test_sigterm_stops_at_a_checkpoint_and_the_resumed_run_is_bitwise_identical(tmp_path):
    step = sc.make_train_step(job.loss_fn)
    straight, _ = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()))

    def terminate(i, metrics):
        if i == 4:  # as SLURM or Kubernetes would, while the loop runs
            os.kill(os.getpid(), signal.SIGTERM)

    ckpt = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as stopped:
        sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, callback=terminate)
    assert stopped.value.code == sc.PREEMPTED_EXIT_CODE == 143
    stop_step = sc.latest_checkpoint_step(ckpt)
    assert 5 <= stop_step < 18  # saved where it stopped, mid-run (no save_every)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # fit put the previous handler back
    resumed, history = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt)
    assert len(history) == 18 - stop_step
    for a, b in zip(leaves(resumed), leaves(straight), strict=True):
        assert a.tobytes() == b.tobytes()


def test_preemption_needs_a_checkpoint_dir():
    with pytest.raises(sc.SpmdError, match="preemption=True saves a checkpoint.*Fix: pass checkpoint_dir"):
        sc.fit(sc.make_train_step(job.loss_fn), job.fresh_state(mesh()), job.loader(mesh()), preemption=True)


STUCK = """
import importlib.util, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
import spmdcomm as sc
spec = importlib.util.spec_from_file_location("resume_job", sys.argv[1])
job = importlib.util.module_from_spec(spec); spec.loader.exec_module(job)

class Stuck:  # the data source hangs before its 4th batch
    def __init__(self, inner): self.inner = inner
    def __iter__(self):
        for i, batch in enumerate(self.inner):
            if i == 3:
                time.sleep(600)
            yield batch

mesh = sc.data_mesh()
sc.fit(sc.make_train_step(job.loss_fn), job.fresh_state(mesh), Stuck(job.loader(mesh)), watchdog_timeout=3)
"""


@pytest.mark.slow
def test_a_stuck_step_is_reported_and_ends_the_process(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, str(script), str(ROOT / "tests" / "workers" / "resume_job.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    text = out.stdout + out.stderr
    assert out.returncode == sc.STUCK_EXIT_CODE == 75, text
    assert "<- stuck" in text and "data" in text, text
    assert "last step" in text.lower() or "step" in text, text
