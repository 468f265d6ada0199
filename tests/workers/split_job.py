"""A training job for tests/test_resume_splits.py, run under the launcher as any split of 4 devices into
processes (2 x 2, 1 x 4, 4 x 1): the same global batches must train the same parameters on every split.

tests/workers/resume_job.py's data (44 examples in global batches of 8: 6 batches per epoch, the last one 4
real examples and 4 padded rows), 3 epochs, through ``sc.fit`` over an ``sc.Loader`` whose sampler has one
shard per process. The model has no cross-device state (no BatchNorm), but dropout, so every device's rows
draw their own bits: a real example moved to another device or another row of the global batch trains
differently. It is trained twice, once per ``make_train_step(rng=...)`` mode in ``MODES``.

Usage: python split_job.py WORK_DIR [--straight] [--stop-at STEP]

For each mode, process 0 writes WORK_DIR/params_<name>.npz (``ddp_models.write_params``):

- ``--straight``: ``straight-<mode>``, a run from scratch without checkpoints (the reference);
- then ``staged-<mode>``: ``fit`` with ``checkpoint_dir=WORK_DIR/ckpt-<mode>`` (saved every ``SAVE_EVERY``
  steps), which resumes from the newest checkpoint there. With ``--stop-at STEP`` it stops instead of running
  step STEP (the step that makes ``state.step == STEP``) and writes nothing: every mode but the last raises
  in every process (so the job goes on to the next mode), and the last mode's every process SIGKILLs itself
  (after a barrier, so that no process is in a collective), as a job killed at once would die.

Every process prints ``RESUMED <mode> from step S`` and, when ``fit`` returns, ``TRAINED <mode> N steps to step
T``; a stop prints ``STOPPED <mode> before step STEP`` (raise) or ``KILLING <mode> before step STEP``.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from pathlib import Path

import spmdcomm as sc

sc.initialize(timeout=120)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import resume_job as job  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_models import jit_once, write_params  # noqa: E402

MODES = ("per_device", "per_example")
SAVE_EVERY = 4


class DropMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(job.CLASSES)(x)


# DropMLP's init compiled once per process (train() runs up to 4 times), as one program: eagerly every initializer
# shape compiles its own, and a new jax.jit wrapper per call would compile it again. jit_once: every process of
# every split runs the same program, so all start from the same parameters.
_init = jit_once(functools.partial(DropMLP().init, train=False))


# One model function and one optimizer for every run: the state's static fields (these two among them) key the
# train step's compiled programs, so a new optax.adam or DropMLP().apply per run would compile the same step again
# (processes other than 0 read no compilation cache).
APPLY, TX = DropMLP().apply, optax.adam(1e-2)


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["x"], rngs={"dropout": rng})
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)


class Stopped(Exception):
    """Raised in every process instead of the step at ``--stop-at``."""


class StopAt:
    """The train step, except that it stops (raise, or SIGKILL with ``kill``) instead of running the step that
    would make ``state.step == at``."""

    def __init__(self, step: sc.train.TrainStep, mode: str, at: int, *, kill: bool):
        self.step, self.mode, self.at, self.kill = step, mode, at, kill
        self.max_in_flight = step.max_in_flight
        self.next: int | None = None  # the step the next call would make (read from the first state only)

    def __call__(self, state, batch):
        if self.next is None:
            self.next = int(state.step) + 1
        if self.next != self.at:
            self.next += 1
            return self.step(state, batch)
        if not self.kill:
            raise Stopped
        jax.block_until_ready(state)
        # Printed before the barrier: once the first process is dead, the launcher stops the others, so a line
        # printed after it could be lost by a process that was still on its way to printing it.
        print(f"KILLING {self.mode} before step {self.at}", flush=True)
        sc.barrier(f"kill {self.mode}", timeout=60)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("still alive after SIGKILL")


def train(step, mode: str, mesh, ckpt_dir: Path | None, stop_at: int | None, *, kill: bool):
    """``fit`` of a fresh state and loader (resumed from ``ckpt_dir``'s newest checkpoint, if any) with ``step``,
    the mode's train step."""
    params = _init(job.init_key(), np.zeros((2, job.FEATURES), np.float32))["params"]
    state = sc.TrainState.create(params=jax.tree.map(np.asarray, params), apply_fn=APPLY, tx=TX, mesh=mesh, rng=11)
    if stop_at is not None:
        step = StopAt(step, mode, stop_at, kill=kill)
    loader = job.loader(mesh, shard_index=sc.process_index(), num_shards=sc.process_count())
    options = {} if ckpt_dir is None else {"checkpoint_dir": ckpt_dir, "save_every": SAVE_EVERY}
    if ckpt_dir is not None:
        print(f"RESUMED {mode} from step {sc.latest_checkpoint_step(ckpt_dir) or 0}", flush=True)
    return sc.fit(step, state, loader, **options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work_dir", type=Path)
    parser.add_argument("--straight", action="store_true")
    parser.add_argument("--stop-at", type=int)
    args = parser.parse_args()
    mesh = sc.data_mesh()
    assert mesh.devices.size == 4, mesh  # every split is of the same 4 devices
    for mode in MODES:
        # One step object for the straight and the staged run: one compilation.
        step = sc.make_train_step(loss_fn, rng=mode)
        if args.straight:
            state, history = train(step, mode, mesh, None, None, kill=False)
            write_params(args.work_dir, f"straight-{mode}", state.params, history)
        ckpt_dir = args.work_dir / f"ckpt-{mode}"
        try:
            state, history = train(step, mode, mesh, ckpt_dir, args.stop_at, kill=mode == MODES[-1])
        except Stopped:
            print(f"STOPPED {mode} before step {args.stop_at}", flush=True)
            continue
        write_params(args.work_dir, f"staged-{mode}", state.params, history)
        print(f"TRAINED {mode} {len(history)} steps to step {int(state.step)}", flush=True)


if __name__ == "__main__":
    main()
