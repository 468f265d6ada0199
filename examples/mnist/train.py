"""Training and evaluation of the data-parallel MNIST example; ``main.py`` is its command line.

``train_and_evaluate(Config(...))`` trains the CNN of ``models.py`` DDP-style on every device of every process
with ``sc.fit`` over an ``sc.Loader`` (spmdcomm's train step, sampler and prefetch; data preparation under
``main_process_first``), evaluates it on the test split after every epoch, and returns a JSON-ready summary
that includes where each epoch's step time went (waiting for data, dispatching, waiting for the devices,
saving). With a ``checkpoint_dir`` the run survives being stopped: it saves every ``save_every`` steps, at
each epoch end and when preempted (SIGTERM), and a run started again with the same ``checkpoint_dir`` (by
``spmdcomm-launch --max-restarts``, or by hand) continues at the batch where the latest checkpoint was taken
and ends with bitwise the parameters of a run that never stopped (the summary's ``params_sha256``). Call
``spmdcomm.initialize()`` first when the job has several processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import sys
import time
from typing import Any

import input_pipeline
import jax
import numpy as np
import optax
from models import CNN, make_loss_fn, make_metric_fn
from tqdm import tqdm

import spmdcomm as sc

SAVE_EVERY = 100  # steps between checkpoints with a checkpoint_dir, unless Config.save_every says otherwise
KEEP_CHECKPOINTS = 3  # the newest checkpoints kept in checkpoint_dir; fit deletes older ones
# Each epoch row's mean seconds per step in each phase, from the metrics sc.fit records for every step.
PHASE_KEYS = {
    "data_wait_s": "time/data",
    "dispatch_s": "time/dispatch",
    "devices_s": "time/devices",
    "save_s": "time/save",
    "other_s": "time/other",
}


@dataclasses.dataclass
class Config:
    """What to train and how; ``main.py`` has one command-line option per field."""

    dataset: str = "auto"  # "mnist", "digits", or "auto": MNIST if present or downloadable, else digits
    data_dir: str | None = None  # folder with the four MNIST IDX files (default: a cache folder)
    download: bool = False  # fetch MNIST if it is not there
    epochs: int = 3
    batch_size: int | None = None  # global, all devices; default 128 for MNIST, 32 for the small digits set
    lr: float = 2e-3  # peak Adam learning rate, cosine decay to 0 by the last step of the last epoch
    backend: str = "shard_map"  # or "pmap"
    accum_steps: int = 1
    strategy: str = "ddp"  # one of sc.STRATEGIES: "ddp" (replicated), "zero1"/"zero2" (Adam state split), "fsdp"
    seed: int = 0
    max_steps: int | None = None  # stop the run once state.step reaches this (saved with a checkpoint_dir)
    checkpoint_dir: str | None = None  # save here and resume from the latest checkpoint here
    save_every: int | None = None  # steps between checkpoints (default SAVE_EVERY; needs a checkpoint_dir)
    watchdog_timeout: float | None = None  # seconds: a longer step ends every process (status 75), naming the stuck one
    metrics_log: str | None = None  # JSON lines, one record per step; "{process}" in it: one file per process
    tensorboard_dir: str | None = None  # the same records as TensorBoard scalars (needs tensorboardX)
    progress: bool = True  # a progress bar on the main process


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains and evaluates as ``config`` says; returns the summary (one row per epoch, final accuracy, a
    digest of the final parameters)."""
    main_proc = sc.is_main_process()
    with sc.main_process_first():  # process 0 downloads/decompresses first; the others then read its files
        ds = input_pipeline.load_dataset(config.dataset, config.data_dir, download=config.download)
    n_dev, n_proc = sc.device_count(), sc.process_count()
    step_batch = _global_batch(config, ds.name, n_dev)
    local_batch = step_batch // n_proc
    sampler = sc.ShardedSampler(
        len(ds.train_labels), shard_index=sc.process_index(), num_shards=n_proc, seed=config.seed
    )
    per_epoch = sampler.num_batches(local_batch)
    total = config.epochs * per_epoch
    last = total if config.max_steps is None else min(total, config.max_steps)
    # The schedule spans every epoch whatever max_steps says, so a stopped run continues the same schedule.
    state = create_train_state(config, total_steps=total)
    step = sc.make_train_step(make_loss_fn(), backend=config.backend, accum_steps=config.accum_steps)
    evaluate_step = sc.make_eval_step(make_metric_fn(), backend=config.backend)
    # A checkpoint's number is the steps its state has trained; sc.fit restores it and the data position.
    done = (sc.latest_checkpoint_step(config.checkpoint_dir) if config.checkpoint_dir else None) or 0
    if main_proc:
        print(
            f"{ds.name}: {len(ds.train_labels)} train / {len(ds.test_labels)} test images, {n_proc} process(es) "
            f"x {sc.local_device_count()} {jax.devices()[0].platform} device(s), global batch {step_batch}"
        )
        if done:
            epoch, batch = divmod(done, per_epoch)
            print(
                f"resuming from {config.checkpoint_dir} at step {done} (epoch {epoch + 1}, batch {batch + 1} of "
                f"{per_epoch}), restart {sc.restart_count()}"
            )
    train = {"image": ds.train_images, "label": ds.train_labels}
    test = {"image": ds.test_images, "label": ds.test_labels}
    test_sampler = sc.ShardedSampler(
        len(ds.test_labels), shard_index=sc.process_index(), num_shards=n_proc, shuffle=False
    )

    def test_metrics(state: sc.TrainState) -> dict[str, float]:
        return evaluate(evaluate_step, state, sc.take_batches(test, test_sampler.batches(local_batch)))

    history = []
    while done < last:
        # One sc.fit call per epoch (or up to the last step), so that every epoch ends with an evaluation.
        epoch, start = divmod(done, per_epoch)
        end = min(last - epoch * per_epoch, per_epoch)
        loader = sc.Loader(train, sampler, batch_size=local_batch, epochs=epoch + 1, mesh=state.mesh, axis=state.axis)
        data = loader if end == per_epoch else _Until(loader, epoch * per_epoch + end)
        state, row = train_epoch(step, state, data, config, epoch=epoch, start=start, end=end)
        done = epoch * per_epoch + end
        metrics = test_metrics(state)
        sc.barrier(f"after step {done}")
        row.update(test_loss=metrics["loss"], test_accuracy=metrics["accuracy"])
        history.append(row)
        if main_proc:
            print(_epoch_line(row), flush=True)
    if not history and done:  # the checkpoint has already trained every step asked for: report it
        state = sc.restore_checkpoint(config.checkpoint_dir, state)
    if main_proc and done < total:
        then = "; run again without it to continue" if config.checkpoint_dir else ""
        print(f"stopped at step {done} of {total} (max_steps){then}", flush=True)
    return {
        "dataset": ds.name,
        "processes": n_proc,
        "devices": n_dev,
        "platform": jax.devices()[0].platform,
        "backend": config.backend,
        "global_batch": step_batch,
        "accum_steps": config.accum_steps,
        "strategy": config.strategy,
        "restarts": sc.restart_count(),
        "step": done,
        "epochs": history,
        "final_test_accuracy": history[-1]["test_accuracy"] if history else test_metrics(state)["accuracy"],
        "params_sha256": params_digest(state),
    }


