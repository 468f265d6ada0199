"""A Grain job of several processes for tests/test_grain.py, run under ``spmdcomm-launch --max-restarts 1``: each
process reads its own shard of a Grain pipeline through ``sc.fit`` with checkpoints, the job is stopped after a
checkpoint mid-run and restarted from it.

Usage: python grain_job.py OUT_DIR CKPT_DIR

Two pipelines, each process reading its own shard of 40 examples, 4 rows a step per process, 8 steps:

- ``loader``: a ``grain.DataLoader`` whose sampler shards by ``grain.sharding.ShardByJaxProcess``, given to
  ``fit`` as it is;
- ``dataset``: ``grain.MapDataset`` sliced by process index (explicit shard options), shuffled, repeated,
  filtered (a predicate that drops other examples on each process, so that the processes' iterators stand at
  different positions after the same number of batches) and batched, in ``sc.IteratorLoader(..., prefetch=2)``.

Attempt 0 (``sc.restart_count() == 0``) runs each pipeline uninterrupted (no checkpoints), then again with
``checkpoint_dir=CKPT_DIR/<pipeline>`` and ``save_every=3``, stopped by an exception instead of its step 6 (the
checkpoint of step 3 is the latest), then every process exits with status 3 and the launcher restarts the job.
Attempt 1 runs each pipeline with the same checkpoint directory: ``fit`` restores step 3 and each process's own
iterator state. Each process writes ``OUT_DIR/<pipeline>-<run>-<process>.npz`` (``run``: ``straight``, ``first``,
``resumed``) holding the rows of every batch its step received (``batches``, in order) and the final parameters
(``w``, ``b``; not for ``first``), and prints ``<pipeline> <run> trained <n> steps``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import spmdcomm as sc

sc.initialize(timeout=60)

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

EXAMPLES, ROWS_PER_STEP, STEPS, SAVE_EVERY, STOP_AT = 40, 4, 8, 3, 6
ROWS = [{"x": np.array([i, 1.0 - i / 10], np.float32), "y": np.float32(i % 3)} for i in range(EXAMPLES)]


class Stopped(Exception):
    pass


class Recorder:
    """The train step, recording this process's rows of each batch; raises :class:`Stopped` instead of running
    the step that would reach ``state.step == stop_at``."""

    def __init__(self, step, stop_at: int | None = None):
        self.step, self.stop_at, self.seen = step, stop_at, []
        self.max_in_flight = step.max_in_flight

    def __call__(self, state, batch):
        if self.stop_at is not None and int(jax.device_get(state.step)) + 1 == self.stop_at:
            raise Stopped
        self.seen.append(local_rows(batch["x"]))
        return self.step(state, batch)


def local_rows(x) -> np.ndarray:
    """This process's rows of a batch leaf: the host array itself, or a placed array's addressable shards."""
    if isinstance(x, jax.Array):
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])
    return np.asarray(x)


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    return sc.masked_mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, mask)


def fresh_state(mesh) -> sc.TrainState:
    params = {"w": np.zeros(2, np.float32), "b": np.float32(0.0)}
    return sc.TrainState.create(params=params, tx=optax.adam(0.1), mesh=mesh)


def loader():
    sampler = grain.samplers.IndexSampler(
        EXAMPLES,
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        seed=3,
        num_epochs=2,
    )
    return grain.DataLoader(
        data_source=ROWS, sampler=sampler, operations=[grain.transforms.Batch(ROWS_PER_STEP, drop_remainder=True)]
    )


def dataset(mesh):
    me, count = sc.process_index(), sc.process_count()
    kept = (
        grain.MapDataset.source(ROWS)[me::count]
        .shuffle(seed=5)
        .repeat(3)
        .to_iter_dataset()
        .filter(lambda row: int(row["x"][0]) % (3 + me) != 0)
        .batch(ROWS_PER_STEP, drop_remainder=True)
    )
    return sc.IteratorLoader(kept, prefetch=2, mesh=mesh)


def main() -> None:
    out, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
    mesh, me = sc.data_mesh(), sc.process_index()
    step = sc.make_train_step(loss_fn)
    pipelines = {"loader": loader, "dataset": lambda: dataset(mesh)}

    def record(name: str, run: str, recorder: Recorder, state: sc.TrainState | None = None) -> None:
        leaves = {}
        if state is not None:
            leaves = {k: np.asarray(v.addressable_data(0)) for k, v in state.params.items()}
        np.savez(out / f"{name}-{run}-{me}.npz", batches=np.stack(recorder.seen), **leaves)
        print(f"{name} {run} trained {len(recorder.seen)} steps", flush=True)

    for name, source in pipelines.items():
        options = {"checkpoint_dir": ckpt / name, "save_every": SAVE_EVERY, "max_steps": STEPS}
        if sc.restart_count() == 0:
            recorder = Recorder(step)
            state, _ = sc.fit(recorder, fresh_state(mesh), source(), max_steps=STEPS)
            record(name, "straight", recorder, state)
            recorder = Recorder(step, stop_at=STOP_AT)
            try:
                sc.fit(recorder, fresh_state(mesh), source(), **options)
            except Stopped:
                record(name, "first", recorder)
        else:
            recorder = Recorder(step)
            state, _ = sc.fit(recorder, fresh_state(mesh), source(), **options)
            record(name, "resumed", recorder, state)
    if sc.restart_count() == 0:
        sc.barrier("stopping")
        sys.exit(3)  # the job stops; the launcher restarts it


if __name__ == "__main__":
    main()
