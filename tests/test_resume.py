"""Exact resume: the sampler's and the loader's positions, fit's checkpoints (a run stopped after any step and
resumed through fit ends bitwise like one that never stopped, with dropout and BatchNorm), and a process SIGKILLed
while saving. A 2 x 2 process job whose rank is SIGKILLed mid-epoch (and again inside a save) and restarted is
tests/test_recovery.py's.

The training job (model, data, loader) is tests/workers/resume_job.py, shared with the subprocess tests."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import spmdcomm as sc

ROOT = Path(__file__).resolve().parents[1]
JOB_PATH = ROOT / "tests" / "workers" / "resume_job.py"
_spec = importlib.util.spec_from_file_location("resume_job", JOB_PATH)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

STEPS = job.EPOCHS * -(-job.EXAMPLES // job.GLOBAL_BATCH)  # 3 epochs x 6 batches
DEVICES = 2  # the subprocess job runs on 2 devices too, so its checkpoints resume here unchanged


class Interrupted(Exception):
    pass


class StopAfter:
    """The train step, except that call ``calls + 1`` raises :class:`Interrupted` instead of running."""

    def __init__(self, step: sc.train.TrainStep, calls: int):
        self.step, self.left = step, calls
        self.max_in_flight = step.max_in_flight

    def __call__(self, state, batch):
        if self.left == 0:
            raise Interrupted
        self.left -= 1
        return self.step(state, batch)


def mesh():
    return sc.data_mesh(devices=jax.devices()[:DEVICES])


def host_leaves(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def assert_bitwise(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert actual.keys() == expected.keys()
    assert any("rng" in k for k in actual) and any("batch_stats" in k for k in actual)  # RNG and model state too
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, key
        assert actual[key].tobytes() == value.tobytes(), key


@pytest.fixture(scope="module")
def step():
    return sc.make_train_step(job.loss_fn)


@pytest.fixture(scope="module")
def straight(step):
    """Every leaf of the final state of the run that never stopped (no checkpoints)."""
    state, history = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()))
    assert len(history) == STEPS and int(state.step) == STEPS
    return host_leaves(state)


# ---- ShardedSampler and Loader positions -----------------------------------------------------------------


def test_sampler_resumes_mid_epoch_with_exactly_the_remaining_batches():
    sampler = sc.ShardedSampler(23, shard_index=1, num_shards=2, seed=5)
    full = list(sampler.batches(3, epoch=4))
    assert len(full) == 4 and not full[-1].mask.all()  # the last batch is padded
    for start in range(len(full) + 1):
        part = list(sampler.batches(3, epoch=4, start=start))
        assert [(b.data.tolist(), b.mask.tolist()) for b in part] == [
            (b.data.tolist(), b.mask.tolist()) for b in full[start:]
        ]
    assert sampler.state_dict() == {"epoch": 0, "batch": 0}  # an explicit epoch leaves the position alone

    # The order depends only on (seed, epoch): a sampler that went through epochs 0..3 first agrees.
    used = sc.ShardedSampler(23, shard_index=1, num_shards=2, seed=5)
    for _ in range(4):
        list(used.batches(3))
    assert used.state_dict() == {"epoch": 4, "batch": 0}
    assert [b.data.tolist() for b in used.batches(3)] == [b.data.tolist() for b in full]

    restored = sc.ShardedSampler(23, shard_index=1, num_shards=2, seed=5)
    restored.load_state_dict(json.loads(json.dumps({"epoch": 4, "batch": 2})))  # as a checkpoint stores it
    assert [b.data.tolist() for b in restored.batches(3)] == [b.data.tolist() for b in full[2:]]
    assert restored.state_dict() == {"epoch": 5, "batch": 0}  # the next call starts the next epoch


@pytest.mark.parametrize(
    ("position", "message"),
    [
        ({"epoch": -1, "batch": 0}, r"state\['epoch'\]=-1 must be an int >= 0"),
        ({"epoch": 0, "batch": 1.5}, r"state\['batch'\]=1.5 must be an int >= 0"),
        ({"epoch": 0}, r"state=\{'epoch': 0\} is not a position"),
    ],
)
def test_sampler_rejects_bad_positions(position, message):
    sampler = sc.ShardedSampler(10, shard_index=0, num_shards=1)
    with pytest.raises(sc.SpmdError, match=r"ShardedSampler\.load_state_dict: " + message):
        sampler.load_state_dict(position)
    with pytest.raises(sc.SpmdError, match=r"ShardedSampler\.batches: start=-1 must be an int >= 0"):
        sampler.batches(2, start=-1)


class CountingRows:
    """A data set leaf that counts how many index batches were read from it."""

    def __init__(self, rows: np.ndarray):
        self.rows, self.reads = rows, 0

    def __getitem__(self, index):
        self.reads += 1
        return self.rows[index]


def test_loader_position_counts_batches_handed_out_not_prefetched():
    data = job.dataset()
    counting = {"x": CountingRows(data["x"]), "y": data["y"]}
    sampler = sc.ShardedSampler(job.EXAMPLES, shard_index=0, num_shards=1, seed=3)
    loader = sc.Loader(counting, sampler, batch_size=8, epochs=2, prefetch=2, mesh=mesh(), threads="always")
    it = iter(loader)
    first = next(it)
    deadline = time.monotonic() + 60
    while counting["x"].reads < 3 and time.monotonic() < deadline:  # prefetch reads ahead of the loop
        time.sleep(0.01)
    assert counting["x"].reads >= 3
    assert (
        loader.state_dict()
        == sampler.state_dict() | {"global_batch_size": 8}
        == {"epoch": 0, "batch": 1, "global_batch_size": 8}
    )
    it.close()

    expected = list(job.loader(mesh(), prefetch=0))[:12]  # two epochs
    assert np.array_equal(np.asarray(first.data["x"]), expected[0].data["x"])
    resumed = job.loader(mesh())
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    resumed.epochs = 2
    assert len(resumed) == 11
    got = list(resumed)
    assert len(got) == 11 and resumed.state_dict() == {"epoch": 2, "batch": 0, "global_batch_size": 8}
    for placed, host in zip(got, expected[1:], strict=True):
        assert isinstance(placed.data["x"], jax.Array)
        assert np.array_equal(np.asarray(placed.data["x"]), host.data["x"])
        assert np.array_equal(np.asarray(placed.mask), host.mask)
    assert list(resumed) == [] and len(resumed) == 0  # past the last epoch


def test_loader_position_resumes_on_another_process_count():
    data = job.dataset()

    def shard(i, n):
        sampler = sc.ShardedSampler(job.EXAMPLES, shard_index=i, num_shards=n, seed=3)
        return sc.Loader(data, sampler, batch_size=job.GLOBAL_BATCH // n, epochs=2, prefetch=0)

    two = [shard(0, 2), shard(1, 2)]
    for loader in two:  # two processes consume 8 global batches (into epoch 1)
        it = iter(loader)
        for _ in range(8):
            next(it)
    assert two[0].state_dict() == two[1].state_dict() == {"epoch": 1, "batch": 2, "global_batch_size": 8}
    one, four = [shard(0, 1)], [shard(i, 4) for i in range(4)]
    for loader in one + four:
        loader.load_state_dict(two[0].state_dict())
    # Global batch b is the same rows and padding, in the same places, however the processes split it; the
    # last one of the epoch (4 real examples, 4 padded rows) included.
    steps = list(zip(*one, *two, *four, strict=True))
    assert len(steps) == 4 and [int(step[0].mask.sum()) for step in steps] == [8, 8, 8, 4]
    for whole, *parts in steps:
        for split in (parts[:2], parts[2:]):
            np.testing.assert_array_equal(np.concatenate([p.mask for p in split]), whole.mask)
            for name in data:
                np.testing.assert_array_equal(np.concatenate([p.data[name] for p in split]), whole.data[name])


def test_loader_rejects_bad_arguments_and_another_global_batch_size():
    sampler = sc.ShardedSampler(10, shard_index=0, num_shards=2)
    with pytest.raises(sc.SpmdError, match=r"Loader: sampler is a list, not a ShardedSampler"):
        sc.Loader({"x": np.zeros(10)}, [0, 1], batch_size=2)
    with pytest.raises(sc.SpmdError, match=r"Loader: batch_size=0 must be an int >= 1"):
        sc.Loader({"x": np.zeros(10)}, sampler, batch_size=0)
    loader = sc.Loader({"x": np.zeros(10)}, sampler, batch_size=2)
    with pytest.raises(
        sc.SpmdError,
        match=r"saved with a global batch of 8 examples, but this loader's is 4 \(batch_size=2 x num_shards=2\)"
        r".*Fix: resume with the global batch size of the saved run",
    ):
        loader.load_state_dict({"epoch": 0, "batch": 1, "global_batch_size": 8})
    with pytest.raises(sc.SpmdError, match=r"Loader\.load_state_dict: state=\{'epoch': 0\} is not a Loader position"):
        loader.load_state_dict({"epoch": 0})


@pytest.mark.parametrize(
    ("axis", "mesh_axes", "facts"),
    [
        (
            "batch",
            None,
            [
                r"default mesh",
                r"axes are \('data',\) with sizes \{'data': 8\}",
                r"mesh=sc\.make_mesh\(\{'batch': -1\}\)",
            ],
        ),
        (
            ("replica", "shard"),
            None,
            [r"mesh axis 'replica'", r"default mesh", r"mesh=sc\.make_mesh\(\{'replica': 2, 'shard': -1\}\)"],
        ),
        (
            "batch",
            {"data": 4, "model": 2},
            [
                r"the mesh given as mesh=",
                r"\('data', 'model'\) with sizes \{'data': 4, 'model': 2\}",
                r"one of its axes",
            ],
        ),
    ],
    ids=["default-mesh", "default-mesh-two-axes", "given-mesh"],
)
def test_loader_names_itself_the_axis_and_the_mesh_when_the_axis_is_missing(axis, mesh_axes, facts):
    sampler = sc.ShardedSampler(16, shard_index=0, num_shards=1)
    mesh = None if mesh_axes is None else sc.make_mesh(mesh_axes)
    with pytest.raises(sc.AxisError) as caught:
        # A given mesh is checked when the loader is made, the default one when a pass starts.
        loader = sc.Loader({"x": np.zeros((16, 2), np.float32)}, sampler, batch_size=8, mesh=mesh, axis=axis)
        next(iter(loader))
    message = str(caught.value)
    assert message.startswith(f"spmdcomm.Loader: axis={axis!r} places batches on mesh axis ")
    assert "data_sharding" not in message and "Fix: " in message
    for fact in facts:
        assert re.search(fact, message), (fact, message)
    assert sampler.state_dict() == {"epoch": 0, "batch": 0}  # nothing was consumed


# ---- fit with a checkpoint_dir ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop_after", "save_every", "async_save"),
    [(7, 4, False), (13, 3, True), (3, 4, False)],
    ids=["mid-epoch", "epoch-boundary-async", "before-first-save"],
)
def test_fit_stopped_after_any_step_resumes_bitwise(tmp_path, step, straight, stop_after, save_every, async_save):
    """With ``async_save``, the interrupted run raises while its last save may still be writing: fit finishes that
    save before the exception leaves it."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Interrupted):
        sc.fit(
            StopAfter(step, stop_after),
            job.fresh_state(mesh()),
            job.loader(mesh()),
            checkpoint_dir=ckpt,
            save_every=save_every,
            async_save=async_save,
        )
    saved = stop_after // save_every * save_every
    assert sc.latest_checkpoint_step(ckpt) == (saved or None)
    if saved:
        position = sc.checkpoint_extra(ckpt)["data"]
        assert position == {"epoch": saved // 6, "batch": saved % 6, "global_batch_size": job.GLOBAL_BATCH}

    # The restarted script builds everything afresh, as a new process would.
    state, history = sc.fit(
        step,
        job.fresh_state(mesh()),
        job.loader(mesh()),
        checkpoint_dir=ckpt,
        save_every=save_every,
        max_to_keep=2,
        async_save=async_save,
    )
    assert len(history) == STEPS - saved
    assert_bitwise(host_leaves(state), straight)
    # Saved every save_every steps and at the end; the newest two kept.
    saves = sorted({*range(save_every, STEPS + 1, save_every), STEPS})
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == saves[-2:]

    # Restarted once more after it finished: nothing left to train, the same state.
    again, history = sc.fit(
        step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, save_every=save_every
    )
    assert history == [] and sc.latest_checkpoint_step(ckpt) == STEPS
    assert_bitwise(host_leaves(again), straight)


def test_fit_refuses_what_it_cannot_resume(tmp_path, step):
    state = job.fresh_state(mesh())
    batches = list(job.loader(mesh(), prefetch=0))[:2]
    with pytest.raises(sc.SpmdError, match=r"fit: data is a list, which cannot resume.*sc\.Loader\(dataset, sampler"):
        sc.fit(step, state, batches, checkpoint_dir=tmp_path)
    with pytest.raises(
        sc.SpmdError, match=r"fit: save_every, max_to_keep, async_save and save_timeout need a checkpoint_dir"
    ):
        sc.fit(step, state, batches, save_every=2)
    with pytest.raises(
        sc.SpmdError, match=r"fit: save_every, max_to_keep, async_save and save_timeout need a checkpoint_dir"
    ):
        sc.fit(step, state, batches, async_save=True)
    for bad in (0, True, 1.5):
        with pytest.raises(sc.SpmdError, match=rf"fit: save_every={bad!r} must be a positive int or None"):
            sc.fit(step, state, job.loader(mesh()), checkpoint_dir=tmp_path, save_every=bad)
    assert sc.latest_checkpoint_step(tmp_path) is None and int(state.step) == 0  # nothing ran or was saved

    sc.save_checkpoint(tmp_path, state)  # by hand: no data position
    with pytest.raises(sc.SpmdError, match=r"fit: checkpoint 0 in .* has no data position.*checkpoint_dir of its own"):
        sc.fit(step, state, job.loader(mesh()), checkpoint_dir=tmp_path)


def test_checkpoint_extra_round_trips_json_only(tmp_path):
    state = sc.TrainState.create(params={"w": np.zeros(3, np.float32)}, tx=optax.sgd(0.1), mesh=mesh())
    sc.save_checkpoint(tmp_path, state, step=1)
    sc.save_checkpoint(tmp_path, state, step=2, extra={"data": {"epoch": 1, "batch": 2}, "note": [1.5, None]})
    assert sc.checkpoint_extra(tmp_path) == {"data": {"epoch": 1, "batch": 2}, "note": [1.5, None]}
    assert sc.checkpoint_extra(tmp_path, step=1) == {}
    with pytest.raises(sc.SpmdError, match=r"save_checkpoint: extra=\{'t': \(1, 2\)\} is not a dict that JSON stores"):
        sc.save_checkpoint(tmp_path, state, step=3, extra={"t": (1, 2)})
    with pytest.raises(sc.SpmdError, match=r"checkpoint_extra: no checkpoint for step 3"):
        sc.checkpoint_extra(tmp_path, step=3)
    assert sc.latest_checkpoint_step(tmp_path) == 2


# ---- killed processes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["arrays", "rename"])
def test_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, compile_flags, step, straight, where):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "saving"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # The job compiles as this process does (conftest's fast-compile flags): its bits are compared with ours.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES} {compile_flags}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(JOB_PATH), str(ckpt), str(tmp_path / "out.npz"), "--save-every", "4"]
    cmd += ["--hang-in-save", "8", "--marker", str(marker), "--hang-at", where]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        saving = marker.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        output = proc.communicate(timeout=60)[0]
    assert saving, f"the job never reached the save of checkpoint 8:\n{output}"
    assert proc.returncode == -signal.SIGKILL
    assert any(p.name.startswith("8.") for p in ckpt.iterdir())  # the half-done save is still on disk
    assert sc.latest_checkpoint_step(ckpt) == 4
    assert sc.checkpoint_extra(ckpt)["data"] == {"epoch": 0, "batch": 4, "global_batch_size": job.GLOBAL_BATCH}

    state, history = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, save_every=4)
    assert len(history) == STEPS - 4
    assert_bitwise(host_leaves(state), straight)
    assert not any(p.name.startswith("8.") for p in ckpt.iterdir())  # orbax removed the unfinished save
