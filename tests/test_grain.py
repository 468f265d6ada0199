"""Pipelines that are not sc.Loader: a Grain DataLoader or dataset given to fit resumes mid-epoch bitwise (its
iterator state saved in the checkpoint), Grain's ShardOptions split the data between processes, and any other
iterable resumes only as sc.IteratorLoader documents (resume="skip"), or fit refuses it. In a job of two processes
(tests/workers/grain_job.py), stopped after a checkpoint and restarted by the launcher, each process resumes its
own shard from its own iterator state.

One tiny linear model on 2 devices, compiled once for the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grain
import jax
import numpy as np
import optax
import pytest

import spmdcomm as sc
from spmdcomm.data.iterators import restore_position, saved_position

EXAMPLES, BATCH, EPOCHS = 20, 4, 2
STEPS = EPOCHS * EXAMPLES // BATCH  # 10
ROWS = [{"x": np.array([i, 1.0 - i / 10], np.float32), "y": np.float32(i % 3)} for i in range(EXAMPLES)]


class Interrupted(Exception):
    pass


class Recorder:
    """The train step, recording each batch's ``x`` it runs on; call ``stop + 1`` raises :class:`Interrupted`."""

    def __init__(self, step, stop: int | None = None):
        self.step, self.left, self.seen = step, stop, []
        self.max_in_flight = step.max_in_flight

    def __call__(self, state, batch):
        if self.left == 0:
            raise Interrupted
        if self.left is not None:
            self.left -= 1
        self.seen.append(np.asarray(batch["x"]))
        return self.step(state, batch)


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    return sc.masked_mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, mask)


@pytest.fixture(scope="module")
def step():
    return sc.make_train_step(loss_fn)


def mesh():
    return sc.data_mesh(devices=jax.devices()[:2])


def fresh_state():
    params = {"w": np.zeros(2, np.float32), "b": np.float32(0.0)}
    return sc.TrainState.create(params=params, tx=optax.adam(0.1), mesh=mesh())


def grain_loader(shard_index=0, shard_count=1):
    sampler = grain.samplers.IndexSampler(
        EXAMPLES,
        shard_options=grain.sharding.ShardOptions(shard_index, shard_count, drop_remainder=True),
        shuffle=True,
        seed=3,
        num_epochs=EPOCHS,
    )
    return grain.DataLoader(
        data_source=ROWS, sampler=sampler, operations=[grain.transforms.Batch(BATCH, drop_remainder=True)]
    )


def grain_dataset():
    return grain.MapDataset.source(ROWS).shuffle(seed=3).repeat(EPOCHS).batch(BATCH, drop_remainder=True)


SOURCES = {
    "DataLoader": grain_loader,
    "MapDataset": grain_dataset,
    "IterDataset, prefetched": lambda: sc.IteratorLoader(
        grain_dataset().to_iter_dataset(), prefetch=2, mesh=mesh(), threads="always"
    ),
}


@pytest.fixture(scope="module")
def straight(step):
    """The batches and final parameters of a run over Grain's order that never stopped."""
    runs = {}
    for name in ("DataLoader", "MapDataset"):
        recorder = Recorder(step)
        state, history = sc.fit(recorder, fresh_state(), SOURCES[name]())
        assert len(history) == STEPS
        runs[name] = recorder.seen, jax.device_get(state.params)
    return runs