def create_train_state(config: Config, *, total_steps: int) -> sc.TrainState:
    """The CNN's parameters and Adam with a cosine schedule that reaches 0 at ``total_steps``, replicated
    over every device as ``config.strategy`` says (``"zero1"``: the Adam state split over the devices)."""
    model = CNN()
    params = model.init(jax.random.key(config.seed), np.zeros((1, 28, 28, 1), np.float32))["params"]
    tx = optax.adam(optax.cosine_decay_schedule(config.lr, max(total_steps, 1)))
    return sc.TrainState.create(
        params=params,
        tx=tx,
        apply_fn=model.apply,
        rng=config.seed,
        strategy=config.strategy,
    )


def train_epoch(step, state: sc.TrainState, data, config: Config, *, epoch: int, start: int, end: int):
    """Batches ``start`` to ``end`` of epoch ``epoch`` (0-based) from ``data`` (an ``sc.Loader``, which
    prefetches), through ``sc.fit`` with the config's checkpoint, watchdog and metrics options.

    Returns the new state and the epoch's row: mean train loss over real examples, samples/s, seconds, steps,
    and the mean seconds per step of each phase (``PHASE_KEYS``).
    """
    show = config.progress and sc.is_main_process()
    desc = f"epoch {epoch + 1}/{config.epochs}"
    bar = tqdm(total=end, initial=start, desc=desc, unit="step", disable=not show, file=sys.stdout)
    begin = time.perf_counter()
    state, steps = sc.fit(step, state, data, callback=lambda i, m: bar.update(1), **fit_options(config))
    seconds = time.perf_counter() - begin
    bar.close()
    examples = sum(m["examples"] for m in steps)
    return state, {
        "epoch": epoch + 1,
        "train_loss": sum(m["loss"] * m["examples"] for m in steps) / examples,
        "samples_per_s": examples / seconds,
        "seconds": seconds,
        "steps": len(steps),
        **{key: sum(m[name] for m in steps) / len(steps) for key, name in PHASE_KEYS.items()},
    }


