"""End-to-end proof that a long run survives failures: 2 processes x 2 devices on 127.0.0.1 under ``spmdcomm-launch``
train tests/workers/recovery_job.py (resume_job.py's MLP with BatchNorm and dropout, Adam, 24 steps through
``sc.fit``, checkpoints every 4 steps) while the test kills a rank twice (once inside a checkpoint save) and then
stalls one, in one job restarted three times, or preempts the job; each run must end with every leaf of the state
(parameters, optimizer state, step, model state, RNG) bitwise equal to an uninterrupted run's, launched once per
module on the same device layout. The steps, ranks and attempts of the failures are drawn from a seeded generator.

The figures of docs/reliability.md (time to detection, steps redone, time to stop) come from these runs."""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from ddp_models import write_initial
from test_watchdog import tables
from timing import LATE_S

import spmdcomm as sc
from spmdcomm.launch import GRACE_SECONDS

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
_spec = importlib.util.spec_from_file_location("resume_job", WORKERS / "resume_job.py")
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

SEED = 20261122
PER_EPOCH = -(-job.EXAMPLES // job.GLOBAL_BATCH)  # 6 global batches, the last one padded
EPOCHS, SAVE_EVERY = 4, 4  # recovery_job.py's defaults
STEPS = EPOCHS * PER_EPOCH  # 24
WATCHDOG_TIMEOUT = 5.0
SLOW_COMPILE = 8  # seconds a process's compilation takes longer, in the stalled test: over the watchdog's timeout


def mid_epoch(step: int) -> bool:
    """Whether ``state.step == step`` falls inside an epoch (neither its first nor its last batch is next)."""
    return step % PER_EPOCH not in (0, 1, PER_EPOCH - 1)


def last_save(step: int) -> int:
    """The newest periodic checkpoint once ``step`` steps completed."""
    return step // SAVE_EVERY * SAVE_EVERY


def assert_bitwise(actual_file: Path, expected_file: Path) -> None:
    with np.load(actual_file) as actual, np.load(expected_file) as expected:
        assert sorted(actual) == sorted(expected)
        for part in (".step", ".params", ".opt_state", ".model_state", ".rng"):  # the whole state is compared
            assert any(key.startswith(part) for key in expected), part
        for key in expected:
            assert actual[key].dtype == expected[key].dtype and actual[key].shape == expected[key].shape, key
            assert actual[key].tobytes() == expected[key].tobytes(), key
        assert int(actual[".step"]) == STEPS


def lines(pattern: str, text: str) -> list[tuple[str, ...]]:
    return re.findall(pattern, text, re.M)


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> list[str]:
    """``--initial DIR`` for every job of this module: the initial variables, drawn here once by the program every
    process would run (processes other than 0 read no compilation cache: each would compile the init again)."""
    where = tmp_path_factory.mktemp("initial")
    write_initial(where, variables=job.initial_variables())
    return ["--initial", str(where)]


@pytest.fixture(scope="module")
def straight(module_launch, tmp_path_factory, initial) -> Path:
    """The uninterrupted run's final state, launched once for the tests of this module that compare with it."""
    out = tmp_path_factory.mktemp("straight") / "straight.npz"
    module_launch("recovery_job.py", "-", out, *initial)
    return out


# ---- 1, 4 and 2: SIGKILL mid-epoch, SIGKILL inside a checkpoint save, a rank that sleeps forever ------------


def draw_failures() -> dict[str, int]:
    """The steps and ranks of the failures of ``failures``' job, drawn from the seeded generators."""
    rng = random.Random(SEED)
    # The rank dies instead of running kill_step, mid-epoch and between two saves (so steps are redone).
    kill = rng.choice([s for s in range(5, 18) if mid_epoch(s - 1) and (s - 1) % SAVE_EVERY])
    save = rng.choice([s for s in range(kill + 1, STEPS - 1) if s % SAVE_EVERY == 0 and mid_epoch(s)])
    kill_rank, save_rank = rng.randrange(2), rng.randrange(2)
    rng = random.Random(SEED + 2)
    # Mid-epoch, after the step attempt 2 resumes from (save - SAVE_EVERY) and before the end.
    stall = rng.choice([s for s in range(save - SAVE_EVERY + 2, STEPS - 1) if mid_epoch(s - 1)])
    return dict(
        kill=kill, save=save, kill_rank=kill_rank, save_rank=save_rank, stall=stall, stall_rank=rng.randrange(2)
    )


@pytest.fixture(scope="module")
def failures(module_launch, tmp_path_factory, initial):
    """One job with three restarts, for the tests of failures 1, 4 and 2 (one launch: each attempt starts two
    processes): attempt 0 loses a rank mid-epoch, attempt 1 a rank inside a checkpoint save, attempt 2 stalls a
    rank until the watchdog ends it, attempt 3 completes. On attempts 2 and 3, one process compiles the step for
    longer than the watchdog's timeout (the other one on attempt 2, the stalled one after the restart): that is no
    stall. Returns ``(drawn, result, ckpt, resumed)``."""
    drawn, where = draw_failures(), tmp_path_factory.mktemp("failures")
    ckpt, resumed = where / "ckpt", where / "resumed.npz"
    faults = [f"0:{drawn['kill_rank']}:{drawn['kill']}:kill", f"1:{drawn['save_rank']}:{drawn['save']}:kill-in-save"]
    faults += [f"2:{drawn['stall_rank']}:{drawn['stall']}:stall"]
    faults += [f"2:{1 - drawn['stall_rank']}:{SLOW_COMPILE}:slow-compile"]
    faults += [f"3:{drawn['stall_rank']}:{SLOW_COMPILE}:slow-compile"]
    args = [arg for fault in faults for arg in ("--fault", fault)]
    res = module_launch(
        "recovery_job.py", ckpt, resumed, *initial, "--watchdog-timeout", WATCHDOG_TIMEOUT, *args, max_restarts=3
    )
    return drawn, res, ckpt, resumed


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_job_killed_twice_once_inside_a_save_ends_bitwise_like_one_never_killed(failures, straight):
    drawn, res, ckpt, resumed = failures
    kill_step, save_step, kill_rank, save_rank = (drawn[k] for k in ("kill", "save", "kill_rank", "save_rank"))
    out, err = res.stdout, res.stderr
    chosen = f"kill rank {kill_rank} before step {kill_step}, rank {save_rank} in the save of {save_step}"

    # Attempt 0: the rank dies mid-epoch; attempt 1 resumes from the last checkpoint before it.
    assert lines(r"^\[rank (\d)\] KILLING before step (\d+)$", out) == [(str(kill_rank), str(kill_step))], chosen
    # The launcher names the first failure it polls in each attempt: the killed rank, or its peer whose
    # collective lost it (an uncaught exception exits at once); the KILLING lines above say who was killed.
    assert len(re.findall(r"rank \d \(pid \d+\) (?:was killed by SIGKILL|exited with status 1)", err)) == 2, err
    first_resume = last_save(kill_step - 1)
    assert sorted(lines(r"^\[rank (\d)\] ATTEMPT 1 resumes from step (\d+)$", out)) == [
        ("0", str(first_resume)),
        ("1", str(first_resume)),
    ], out
    # Attempt 1: the rank dies after writing its shards of checkpoint save_step, before the save completes.
    (on_disk,) = lines(rf"^\[rank {save_rank}\] KILLING in the save of checkpoint {save_step}; on disk: (.*)$", out)
    on_disk = ast.literal_eval(on_disk)
    assert str(save_step) not in on_disk and any(name.startswith(f"{save_step}.") for name in on_disk), on_disk
    # 4: the previous checkpoint is still the latest complete one, and attempt 2 resumes from it.
    assert sorted(lines(r"^\[rank (\d)\] ATTEMPT 2 resumes from step (\d+)$", out)) == [
        ("0", str(save_step - SAVE_EVERY)),
        ("1", str(save_step - SAVE_EVERY)),
    ], out
    assert "restart 2 of 3" in err, err
    # Attempt 2 trains on from there (and stalls after saving save_step again: the test below); the job ends
    # bitwise like one never killed.
    assert_bitwise(resumed, straight)
    assert sc.latest_checkpoint_step(ckpt) == STEPS
    assert sc.checkpoint_extra(ckpt)["data"] == {"epoch": EPOCHS, "batch": 0, "global_batch_size": job.GLOBAL_BATCH}
    assert not any(p.name.startswith(f"{save_step}.") for p in ckpt.iterdir())  # the unfinished save was removed


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stalled_rank_is_named_by_every_process_and_a_restart_completes_bitwise(failures, straight):
    drawn, res, _, resumed = failures
    stall_step, stall_rank = drawn["stall"], drawn["stall_rank"]
    out, err = res.stdout, res.stderr
    assert lines(r"^\[rank (\d)\] SLEEPING before step (\d+) at [\d.]+$", out) == [(str(stall_rank), str(stall_step))]
    assert sorted(lines(rf"^\[rank (\d)\] COMPILING SLOWLY for {SLOW_COMPILE} s$", out)) == ["0", "1"], out
    found = tables(err)
    assert sorted(found) == [0, 1], err  # every process printed the table...
    for rank in (0, 1):
        assert len(lines(rf"^\[rank {rank}\] spmdcomm\.Watchdog: ", err)) == 1, err  # ...once: attempt 2's stall only
        _, step, phase, seconds, stuck = found[rank][stall_rank]
        assert (step, phase, stuck) == (str(stall_step - 1), "waiting for data", True), found
        # Printed at the timeout after the stall (the table's seconds in phase of the stalled process).
        assert WATCHDOG_TIMEOUT <= float(seconds) < WATCHDOG_TIMEOUT + LATE_S, found
        assert not found[rank][1 - stall_rank][4], found  # the other process is its victim, not named
    named = rf"Stuck: process {stall_rank} \(waiting for data for [\d.]+ s, last completed step {stall_step - 1}\)\."
    assert re.search(named, err), err
    # (A job the watchdog ended with no restart left exits with its status: test_watchdog.py.)
    assert f"exited with status {sc.STUCK_EXIT_CODE}" in err and "restart 3 of 3" in err, err
    # The restart resumes from the checkpoint the stalled attempt left and completes.
    saved = last_save(stall_step - 1)
    assert sorted(lines(r"^\[rank (\d)\] ATTEMPT 3 resumes from step (\d+)$", out)) == [
        ("0", str(saved)),
        ("1", str(saved)),
    ]
    done = lines(r"^\[rank (\d)\] DONE attempt (\d): trained (\d+) steps from step (\d+) to step (\d+)$", out)
    assert sorted(done) == [(r, "3", str(STEPS - saved), str(saved), str(STEPS)) for r in "01"], out
    assert_bitwise(resumed, straight)


# ---- 3: SIGTERM to the launcher ----------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_at_one_agreed_step_and_a_relaunch_ends_bitwise(
    launch, tmp_path, straight, initial
):
    """The saves are asynchronous: each process's stop waits for its save in flight (a periodic one, or the stop's
    own) before it exits, and the relaunch's saves write in the background too."""
    ready = random.Random(SEED + 3).choice([s for s in range(3, 10) if mid_epoch(s)])

    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.npz"
    res = launch(
        "recovery_job.py",
        ckpt,
        resumed,
        *initial,
        "--async-save",
        "--ready-at",
        ready,
        grace=GRACE_SECONDS,  # the launcher's default grace period covers agreeing, the steps in flight and the save
        sigterm_after=rf"^READY at step {ready}$",
        returncode=sc.PREEMPTED_EXIT_CODE,
    )
    out, err = res.stdout, res.stderr
    assert "received SIGTERM; stopping all processes (a stop, not a failure: no restart)" in err
    stops = lines(r"^\[rank (\d)\] PREEMPTED at step (\d+) \(status (\d+)\)$", out)
    assert sorted(rank for rank, _, _ in stops) == ["0", "1"], out + err
    assert len({step for _, step, _ in stops}) == 1 and {code for _, _, code in stops} == {"143"}, stops
    stop = int(stops[0][1])
    assert ready <= stop < STEPS, stops  # the SIGTERM came once step `ready` had its batch; the run had not ended
    assert sc.latest_checkpoint_step(ckpt) == stop  # saved where every process stopped
    position = {"epoch": stop // PER_EPOCH, "batch": stop % PER_EPOCH, "global_batch_size": job.GLOBAL_BATCH}
    assert sc.checkpoint_extra(ckpt)["data"] == position
    assert not resumed.exists()

    res = launch("recovery_job.py", ckpt, resumed, *initial, "--async-save")
    done = lines(r"^\[rank (\d)\] DONE attempt 0: trained (\d+) steps from step (\d+) to step (\d+)$", res.stdout)
    assert sorted(done) == [(r, str(STEPS - stop), str(stop), str(STEPS)) for r in "01"], res.stdout
    assert_bitwise(resumed, straight)


# ---- a preemption right after a periodic save ------------------------------------------------------------


class SigtermBefore:
    """The train step, except that before running step ``at`` (the step that makes ``state.step == at``) the
    process sends itself SIGTERM, as a scheduler would."""

    def __init__(self, step: sc.train.TrainStep, at: int):
        self.step, self.at, self.calls = step, at, 0
        self.max_in_flight = step.max_in_flight

    def __call__(self, state, batch):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.step(state, batch)


def test_a_stop_agreed_right_after_a_periodic_save_exits_with_that_checkpoint(tmp_path):
    """The stop step is the step fit has just saved: fit exits 143 keeping that checkpoint (saving the same
    step again used to fail in orbax with StepAlreadyExistsError), and the resumed run ends bitwise. The saves are
    asynchronous: the stop waits for the save of step 4, still in flight, before fit exits."""
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    step = sc.make_train_step(job.loss_fn)

    def loader():
        data = job.loader(mesh)
        data.epochs = 1
        return data

    straight, _ = sc.fit(step, job.fresh_state(mesh), loader())
    with pytest.raises(SystemExit) as stopped:
        sc.fit(
            SigtermBefore(step, 4),
            job.fresh_state(mesh),
            loader(),
            checkpoint_dir=tmp_path,
            save_every=2,
            async_save=True,
        )
    assert stopped.value.code == sc.PREEMPTED_EXIT_CODE
    assert sc.latest_checkpoint_step(tmp_path) == 4
    assert sc.checkpoint_extra(tmp_path)["data"] == {"epoch": 0, "batch": 4, "global_batch_size": job.GLOBAL_BATCH}

    state, history = sc.fit(
        step, job.fresh_state(mesh), loader(), checkpoint_dir=tmp_path, save_every=2, async_save=True
    )
    assert len(history) == PER_EPOCH - 4
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, got), want in zip(leaves, jax.tree.leaves(straight), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), jax.tree_util.keystr(path)