@pytest.mark.parametrize(
    ("source", "stop_after"), [("DataLoader", 7), ("MapDataset", 4), ("IterDataset, prefetched", 7)]
)
def test_grain_source_stopped_mid_epoch_resumes_bitwise(tmp_path, step, straight, source, stop_after):
    first = Recorder(step, stop_after)
    with pytest.raises(Interrupted):
        sc.fit(first, fresh_state(), SOURCES[source](), checkpoint_dir=tmp_path, save_every=3)
    saved = stop_after // 3 * 3
    position = sc.checkpoint_extra(tmp_path)["data"]
    assert [p["batches"] for p in position["processes"]] == [saved]  # mid-epoch: 5 batches per epoch

    then = Recorder(step)
    state, history = sc.fit(then, fresh_state(), SOURCES[source](), checkpoint_dir=tmp_path, save_every=3)
    batches, params = straight["DataLoader" if source == "DataLoader" else "MapDataset"]
    assert len(history) == STEPS - saved
    resumed = first.seen[:saved] + then.seen
    assert len(resumed) == STEPS and all(a.tobytes() == b.tobytes() for a, b in zip(resumed, batches, strict=True))
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(params), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_shard_options_split_the_data_between_processes_and_positions_are_per_process():
    """Two processes' loaders built in one process: their batches partition every epoch's examples, and fit saves
    each one's iterator state, restoring only with the same number of processes."""
    shards = [sc.IteratorLoader(grain_loader(i, 2)) for i in range(2)]
    its = [iter(s) for s in shards]
    seen = [np.concatenate([next(it)["x"][:, 0] for _ in range(2)]).astype(int) for it in its]
    assert [s.state_dict()["batches"] for s in shards] == [2, 2]
    rest = [np.concatenate([b["x"][:, 0] for b in grain_loader(i, 2)][2:]).astype(int) for i in range(2)]
    mine = [set(seen[i]) | set(rest[i]) for i in range(2)]
    assert not mine[0] & mine[1] and mine[0] | mine[1] == set(range(EXAMPLES))  # disjoint shards, all the data
    assert all(np.bincount(np.concatenate([seen[i], rest[i]])).max() == EPOCHS for i in range(2))

    positions = {"processes": [s.state_dict() for s in shards]}  # what fit saves in a 2-process job
    with pytest.raises(sc.SpmdError, match=r"fit: the checkpoint's data positions were saved by 2 processes.*has 1"):
        restore_position(sc.IteratorLoader(grain_loader(0, 2)), positions)
    one = sc.IteratorLoader(grain_loader(0, 2))
    restore_position(one, json.loads(json.dumps({"processes": positions["processes"][:1]})))
    assert next(iter(one))["x"].tobytes() == next(its[0])["x"].tobytes()  # shard 0's next batch
    assert saved_position(one) == {"processes": [one.state_dict()]} and one.state_dict()["batches"] == 3
    with pytest.raises(sc.SpmdError, match=r"fit: the checkpoint's data position .* not saved from an IteratorLoader"):
        restore_position(one, {"epoch": 0, "batch": 1, "global_batch_size": 8})


def test_a_pass_stopped_early_with_prefetch_goes_on_at_the_first_batch_not_handed_out():
    loader = sc.IteratorLoader(grain_dataset().to_iter_dataset(), prefetch=2, mesh=mesh(), threads="always")
    expected = [b["x"] for b in grain_dataset()]
    got = []
    for batch in loader:
        got.append(np.asarray(batch["x"]))
        if len(got) == 3:
            break  # the prefetch threads have fetched batches beyond this one
    got += [np.asarray(b["x"]) for b in loader]
    assert [g.tobytes() for g in got] == [e.tobytes() for e in expected]
    assert loader.state_dict()["batches"] == STEPS


def batches_of(seed: int):
    """A plain generator: the same batches on every start (a fixed seed), no iterator state."""
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        yield {"x": rng.standard_normal((BATCH, 2)).astype(np.float32), "y": np.ones(BATCH, np.float32)}


def test_plain_iterator_resumes_by_skipping_only_when_asked(tmp_path, step):
    recorder = Recorder(step)
    state, _ = sc.fit(recorder, fresh_state(), batches_of(0))
    first = Recorder(step, 5)
    with pytest.raises(Interrupted):
        sc.fit(
            first, fresh_state(), sc.IteratorLoader(batches_of(0), resume="skip"), checkpoint_dir=tmp_path, save_every=2
        )
    assert sc.checkpoint_extra(tmp_path)["data"] == {"processes": [{"batches": 4, "iterator": None}]}
    then = Recorder(step)
    resumed, history = sc.fit(
        then, fresh_state(), sc.IteratorLoader(batches_of(0), resume="skip"), checkpoint_dir=tmp_path, save_every=2
    )
    assert len(history) == STEPS - 4
    assert [b.tobytes() for b in first.seen[:4] + then.seen] == [b.tobytes() for b in recorder.seen]
    assert jax.device_get(resumed.params)["w"].tobytes() == jax.device_get(state.params)["w"].tobytes()

    # Another stream than the saved run's: it ends before the saved position.
    short = sc.IteratorLoader(iter(list(batches_of(0))[:2]), resume="skip")
    with pytest.raises(
        sc.SpmdError,
        match=r"IteratorLoader\.load_state_dict: the position is 4 batches in, but the "
        r"source ended after 2",
    ):
        short.load_state_dict({"batches": 4, "iterator": None})