def fit_options(config: Config) -> dict[str, Any]:
    """``sc.fit``'s failure and metrics options from ``config``. A metrics path without ``{process}`` is
    written by process 0 only (the metrics are the same on every process; the phase times are its own)."""

    def mine(path: str | None) -> str | None:
        return path if path is None or sc.is_main_process() or "{process}" in path else None

    options = {
        "save_every": config.save_every,  # without a checkpoint_dir, fit says that it needs one
        "watchdog_timeout": config.watchdog_timeout,
        "metrics_log": mine(config.metrics_log),
        "tensorboard_dir": mine(config.tensorboard_dir),
    }
    if config.checkpoint_dir:
        options.update(
            checkpoint_dir=config.checkpoint_dir,
            save_every=config.save_every or SAVE_EVERY,
            max_to_keep=KEEP_CHECKPOINTS,
        )
    return options


def evaluate(evaluate_step, state: sc.TrainState, batches) -> dict[str, float]:
    """Exact test metrics: every batch's means weighted by its number of real examples."""
    totals: dict[str, float] = {}
    count = 0.0
    for batch in batches:
        metrics = {k: float(v) for k, v in evaluate_step(state, batch).items()}
        count += metrics["examples"]
        for k, v in metrics.items():
            if k != "examples":
                totals[k] = totals.get(k, 0.0) + v * metrics["examples"]
    return {k: v / count for k, v in totals.items()}


def params_digest(state: sc.TrainState) -> str:
    """SHA-256 of the model's parameters (every leaf's bytes, in tree order): equal digests, equal bits."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(state.full_params()):
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


class _Until:
    """``loader``'s batches up to step ``end`` of the run (its position counted in steps), resumable like it:
    ``sc.fit`` saves and restores the loader's position through this object."""

    def __init__(self, loader: sc.Loader, end: int):
        self.loader = loader
        self.end = end

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self):
        position = self.loader.state_dict()
        done = position["epoch"] * self.loader.sampler.num_batches(self.loader.batch_size) + position["batch"]
        batches = iter(self.loader)
        try:
            yield from itertools.islice(batches, max(self.end - done, 0))
        finally:
            batches.close()  # stops the loader's prefetch thread; its position stays at the last batch handed out


def _epoch_line(row: dict[str, Any]) -> str:
    phases = ", ".join(f"{key.split('_')[0]} {1e3 * row[key]:.1f}" for key in PHASE_KEYS)
    return (
        f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, test loss {row['test_loss']:.4f}, "
        f"test accuracy {100 * row['test_accuracy']:.2f}%, {row['samples_per_s']:.0f} samples/s; "
        f"ms per step: {phases}"
    )


def _global_batch(config: Config, dataset: str, n_dev: int) -> int:
    """The requested global batch, rounded down to a multiple of devices x accumulation steps."""
    wanted = config.batch_size or (128 if dataset == "mnist" else 32)  # digits has only 1,437 training images
    unit = n_dev * config.accum_steps
    got = max(wanted // unit, 1) * unit
    if got != wanted and sc.is_main_process():
        print(f"batch size {wanted} -> {got}, a multiple of {n_dev} devices x {config.accum_steps}")
    return got
