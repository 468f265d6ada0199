"""Asynchronous saves (``save_checkpoint(..., asynchronous=True)``): training goes on while a save writes, a process
has at most one save in flight, a save restores bitwise, and a save that fails in the background is raised (at
the next save, by its handle, at exit) while the previous complete checkpoint stays the latest.

A save is held in flight (or made to fail) at orbax's final rename of its temporary directory, as
tests/workers/resume_job.py's ``--hang-at rename`` does. ``fit(..., async_save=True)`` resuming bitwise is in
tests/test_resume.py and tests/test_recovery.py."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading

import jax
import numpy as np
import optax
import pytest

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
