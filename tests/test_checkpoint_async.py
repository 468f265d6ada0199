"""Asynchronous saves (``save_checkpoint(..., asynchronous=True)``): training goes on while a save writes, a process
has at most one save in flight, a save restores bitwise, and a save that fails in the background is raised (at
the next save, by its handle, at exit) while the previous complete checkpoint stays the latest.

A save is held in flight (or made to fail) at orbax's final rename of its temporary directory, as
tests/workers/resume_job.py's ``--hang-at rename`` does. ``fit(..., async_save=True)`` resuming bitwise is in
tests/test_resume.py and tests/test_recovery.py. In a job of two processes (tests/workers/mp_async_save.py), a
background save that fails on one process is raised on both at once, naming that process, and a process that does
not finish is named by the other one's error when the save's timeout passes."""

from __future__ import annotations

import errno
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import optax
import pytest
from timing import LATE_S

import spmdcomm as sc
from spmdcomm.checkpoint import CheckpointSave, _async

NOISE = np.random.default_rng(1).standard_normal(4096).astype(np.float32)


def state_of(value: float) -> sc.TrainState:
    params = {"w": NOISE + np.float32(value), "b": np.full(2, value, np.float32)}
    return sc.TrainState.create(params=params, tx=optax.adam(1e-3), mesh=sc.data_mesh(devices=jax.devices()[:2]))


def host(state: sc.TrainState) -> list[bytes]:
    return [np.asarray(jax.device_get(x)).tobytes() for x in jax.tree.leaves(state)]


def hold_renames(monkeypatch, steps: set[int], *, fail: bool = False) -> threading.Event:
    """Makes the saves of ``steps`` wait before the rename that completes them until the returned event is set, or
    (``fail``) fail there with a full disk's error."""
    from orbax.checkpoint._src.path import atomicity

    release = threading.Event()

    def held(original):
        async def finalize(self, *args, **kwargs):
            if self.get().name.split(".")[0] in {str(s) for s in steps}:
                if fail:
                    raise OSError(errno.ENOSPC, "No space left on device")
                assert release.wait(120), "the test never released the save"
            return await original(self, *args, **kwargs)

        return finalize

    for cls in vars(atomicity).values():
        if isinstance(cls, type) and "finalize" in vars(cls):
            monkeypatch.setattr(cls, "finalize", held(vars(cls)["finalize"]))
    return release


def test_training_goes_on_while_a_save_writes_one_save_at_a_time_and_each_restores_bitwise(tmp_path, monkeypatch):
    release = hold_renames(monkeypatch, {1, 2})
    state = state_of(1.0)
    before = host(state)
    first = sc.save_checkpoint(tmp_path, state, step=1, asynchronous=True)
    assert isinstance(first, CheckpointSave) and first.step == 1 and not first.done()

    # A donating update of the saved arrays runs to completion while the save is held in flight.
    update = jax.jit(lambda p: jax.tree.map(lambda x: x * 2 + 1, p), donate_argnums=0)
    state = state.replace(params=jax.block_until_ready(update(state.params)))
    assert not first.done() and "writing" in repr(first)
    assert sc.latest_checkpoint_step(tmp_path) is None  # not the latest before it is complete
    assert [p.name for p in tmp_path.iterdir()] == ["1.orbax-checkpoint-tmp"]

    # A second save waits for the first one: it writes nothing while the first is held.
    second: list[CheckpointSave] = []
    thread = threading.Thread(
        target=lambda: second.append(sc.save_checkpoint(tmp_path, state, step=2, asynchronous=True))
    )
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and [p.name for p in tmp_path.iterdir()] == ["1.orbax-checkpoint-tmp"]
    release.set()
    thread.join(120)
    assert first.wait() == 1 and first.done()
    assert second[0].wait() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
    assert host(sc.restore_checkpoint(tmp_path, state_of(0.0), step=1)) == before
    assert host(sc.restore_checkpoint(tmp_path, state_of(0.0))) == host(state)


def test_a_failed_background_save_is_raised_and_the_previous_checkpoint_stays_the_latest(tmp_path, monkeypatch, capfd):
    sc.save_checkpoint(tmp_path, state_of(1.0), step=1, asynchronous=True).wait()
    hold_renames(monkeypatch, {2, 3}, fail=True)
    failed = sc.save_checkpoint(tmp_path, state_of(2.0), step=2, asynchronous=True)
    message = (
        f"spmdcomm.save_checkpoint: the asynchronous save of checkpoint 2 in {str(tmp_path)!r} failed in the "
        "background: OSError: [Errno 28] No space left on device. The checkpoint is not complete: the previous "
        "complete checkpoint stays the latest"
    )
    with pytest.raises(sc.SpmdError) as caught:  # by the next save, which then saves nothing
        sc.save_checkpoint(tmp_path, state_of(3.0), step=3)
    assert str(caught.value).startswith(message) and isinstance(caught.value.__cause__, Exception)
    assert sc.latest_checkpoint_step(tmp_path) == 1 and not (tmp_path / "3").exists()
    with pytest.raises(sc.SpmdError) as again:  # by its handle, every time
        failed.wait()
    assert str(again.value) == str(caught.value) and failed.done() and "failed" in repr(failed)

    # A process that exits with a failed save it never waited for prints the error.
    sc.save_checkpoint(tmp_path, state_of(3.0), step=3, asynchronous=True)
    capfd.readouterr()
    _async._wait_at_exit()
    err = capfd.readouterr().err
    assert (
        message.replace("checkpoint 2", "checkpoint 3") in err and "The process exits without this checkpoint." in err
    )

    monkeypatch.undo()  # the disk has room again: the unfinished saves are removed and step 2 saved
    assert sc.save_checkpoint(tmp_path, state_of(2.0), step=2, asynchronous=True).wait() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
    assert host(sc.restore_checkpoint(tmp_path, state_of(0.0))) == host(state_of(2.0))


