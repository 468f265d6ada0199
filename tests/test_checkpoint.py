"""Damaged checkpoints, restoring from a directory without checkpoints, and orbax's threads.

A checkpoint whose files were deleted, truncated or overwritten after the save is skipped for the newest intact one
with a warning naming the damage (or refused by name when asked for explicitly), through the public functions and
through ``fit``, whose resumed run must still end bitwise like an uninterrupted one. Every damage below was
checked against orbax first: each one makes orbax's own restore fail (often with an unrelated error) or, for
``_CHECKPOINT_METADATA``, silently lose the ``extra`` dict."""

from __future__ import annotations

import gc
import importlib.util
import logging
import re
import shutil
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import spmdcomm as sc
from spmdcomm.checkpoint.checkpoint import CheckpointDamagedWarning

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("resume_job", ROOT / "tests" / "workers" / "resume_job.py")
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

SIZE = 4096  # random floats: 16 kB that do not compress below OCDBT's 1 kB inline limit, so they get a data file
NOISE = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
INDEX_NODE, DATA_FILE = "<index node>", "<data file>"


def mesh():
    return sc.data_mesh(devices=jax.devices()[:2])


def state_of(value: float) -> sc.TrainState:
    params = {"w": NOISE + np.float32(value), "b": np.full(2, value, np.float32)}
    return sc.TrainState.create(params=params, tx=optax.adam(1e-3), mesh=mesh())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Checkpoints 1 and 2 of ``state_of(step)``, whose extra is ``{"step": step}``."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    for step in (1, 2):
        sc.save_checkpoint(directory, state_of(float(step)), step=step, extra={"step": step})
    return directory


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def damage(step_dir: Path, target: str, how: str) -> tuple[str, int]:
    """Damages ``target`` of a checkpoint (a path inside it, or the B-tree node / the largest data file of its
    array data) by deleting it, halving it, or overwriting it with zeros; returns its path and its size."""
    if target == INDEX_NODE:
        (file,) = (step_dir / "default" / "d").iterdir()
    elif target == DATA_FILE:
        file = max((step_dir / "default" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
    else:
        file = step_dir / target
    data = file.read_bytes()
    if how == "delete":
        file.unlink()
    else:
        file.write_bytes(data[: len(data) // 2] if how == "truncate" else bytes(len(data)))
    return str(file.relative_to(step_dir)), len(data)


# (what is damaged, how, the problem named: {file} is the file's path in the checkpoint, {half} its halved size)
DAMAGE = [
    ("_CHECKPOINT_METADATA", "delete", "{file} (orbax's step metadata, with the extra dict) is missing"),
    ("_CHECKPOINT_METADATA", "garbage", "{file} (orbax's step metadata, with the extra dict) is not valid JSON"),
    ("default/_METADATA", "delete", "{file} (the arrays' tree, shapes and spmdcomm layout) is missing"),
    ("default/_METADATA", "truncate", "{file} (the arrays' tree, shapes and spmdcomm layout) is not valid JSON"),
    ("default/_sharding", "truncate", "{file} (the arrays' shardings) is not valid JSON"),
    ("default/array_metadatas/process_0", "truncate", "{file} (a process's array metadata) is not valid JSON"),
    ("default/manifest.ocdbt", "delete", "{file} (the index of the array data) is missing"),
    ("default/manifest.ocdbt", "truncate", "{file} (the index of the array data) is unreadable: DATA_LOSS"),
    (INDEX_NODE, "delete", "{file} (a node of the array index) is missing"),
    (INDEX_NODE, "garbage", "{file} (a node of the array index) is unreadable: DATA_LOSS"),
    (DATA_FILE, "delete", "{file} (array data) is missing"),
    (DATA_FILE, "truncate", "{file} (array data) is truncated: {half} bytes, the index refers to"),
]


@pytest.mark.parametrize(("target", "how", "problem"), DAMAGE, ids=[f"{t}-{h}" for t, h, _ in DAMAGE])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_and_refused_by_step(ckpt, target, how, problem):
    file, size = damage(ckpt / "2", target, how)
    named = re.escape(problem.format(file=file, half=size // 2))
    where = re.escape(repr(str(ckpt)))
    for fn, call in [
        ("latest_checkpoint_step", lambda: sc.latest_checkpoint_step(ckpt)),
        ("checkpoint_extra", lambda: sc.checkpoint_extra(ckpt)),
        ("restore_checkpoint", lambda: sc.restore_checkpoint(ckpt, state_of(0.0))),
    ]:
        with pytest.warns(CheckpointDamagedWarning) as caught:
            result = call()
        (warning,) = caught
        assert re.match(
            rf"spmdcomm\.{fn}: checkpoint\(s\) \[2\] in {where} are damaged, so checkpoint 1, the newest intact one, "
            rf"is used: checkpoint 2: {named}.*Fix: nothing, if going back to that checkpoint is fine",
            str(warning.message),
        ), warning.message
        if fn == "latest_checkpoint_step":
            assert result == 1
        elif fn == "checkpoint_extra":
            assert result == {"step": 1}
        else:
            np.testing.assert_array_equal(np.asarray(result.params["w"]), NOISE + np.float32(1.0))
            assert int(result.step) == 0
    for fn, call in [
        ("restore_checkpoint", lambda: sc.restore_checkpoint(ckpt, state_of(0.0), step=2)),
        ("checkpoint_extra", lambda: sc.checkpoint_extra(ckpt, step=2)),
    ]:
        with pytest.raises(
            sc.SpmdError,
            match=rf"^spmdcomm\.{fn}: checkpoint 2 in {where} is damaged: {named}.*Fix: leave out step= to use the "
            r"newest intact checkpoint, or pass another of \[1, 2\]\.$",
        ):
            call()


def test_array_data_missing_from_the_index_is_damage(ckpt):
    """Keys removed from the array data's index (an index that lost entries): a leaf without its zarr metadata,
    and one without one of its chunks (orbax stores every chunk, so restore would fail on it)."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt / '2' / 'default'}/"}).result()
    chunks = [k for k in store.list().result() if k.startswith(b"params.w/") and not k.endswith(b".zarray")]
    del store[b"params.b/.zarray"]
    del store[chunks[0]]
    problems = (
        r"leaf params\.b: its array data is not in default/manifest\.ocdbt's index \(no key params\.b/\.zarray\); "
        rf"leaf params\.w: 1 of its {len(chunks)} chunks are missing from the array data"
    )
    with pytest.warns(CheckpointDamagedWarning, match=r"checkpoint\(s\) \[2\] .* checkpoint 2: " + problems):
        assert sc.latest_checkpoint_step(ckpt) == 1
    with pytest.raises(sc.SpmdError, match=r"restore_checkpoint: checkpoint 2 in .* is damaged: " + problems):
        sc.restore_checkpoint(ckpt, state_of(0.0), step=2)


# When one read fails, orbax leaves its other reads' coroutines behind; their errors surface when they are collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damage_only_a_full_read_sees_raises_naming_the_step_and_the_cause(ckpt):
    """Zeros over a data file, same size: nothing but decoding finds it, and restore names the step and the leaf."""
    damage(ckpt / "2", DATA_FILE, "garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sc.latest_checkpoint_step(ckpt) == 2
    with pytest.raises(
        sc.SpmdError,
        match=rf"^spmdcomm\.restore_checkpoint: reading the arrays of checkpoint 2 in {re.escape(repr(str(ckpt)))} "
        r"failed: ValueError: .*Error reading \"params\.w/.*the bytes of a data file were damaged after the save\. "
        r"Fix: restore another checkpoint \(step=\.\.\.; the directory has steps \[1, 2\]\), or delete checkpoint 2 ",
    ) as raised:
        sc.restore_checkpoint(ckpt, state_of(0.0))
    assert raised.value.__cause__ is not None  # orbax's error stays attached
    del raised  # with it, orbax's abandoned reads: collected here, not in a later test
    gc.collect()
    restored = sc.restore_checkpoint(ckpt, state_of(0.0), step=1)
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), NOISE + np.float32(1.0))


def test_when_every_checkpoint_is_damaged_each_one_is_named(ckpt):
    damage(ckpt / "2", "default/_METADATA", "delete")
    damage(ckpt / "1", "_CHECKPOINT_METADATA", "truncate")
    for fn, call in [
        ("latest_checkpoint_step", lambda: sc.latest_checkpoint_step(ckpt)),
        ("checkpoint_extra", lambda: sc.checkpoint_extra(ckpt)),
        ("restore_checkpoint", lambda: sc.restore_checkpoint(ckpt, state_of(0.0))),
        ("restore_checkpoint", lambda: sc.restore_checkpoint(ckpt, state_of(0.0), missing_ok=True)),
    ]:
        with pytest.raises(
            sc.SpmdError,
            match=rf"^spmdcomm\.{fn}: every checkpoint in {re.escape(repr(str(ckpt)))} is damaged: checkpoint 2: "
            r"default/_METADATA \(.*\) is missing; checkpoint 1: _CHECKPOINT_METADATA \(.*\) is not valid JSON, so "
            r"truncated or overwritten .*Fix: restore the directory from a copy, or start afresh",
        ):
            call()


@pytest.mark.parametrize("directory", ["absent", "empty"])
def test_restore_from_a_directory_without_checkpoints_returns_the_template_on_request(tmp_path, directory):
    ckpt = tmp_path / "ckpt"
    if directory == "empty":
        ckpt.mkdir()
    state = state_of(3.0)
    assert sc.restore_checkpoint(ckpt, state, missing_ok=True) is state
    assert sc.restore_checkpoint(ckpt, state, step=5, missing_ok=True) is state
    there = "the directory does not exist" if directory == "absent" else r"it has steps \[\]"
    for fn, call in [
        ("restore_checkpoint", lambda: sc.restore_checkpoint(ckpt, state)),
        ("checkpoint_extra", lambda: sc.checkpoint_extra(ckpt)),
    ]:
        with pytest.raises(
            sc.SpmdError, match=rf"^spmdcomm\.{fn}: no checkpoint at all in .* \({there}\)\. Fix: check the directory"
        ):
            call()
    assert sc.latest_checkpoint_step(ckpt) is None
    assert ckpt.exists() == (directory == "empty")  # reading never creates the directory


@pytest.mark.parametrize("fn", ["save_checkpoint", "restore_checkpoint"])
def test_save_and_restore_take_a_train_state_and_nothing_else(tmp_path, fn):
    """The checkpoint layer reads a state through its attributes (it sits below spmdcomm.train): a TrainState's
    restore is a TrainState, and an object without them is refused by name as before."""
    other = {"params": {"w": np.zeros(2, np.float32)}}
    for wrong in (other, optax.sgd(0.1)):
        with pytest.raises(
            sc.SpmdError, match=rf"^spmdcomm\.{fn}: state is a {type(wrong).__name__}, not a TrainState\. Fix: pass"
        ):
            getattr(sc, fn)(tmp_path / "ckpt", wrong)
    sc.save_checkpoint(tmp_path / "ckpt", state_of(1.0), step=1)
    restored = sc.restore_checkpoint(tmp_path / "ckpt", state_of(0.0))
    assert type(restored) is sc.TrainState and np.asarray(restored.params["b"]).tolist() == [1.0, 1.0]


def test_missing_ok_does_not_hide_a_step_that_is_not_among_the_saved_ones(ckpt):
    with pytest.raises(
        sc.SpmdError, match=r"restore_checkpoint: no checkpoint for step 5 in .* \(it has steps \[1, 2\]\)"
    ):
        sc.restore_checkpoint(ckpt, state_of(0.0), step=5, missing_ok=True)


def test_a_save_replaces_a_damaged_checkpoint_of_its_step_and_refuses_an_intact_one(ckpt):
    damage(ckpt / "2", "default/_METADATA", "delete")
    with pytest.warns(
        CheckpointDamagedWarning,
        match=r"^spmdcomm\.save_checkpoint: checkpoint 2 in .* is damaged \(default/_METADATA \(.*\) is missing\); "
        r"this save replaces it\.$",
    ):
        sc.save_checkpoint(ckpt, state_of(5.0), step=2, extra={"step": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # intact again: no warning anywhere
        assert sc.latest_checkpoint_step(ckpt) == 2
        assert sc.checkpoint_extra(ckpt) == {"step": 5}
        np.testing.assert_array_equal(np.asarray(sc.restore_checkpoint(ckpt, state_of(0.0)).params["b"]), [5.0, 5.0])
    with pytest.raises(
        sc.SpmdError,
        match=r"^spmdcomm\.save_checkpoint: checkpoint 2 already exists in .*\. Fix: pass another step=, delete that",
    ):
        sc.save_checkpoint(ckpt, state_of(6.0), step=2)
    assert sc.checkpoint_extra(ckpt, step=2) == {"step": 5}  # untouched


CALLS = {
    "latest_checkpoint_step": lambda d: sc.latest_checkpoint_step(d),
    "checkpoint_extra": lambda d: sc.checkpoint_extra(d),
    "restore_checkpoint": lambda d: sc.restore_checkpoint(d, state_of(0.0)),
    "save_checkpoint": lambda d: sc.save_checkpoint(d, state_of(3.0), step=3),
}


@pytest.mark.parametrize("call", CALLS)
def test_no_orbax_thread_outlives_a_call(ckpt, tmp_path, call, capfd, caplog, monkeypatch):
    """The directory is removed right after the call: nothing may still be working in it. An unfinished save of
    many files is there, which orbax removes in a background thread that used to outlive reads (and fail with a
    logged traceback once the directory was gone)."""
    unfinished = ckpt / "9.orbax-checkpoint-tmp"
    unfinished.mkdir()
    for i in range(3000):
        (unfinished / str(i)).touch()
    hooked = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    before = set(threading.enumerate())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CALLS[call](ckpt)
    alive = [t for t in threading.enumerate() if t not in before]
    shutil.rmtree(ckpt.rename(tmp_path / "removed"))
    # Idle workers of the default executors of orbax's event loops, closed when the call returned, may still be
    # exiting: none has work left.
    assert [t.name for t in alive if not t.name.startswith("asyncio_")] == []
    for thread in alive:
        thread.join(10)
    assert [t.name for t in alive if t.is_alive()] == []
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Error" not in err, err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert hooked == []


# ---- fit ---------------------------------------------------------------------------------------------------


class Interrupted(Exception):
    pass


def test_fit_resumes_from_the_newest_intact_checkpoint_and_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    step = sc.make_train_step(job.loss_fn)
    steps = job.EPOCHS * -(-job.EXAMPLES // job.GLOBAL_BATCH)
    straight, _ = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()))

    calls = 0

    def stopping(state, batch):  # a run killed before its 14th step: checkpoints 4, 8 and 12 are on disk
        nonlocal calls
        calls += 1
        if calls == 14:
            raise Interrupted
        return step(state, batch)

    stopping.max_in_flight = step.max_in_flight
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Interrupted):
        sc.fit(stopping, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, save_every=4)
    assert sc.latest_checkpoint_step(ckpt) == 12
    damage(ckpt / "12", "default/_METADATA", "delete")

    with pytest.warns(CheckpointDamagedWarning) as caught:
        state, history = sc.fit(step, job.fresh_state(mesh()), job.loader(mesh()), checkpoint_dir=ckpt, save_every=4)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith(
        f"spmdcomm.latest_checkpoint_step: checkpoint(s) [12] in {str(ckpt)!r} are damaged, so checkpoint 8, the "
        "newest intact one, is used: checkpoint 12: default/_METADATA (the arrays' tree, shapes and spmdcomm layout) "
        "is missing."
    )
    assert messages[1].startswith(f"spmdcomm.save_checkpoint: checkpoint 12 in {str(ckpt)!r} is damaged (")
    assert len(history) == steps - 8  # resumed from 8, not from the damaged 12
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(straight), strict=True
    ):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), jax.tree_util.keystr(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checkpoint 12 was saved again, intact
        assert sc.checkpoint_extra(ckpt, step=12)["data"] == {"epoch": 2, "batch": 0, "global_batch_size": 8}


# ---- several processes -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_processes_that_see_a_checkpoint_differently_all_use_the_same_one(launch, tmp_path):
    """Process 1 finds checkpoint 2 damaged and process 0 intact: both fall back to 1, both refuse step=2."""
    root = tmp_path / "ckpt"
    out = launch("mp_checkpoint.py", root).stdout
    problem = "default/_METADATA (the arrays' tree, shapes and spmdcomm layout) is missing (seen by process(es) [1])"
    for rank in (0, 1):
        mine = repr(str(root / str(rank)))
        assert f"[rank {rank}] LATEST 1\n" in out, out
        assert f"[rank {rank}] RESTORED [1.0, 1.0, 1.0, 1.0] {{'step': 1}}\n" in out, out
        warned = re.findall(rf"^\[rank {rank}\] WARNED (.*)$", out, re.M)
        assert [w.split(":", 1)[0] for w in warned] == [
            "spmdcomm.latest_checkpoint_step",
            "spmdcomm.restore_checkpoint",
            "spmdcomm.checkpoint_extra",
        ], out
        assert warned[0].startswith(
            f"spmdcomm.latest_checkpoint_step: checkpoint(s) [2] in {mine} are damaged, so checkpoint 1, the newest "
            f"intact one, is used: checkpoint 2: {problem}."
        ), warned
        assert re.findall(rf"^\[rank {rank}\] CAUGHT (.*)$", out, re.M) == [
            f"spmdcomm.restore_checkpoint: checkpoint 2 in {mine} is damaged: {problem}. Fix: leave out step= to "
            "use the newest intact checkpoint, or pass another of [1, 2]."
        ], out
