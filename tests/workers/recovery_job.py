"""A long training job for tests/test_recovery.py that injects failures: tests/workers/resume_job.py's model
(an MLP with cross-replica BatchNorm and dropout, Adam) and data (6 global batches of 8 per epoch, the last one
padded) for ``--epochs`` epochs through ``sc.fit`` with a checkpoint directory, run under ``spmdcomm-launch``.

Usage: python recovery_job.py CKPT_DIR OUT_FILE [--epochs N] [--save-every N] [--watchdog-timeout S]
                              [--fault ATTEMPT:RANK:STEP:KIND ...] [--ready-at STEP] [--initial DIR]
                              [--async-save]

CKPT_DIR "-" runs without checkpoints (the uninterrupted reference run). Process 0 writes every leaf of the
final state to OUT_FILE (.npz). Each ``--fault`` acts on attempt ATTEMPT (``sc.restart_count()``) in process
RANK only:

- ``kill``: the process SIGKILLs itself instead of running step STEP (the step that makes ``state.step ==
  STEP``), after printing ``KILLING before step STEP``.
- ``kill-in-save``: the process SIGKILLs itself inside the save of checkpoint STEP, once it has written its
  own shards into the save's temporary directory and before the save is complete, after printing ``KILLING in
  the save of checkpoint STEP; on disk: [...]`` (the checkpoint directory's entries).
- ``stall``: the process's data source prints ``SLEEPING before step STEP at <unix time>`` and sleeps forever
  instead of handing over the batch of step STEP (``--watchdog-timeout`` must end the job).
- ``slow-compile``: the process's compilation of the train step takes STEP seconds longer (its ``loss_fn``
  sleeps while it is traced, once), after printing ``COMPILING SLOWLY for STEP s``: the watchdog must wait.

``--initial DIR``: the initial variables come from DIR (``ddp_models.write_initial(DIR, variables=...)``), not from
compiling the model's init in every process (processes other than 0 read no compilation cache).

``--async-save``: ``fit(..., async_save=True)``: the saves write in the background.

``--ready-at STEP``: on attempt 0 every process prints ``READY at step STEP`` once its data source hands over
that step's batch, and from then on waits 0.3 s before each batch, so that the test can send SIGTERM while
the job is mid-epoch. The faults are hooks of this script; the library is not patched.

Every process prints ``ATTEMPT a resumes from step s`` at its first step, ``PREEMPTED at step s (status c)``
when ``fit`` stopped it after a preemption, and ``DONE attempt a: trained n steps from step s to step t``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import resume_job as job

import spmdcomm as sc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_models import read_initial  # noqa: E402


class Steps:
    """The train step, counting the steps it runs (and SIGKILLing the process at ``kill_at``, if given)."""

    def __init__(self, step: sc.train.TrainStep, kill_at: int | None):
        self.step, self.kill_at = step, kill_at
        self.max_in_flight = step.max_in_flight
        self.first: int | None = None  # state.step at the first call: the step this attempt resumed from
        self.calls = 0

    def __call__(self, state, batch):
        if self.first is None:
            self.first = int(state.step)
            print(f"ATTEMPT {sc.restart_count()} resumes from step {self.first}", flush=True)
        upcoming = self.first + self.calls + 1
        if upcoming == self.kill_at:
            print(f"KILLING before step {upcoming}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1
        return self.step(state, batch)


class Data:
    """``fit``'s data: a :class:`spmdcomm.Loader` whose ``step``-th batch (counted over the whole run) may stall
    forever or mark the point from which batches come slowly."""

    def __init__(self, loader: sc.Loader, *, stall_at: int | None, ready_at: int | None):
        self.loader, self.stall_at, self.ready_at = loader, stall_at, ready_at

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self):
        per_epoch = self.loader.sampler.num_batches(self.loader.batch_size)
        batches = iter(self.loader)
        try:
            for batch in batches:
                position = self.loader.state_dict()  # the next batch: this one is the batch of step `handed`
                handed = position["epoch"] * per_epoch + position["batch"]
                if handed == self.stall_at:
                    print(f"SLEEPING before step {handed} at {time.time():.3f}", flush=True)
                    time.sleep(1e9)
                if self.ready_at is not None and handed >= self.ready_at:
                    if handed == self.ready_at:
                        print(f"READY at step {handed}", flush=True)
                    time.sleep(0.3)
                yield batch
        finally:
            batches.close()


def kill_in_save(step: int) -> None:
    """Makes this process SIGKILL itself in the save of checkpoint ``step``, after writing its shards."""
    original = ocp.CompositeCheckpointHandler.save

    def save(self, directory, *args, **kwargs):
        result = original(self, directory, *args, **kwargs)
        if Path(directory).name.startswith(f"{step}."):  # the save's temporary directory
            entries = sorted(p.name for p in Path(directory).parent.iterdir())
            print(f"KILLING in the save of checkpoint {step}; on disk: {entries}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    ocp.CompositeCheckpointHandler.save = save


def slow_to_trace(loss_fn, seconds: int):
    """``loss_fn``, whose first trace (inside the step's compilation) sleeps ``seconds`` first."""
    traced = []

    def slow(*args, **kwargs):
        if not traced:
            traced.append(True)
            print(f"COMPILING SLOWLY for {seconds} s", flush=True)
            time.sleep(seconds)
        return loss_fn(*args, **kwargs)

    return slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_file", type=Path)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--watchdog-timeout", type=float)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--ready-at", type=int)
    parser.add_argument("--initial", type=Path)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    sc.initialize()
    attempt, me = sc.restart_count(), sc.process_index()
    mine = {}  # kind -> step, of the faults of this attempt and process
    for fault in args.fault:
        at, rank, step, kind = fault.split(":")
        if int(at) == attempt and int(rank) == me:
            mine[kind] = int(step)
    if "kill-in-save" in mine:
        kill_in_save(mine["kill-in-save"])
    mesh = sc.data_mesh()
    loader = job.loader(mesh, shard_index=me, num_shards=sc.process_count())
    loader.epochs = args.epochs
    data = Data(loader, stall_at=mine.get("stall"), ready_at=args.ready_at if attempt == 0 else None)
    loss_fn = job.loss_fn
    if "slow-compile" in mine:
        loss_fn = slow_to_trace(loss_fn, mine["slow-compile"])
    step = Steps(sc.make_train_step(loss_fn), mine.get("kill"))
    options = {"watchdog_timeout": args.watchdog_timeout}
    if args.ckpt_dir != "-":
        options.update(checkpoint_dir=args.ckpt_dir, save_every=args.save_every, async_save=args.async_save)
    try:
        variables = None if args.initial is None else read_initial(args.initial)["variables"]
        state, history = sc.fit(step, job.fresh_state(mesh, variables), data, **options)
    except SystemExit as e:  # fit stops every process at the agreed step, saves there and exits
        print(f"PREEMPTED at step {step.first + step.calls} (status {e.code})", flush=True)
        raise
    leaves = {
        jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf.addressable_data(0)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    if me == 0:
        np.savez(args.out_file, **leaves)
    print(f"DONE attempt {attempt}: trained {len(history)} steps from step {step.first} to step {int(state.step)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
