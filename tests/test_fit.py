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

PHASES = sorted(f"time/{name}" for name in sc.reliability.PHASES)  # data, dispatch, devices, sync, save, hooks, other


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
    # The first step compiled its program (same shapes after it: no other step did).
    assert [i for i, h in enumerate(history) if h["time/compile"] > 0] == [0]
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
    with pytest.raises(sc.Preempted) as stopped:
        sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, callback=terminate)
    assert isinstance(stopped.value, SystemExit)  # uncaught, it ends the process with the preemption status
    assert stopped.value.code == sc.PREEMPTED_EXIT_CODE == 143
    stop_step = sc.latest_checkpoint_step(ckpt)
    assert stopped.value.step == stop_step
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


def eval_metric_fn(params, batch, *, apply_fn, model_state, mask):
    logits = apply_fn({"params": params, **model_state}, batch["x"], train=False)
    correct = (logits.argmax(-1) == batch["y"]).astype(np.float32)
    return {"accuracy": sc.masked_mean(correct, mask), "logit_mean": sc.masked_mean(logits.mean(-1), mask)}


def test_evaluate_averages_exactly_over_an_eval_set_with_a_padded_last_batch():
    state = job.fresh_state(mesh())
    data = job.dataset()  # 44 examples: batches of 16 leave a last batch of 12 real rows
    batches = [sc.pad_batch({k: v[i : i + 16] for k, v in data.items()}, 16) for i in range(0, 44, 16)]
    got = sc.evaluate(sc.make_eval_step(eval_metric_fn), state, batches)
    one_batch = sc.make_eval_step(eval_metric_fn)(state, data)  # the whole set at once: the exact means
    assert got["examples"] == 44.0
    np.testing.assert_allclose(got["accuracy"], float(one_batch["accuracy"]), rtol=1e-6)
    np.testing.assert_allclose(got["logit_mean"], float(one_batch["logit_mean"]), rtol=1e-6)
    # The plain mean of the three batch means would weigh the 12 last rows like 16.
    plain = np.mean([float(sc.make_eval_step(eval_metric_fn)(state, b)["logit_mean"]) for b in batches])
    assert abs(plain - got["logit_mean"]) > 1e-4
    with pytest.raises(sc.SpmdError, match="evaluate: eval_step is a function.*make_eval_step"):
        sc.evaluate(eval_metric_fn, state, batches)


def test_max_steps_and_hooks_per_step_and_per_epoch(tmp_path):
    """18 steps of 6 per epoch; max_steps=14 stops mid-epoch 2 with the loader at the first untrained batch; epoch
    hooks see the state after each epoch's last step, step hooks every 5 steps; their results join the metrics."""
    step, evaluate = sc.make_train_step(job.loss_fn), sc.make_eval_step(eval_metric_fn)
    calls = []

    def on_epoch(state, *, step, epoch):
        calls.append(("epoch", step, epoch, int(state.step)))
        return {"eval/accuracy": sc.evaluate(evaluate, state, [sc.pad_batch(job.dataset(), 48)])["accuracy"]}

    def on_step(state, *, step, epoch):
        calls.append(("step", step, epoch, int(state.step)))

    hooks = [sc.Hook(on_epoch, every_epochs=1), sc.Hook(on_step, every_steps=5)]
    data = job.loader(mesh())
    final, history = sc.fit(step, job.fresh_state(mesh()), data, max_steps=14, hooks=hooks)
    assert int(final.step) == 14 and len(history) == 14
    assert data.state_dict() == {"epoch": 2, "batch": 2, "global_batch_size": 8}
    assert calls == [("step", 5, 0, 5), ("epoch", 6, 0, 6), ("step", 10, 1, 10), ("epoch", 12, 1, 12)]
    assert [i for i, h in enumerate(history) if "eval/accuracy" in h] == [5, 11]
    # The hooks' time is their own phase; steps without a hook spent none there.
    assert [i for i, h in enumerate(history) if h["time/hooks"] > 0] == [4, 5, 9, 11]
    # The hook evaluated the state after step 12: the same numbers as evaluating the run stopped there.
    at_12, _ = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), max_steps=12)
    expected = sc.evaluate(evaluate, at_12, [sc.pad_batch(job.dataset(), 48)])["accuracy"]
    assert history[11]["eval/accuracy"] == pytest.approx(expected, abs=1e-7)

    # Resumed from a checkpoint, max_steps counts global steps and epoch hooks keep their epochs.
    ckpt, calls[:] = tmp_path / "ckpt", []
    sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), max_steps=8, checkpoint_dir=ckpt)
    resumed, again = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, hooks=hooks)
    assert int(resumed.step) == 18 and len(again) == 10
    assert [c[:3] for c in calls] == [("step", 10, 1), ("epoch", 12, 1), ("step", 15, 2), ("epoch", 18, 2)]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_steps": 0}, "max_steps=0 must be a positive int"),
        ({"hooks": [lambda state, **kw: None]}, "hooks holds a function, not a spmdcomm.Hook"),
        ({"hooks": [sc.Hook(lambda state, **kw: {"loss": 1.0}, every_steps=1)]}, r"returned \['loss'\].*prefix"),
        ({"hooks": [sc.Hook(lambda state, **kw: 3.0, every_steps=1)]}, "returned a float; expected a dict"),
    ],
)
def test_fit_refuses_bad_loop_options(kwargs, error):
    with pytest.raises(sc.SpmdError, match=error):
        sc.fit(sc.make_train_step(job.loss_fn), job.fresh_state(mesh()), job.loader(mesh()), **kwargs)


def test_epochs_are_0_based_and_every_epochs_counts_from_the_first():
    # As Hook's docstring and docs/ddp.md say: every_epochs=2 runs after the 0-based epochs 1, 3, ...
    from spmdcomm.train.hooks import due_hooks

    hook = sc.Hook(lambda state, **kw: None, every_epochs=2)
    ran = [epoch for epoch in range(6) if due_hooks((hook,), 10 * epoch, epoch, ended_epoch=True)]
    assert ran == [1, 3, 5]
    assert due_hooks((hook,), 11, 1, ended_epoch=False) == []  # not before the epoch's last step


def test_hooks_are_checked_when_built_and_epoch_hooks_need_epochs():
    with pytest.raises(sc.SpmdError, match=r"Hook: give exactly one of every_steps and every_epochs \(got neither\)"):
        sc.Hook(lambda state, **kw: None)
    with pytest.raises(sc.SpmdError, match="every_epochs=0 must be a positive int"):
        sc.Hook(lambda state, **kw: None, every_epochs=0)
    batches = [jax.tree.map(lambda x: x[:8], job.dataset())] * 2
    with pytest.raises(sc.SpmdError, match="every_epochs needs data that counts epochs, but data is a list"):
        sc.fit(
            sc.make_train_step(job.loss_fn),
            job.fresh_state(mesh()),
            batches,
            hooks=[sc.Hook(lambda state, **kw: None, every_epochs=1)],
        )