@pytest.mark.parametrize(
    ("timeout", "asynchronous", "problem"),
    [
        (5, False, "bounds the background part of asynchronous saves, and asynchronous is False"),
        (0, True, "must be a number of seconds > 0"),
        (True, True, "must be a number of seconds > 0"),
    ],
)
def test_a_background_save_takes_a_timeout_of_seconds(tmp_path, timeout, asynchronous, problem):
    state = state_of(1.0)
    with pytest.raises(sc.SpmdError, match=rf"^spmdcomm\.save_checkpoint: timeout={timeout} {problem}\. Fix: "):
        sc.save_checkpoint(tmp_path, state, step=1, asynchronous=asynchronous, timeout=timeout)
    data = sc.IteratorLoader([np.zeros(2, np.float32)], resume="skip")
    with pytest.raises(
        sc.SpmdError,
        match=rf"^spmdcomm\.fit: save_timeout={timeout} {problem.replace('asynchronous is', 'async_save is')}",
    ):
        sc.fit(None, state, data, checkpoint_dir=tmp_path, async_save=asynchronous, save_timeout=timeout)
    with pytest.raises(
        sc.SpmdError, match="save_every, max_to_keep, async_save and save_timeout need a checkpoint_dir"
    ):
        sc.fit(None, state, data, save_timeout=timeout)
    assert list(tmp_path.iterdir()) == []
    assert sc.save_checkpoint(tmp_path, state, step=1, asynchronous=True, timeout=30).wait() == 1


EXITING = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
import numpy as np, optax
import spmdcomm as sc
state = sc.TrainState.create(params={"w": np.arange(1 << 20, dtype=np.float32)}, tx=optax.sgd(0.1))
sc.save_checkpoint(sys.argv[1], state, step=7, asynchronous=True)
print("RETURNED", flush=True)
"""


def test_a_process_that_exits_with_a_save_in_flight_completes_it_first(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", EXITING, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "RETURNED" in out.stdout, out.stderr
    assert sc.latest_checkpoint_step(tmp_path / "ckpt") == 7, out.stderr


STALL_TIMEOUT = 4.0  # seconds: the timeout of the save that a stalled process does not finish


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_background_save_that_fails_on_one_process_is_raised_on_every_process_within_its_timeout(launch, tmp_path):
    root = tmp_path / "ckpt"
    out = launch("mp_async_save.py", root, STALL_TIMEOUT, timeout=120).stdout
    saves = {
        (int(rank), int(step)): (float(seconds), outcome)
        for rank, step, seconds, outcome in re.findall(r"^\[rank (\d)\] SAVE (\d) ([\d.]+) (.*)$", out, re.M)
    }
    latest = [int(s) for s in re.findall(r"^\[rank 0\] LATEST (\d+)$", out, re.M)]
    assert sorted(saves) == [(r, s) for r in (0, 1) for s in range(1, 6)] and latest == [1, 1, 1, 1, 5], out

    def failed(step: int, what: str, rank: int) -> str:
        return (
            f"CAUGHT spmdcomm.save_checkpoint: the asynchronous save of checkpoint {step} in {str(root)!r} {what} "
            f"(seen on process {rank}). The checkpoint is not complete: the previous complete checkpoint stays the "
            "latest"
        )

    full = "OSError: [Errno 28] No space left on device"
    for rank in (0, 1):
        assert saves[rank, 1][1] == saves[rank, 5][1] == "OK", out
        # One process's write (2), or process 0's rename (3), fails: both processes raise its error at once, not
        # at the save's timeout (60 s) nor orbax's barrier's (20 minutes).
        for step, culprit in ((2, 1), (3, 0)):
            seconds, outcome = saves[rank, step]
            assert outcome.startswith(failed(step, f"failed in the background on process {culprit}: {full}", rank))
            assert seconds < LATE_S, out
        # Process 1 stalls: process 0 raises at the timeout naming it; process 1 when its write ends.
        late = (
            f"did not complete within its timeout of {STALL_TIMEOUT:g} s: process(es) [1] had not finished it "
            "(process 0 waited for them at orbax's barrier '_async_write_complete.4')"
        )
        seconds, outcome = saves[rank, 4]
        if rank == 0:
            assert outcome.startswith(failed(4, late, 0)), out
            assert STALL_TIMEOUT <= seconds < STALL_TIMEOUT + LATE_S, out
        else:
            assert outcome.startswith(
                f"CAUGHT spmdcomm.save_checkpoint: the asynchronous save of checkpoint 4 in "
                f"{str(root)!r} {late}; failed in the background on process 1: TimeoutError"
            ), out
            assert STALL_TIMEOUT + 3 <= seconds < STALL_TIMEOUT + 3 + LATE_S, out