def test_fit_refuses_a_source_it_cannot_put_back(tmp_path, step):
    state = fresh_state()
    fix = r"sc\.IteratorLoader\(data, resume='skip'\)"
    with pytest.raises(sc.SpmdError, match=rf"fit: data is a generator, which cannot resume.*Grain.*{fix}"):
        sc.fit(step, state, batches_of(0), checkpoint_dir=tmp_path)
    with pytest.raises(
        sc.SpmdError, match=rf"fit: data is an IteratorLoader over a generator, which cannot resume.*{fix}"
    ):
        sc.fit(step, state, sc.IteratorLoader(batches_of(0)), checkpoint_dir=tmp_path)
    assert sc.latest_checkpoint_step(tmp_path) is None
    plain = sc.IteratorLoader(batches_of(0))
    plain.load_state_dict({"batches": 0, "iterator": None})  # the start: nothing to move
    with pytest.raises(
        sc.SpmdError,
        match=r"IteratorLoader\.load_state_dict: the position is 3 batches in, but the source's iterator \(a "
        r"generator\) has no get_state\(\) / set_state\(\).*train on those batches twice.*resume='skip'",
    ):
        plain.load_state_dict({"batches": 3, "iterator": None})
    for bad, message in (
        (dict(prefetch=-1), r"prefetch=-1 must be an int >= 0"),
        (dict(resume="restart"), r"resume='restart' is not one of \('state', 'skip'\)"),
        (dict(host_input="global"), r"host_input='global' with prefetch=0"),
    ):
        with pytest.raises(sc.SpmdError, match=rf"IteratorLoader: {message}"):
            sc.IteratorLoader(batches_of(0), **bad)
    with pytest.raises(sc.SpmdError, match=r"IteratorLoader\.load_state_dict: state=\{'batches': -1\} is not"):
        plain.load_state_dict({"batches": -1})


def test_spmdcomm_never_imports_grain():
    """Grain is an optional extra: fit recognises its iterators by their get_state / set_state alone."""
    root = Path(sc.__file__).parent
    assert not [p for p in root.rglob("*.py") if re.search(r"^\s*(import|from)\s+grain\b", p.read_text(), re.M)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_job_of_two_processes_stopped_and_restarted_resumes_each_process_from_its_own_grain_state(launch, tmp_path):
    """Each process reads its own shard (a DataLoader sharded by ShardByJaxProcess; a dataset sliced by process
    index and filtered differently on each, so that the two iterators stand at different positions). The job saves at
    step 3, stops at step 6 and is restarted: every process's batches and final parameters equal the uninterrupted
    run's."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    res = launch("grain_job.py", out, ckpt, max_restarts=1, timeout=120)
    assert "exited with status 3" in res.stderr and "restart 1 of 1" in res.stderr, res.stderr
    saved, steps = 3, 8
    for name in ("loader", "dataset"):
        positions = sc.checkpoint_extra(ckpt / name, step=saved)["data"]["processes"]
        assert [p["batches"] for p in positions] == [saved, saved], positions
        assert positions[0]["iterator"] != positions[1]["iterator"], positions  # one state per process
        assert sc.latest_checkpoint_step(ckpt / name) == steps
        shards = []
        for rank in (0, 1):
            straight, first, resumed = (
                arrays(out / f"{name}-{run}-{rank}.npz") for run in ("straight", "first", "resumed")
            )
            assert (len(straight["batches"]), len(first["batches"]), len(resumed["batches"])) == (steps, 5, 5)
            together = np.concatenate([first["batches"][:saved], resumed["batches"]])
            assert together.tobytes() == straight["batches"].tobytes(), (name, rank)
            for leaf in ("w", "b"):
                assert resumed[leaf].tobytes() == straight[leaf].tobytes(), (name, rank, leaf)
            shards.append(set(straight["batches"][..., 0].astype(int).ravel().tolist()))
        assert not shards[0] & shards[1], name  # each process read its own examples


def arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as saved:
        return dict(saved)
