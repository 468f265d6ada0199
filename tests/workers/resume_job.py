"""A small resumable training job for tests/test_resume.py, importable (the test builds the same run in-process)
and runnable as one process or several under the launcher.

An MLP with cross-replica BatchNorm (model state) and dropout (the state's RNG), Adam, 44 examples in global
batches of 8 (6 batches per epoch, the last one padded), 3 epochs: 18 steps through ``sc.fit`` over an
``sc.Loader``, checkpointed every ``--save-every`` steps into CKPT_DIR ("-": no checkpoints).

Usage: python resume_job.py CKPT_DIR OUT_FILE [--save-every N] [--kill-at STEP [--kill-rank R]]
                            [--hang-in-save STEP --marker FILE --hang-at arrays|rename]

Process 0 writes every leaf of the final state to OUT_FILE (.npz) and prints how many steps this run trained.
``--kill-at STEP``: process ``--kill-rank`` SIGKILLs itself instead of running step STEP (the step that
would make ``state.step == STEP``), on the first attempt only (``SPMDCOMM_RESTART_COUNT`` unset or 0).
``--hang-in-save STEP``: the save of checkpoint STEP stops, writes FILE and sleeps, either after the arrays
are written (``arrays``) or just before the final rename (``rename``), for the test to SIGKILL it there.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import time
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax

import spmdcomm as sc

EXAMPLES, FEATURES, CLASSES = 44, 8, 4
GLOBAL_BATCH, EPOCHS = 8, 3


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name="data")(x)
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(CLASSES)(x)


# Net's init compiled once per process, as one program: eagerly every initializer shape compiles its own, and a new
# jax.jit wrapper per fresh_state() call would compile it again.
_init = jax.jit(functools.partial(Net().init, train=False))


def init_key() -> jax.Array:
    """The key the initial parameters are drawn from: RBG, not JAX's default threefry.

    XLA:CPU compiles each threefry draw into a kernel of its own, in every process of every job (its persistent
    cache serves process 0 only); RBG draws compile in about half the time. Every run in the tests starts from this
    key, so which generator drew the parameters does not matter; the keys the library derives (dropout, per device
    and per example) stay threefry. A function: a key made at import would start JAX's backend before a worker's
    ``sc.initialize()``.
    """
    return jax.random.key(0, impl="rbg")


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits, new_state = apply_fn(
        {"params": params, **model_state}, batch["x"], mutable=["batch_stats"], rngs={"dropout": rng}
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return sc.masked_mean(ce, mask), {"model_state": new_state}


def dataset() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32),
        "y": rng.integers(0, CLASSES, EXAMPLES).astype(np.int32),
    }


def initial_variables() -> dict:
    """Net's initial variables (parameters and batch statistics), as NumPy arrays."""
    return jax.tree.map(np.asarray, dict(_init(init_key(), np.zeros((2, FEATURES), np.float32))))


def fresh_state(mesh, variables: dict | None = None) -> sc.TrainState:
    """The initial state (the template a resumed run restores into), from ``variables`` (default:
    ``initial_variables()``)."""
    variables = dict(initial_variables() if variables is None else variables)
    params = variables.pop("params")
    return sc.TrainState.create(
        params=params, model_state=variables, apply_fn=Net().apply, tx=optax.adam(1e-2), mesh=mesh, rng=7
    )


def loader(mesh, *, shard_index: int = 0, num_shards: int = 1, prefetch: int = 2) -> sc.Loader:
    """This process's loader: its shard of every global batch, for all epochs, from the start."""
    sampler = sc.ShardedSampler(EXAMPLES, shard_index=shard_index, num_shards=num_shards, seed=3)
    return sc.Loader(
        dataset(), sampler, batch_size=GLOBAL_BATCH // num_shards, epochs=EPOCHS, prefetch=prefetch, mesh=mesh
    )


class KillAt:
    """The train step, except that the process SIGKILLs itself instead of running the step that would reach
    ``state.step == at`` (counted from the state it first sees)."""

    def __init__(self, step: sc.train.TrainStep, at: int):
        self.step, self.at, self.next = step, at, None
        self.max_in_flight = step.max_in_flight

    def __call__(self, state, batch):
        if self.next is None:
            self.next = int(state.step) + 1
        if self.next == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.next += 1
        return self.step(state, batch)


def hang_in_save(step: int, marker: Path, where: str) -> None:
    """Makes the save of checkpoint ``step`` write ``marker`` and sleep at ``where`` (see the module docstring)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import atomicity

    def stop() -> None:
        marker.write_text(where)
        time.sleep(600)

    if where == "arrays":  # the arrays are in the temporary directory; the step's metadata is not
        original = ocp.Checkpointer._save_step_metadata

        def save_step_metadata(self, directory, custom_metadata):
            if Path(directory).name.startswith(f"{step}."):
                stop()
            return original(self, directory, custom_metadata)

        ocp.Checkpointer._save_step_metadata = save_step_metadata
        return

    def hanging(original):
        async def finalize(self, *args, **kwargs):
            if self.get().name.startswith(f"{step}."):
                stop()
            return await original(self, *args, **kwargs)

        return finalize

    for cls in vars(atomicity).values():  # the complete checkpoint waits for its rename
        if isinstance(cls, type) and "finalize" in vars(cls):
            cls.finalize = hanging(vars(cls)["finalize"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_file", type=Path)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--hang-in-save", type=int)
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--hang-at", choices=["arrays", "rename"], default="rename")
    args = parser.parse_args()
    sc.initialize()
    mesh = sc.data_mesh()
    step = sc.make_train_step(loss_fn)
    first_attempt = os.environ.get("SPMDCOMM_RESTART_COUNT", "0") == "0"
    if args.kill_at is not None and first_attempt and sc.process_index() == args.kill_rank:
        step = KillAt(step, args.kill_at)
    if args.hang_in_save is not None:
        hang_in_save(args.hang_in_save, args.marker, args.hang_at)
    data = loader(mesh, shard_index=sc.process_index(), num_shards=sc.process_count())
    options = {} if args.ckpt_dir == "-" else {"checkpoint_dir": args.ckpt_dir, "save_every": args.save_every}
    state, history = sc.fit(step, fresh_state(mesh), data, **options)
    leaves = {
        jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf.addressable_data(0)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    if sc.process_index() == 0:
        np.savez(args.out_file, **leaves)
    print(f"trained {len(history)} steps, state.step {int(state.step)}", flush=True)


if __name__ == "__main__":
    main()
