"""Training and evaluation of the data-parallel MNIST example; ``main.py`` is its command line.

``train_and_evaluate(Config(...))`` trains the CNN of ``models.py`` DDP-style on every device of every process
with one ``sc.fit`` call over an ``sc.Loader`` for all epochs (spmdcomm's train step, sampler and prefetch; data
preparation under ``main_process_first``). An ``sc.Hook`` evaluates on the test split after every epoch
(``sc.evaluate``: exact means, the padded last test batch counted by its real rows), and the summary it returns
(JSON-ready) has one row per epoch, built from fit's per-step metrics, with where the step time went (waiting for
data, dispatching, waiting for the devices, saving, evaluating in the hook). With a ``checkpoint_dir`` the run
survives being stopped: it saves every ``save_every`` steps, at the end and when preempted (SIGTERM), and a run
started again with the same ``checkpoint_dir`` (by ``spmdcomm-launch --max-restarts``, or by hand) continues at
the batch where the latest checkpoint was taken and ends with bitwise the parameters of a run that never stopped
(the summary's ``params_sha256``). Call ``spmdcomm.initialize()`` first when the job has several processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
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
    "compile_s": "time/compile",  # the train step's first call, and the evaluation's (in the hooks' step)
    "save_s": "time/save",
    "hooks_s": "time/hooks",  # the epoch hook's evaluation, in the epoch's last step
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
    accum_steps: int = 1
    strategy: str = "ddp"  # "ddp" (replicated), "zero1"/"zero2" (Adam state split), "fsdp"
    seed: int = 0
    max_steps: int | None = None  # stop the run once state.step reaches this (saved with a checkpoint_dir)
    checkpoint_dir: str | None = None  # save here and resume from the latest checkpoint here
    save_every: int | None = None  # steps between checkpoints (default SAVE_EVERY; needs a checkpoint_dir)
    watchdog_timeout: float | None = None  # seconds: a longer step ends every process (status 75), naming the stuck one
    metrics_log: str | None = None  # JSON lines, one record per step; "{process}" in it: one file per process
    tensorboard_dir: str | None = None  # the same records as TensorBoard scalars (needs tensorboardX)
    progress: bool = True  # a progress bar on the main process


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains and evaluates as ``config`` says; returns the summary (one row per epoch trained by this call, the
    final test accuracy, a digest of the final parameters)."""
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
    # The schedule spans every epoch whatever max_steps says, so a stopped run continues the same schedule.
    state = create_train_state(config, total_steps=total)
    step = sc.make_train_step(make_loss_fn(), accum_steps=config.accum_steps)
    eval_step = sc.make_eval_step(make_metric_fn())
    # A checkpoint's number is the steps its state has trained; sc.fit restores it and the data position.
    start = (sc.latest_checkpoint_step(config.checkpoint_dir) if config.checkpoint_dir else None) or 0
    if main_proc:
        print(
            f"{ds.name}: {len(ds.train_labels)} train / {len(ds.test_labels)} test images, {n_proc} process(es) "
            f"x {sc.local_device_count()} {jax.devices()[0].platform} device(s), global batch {step_batch}"
        )
        if start:
            epoch, batch = divmod(start, per_epoch)
            print(
                f"resuming from {config.checkpoint_dir} at step {start} (epoch {epoch + 1}, batch {batch + 1} of "
                f"{per_epoch}), restart {sc.restart_count()}"
            )
    train = {"image": ds.train_images, "label": ds.train_labels}
    test = {"image": ds.test_images, "label": ds.test_labels}
    test_sampler = sc.ShardedSampler(
        len(ds.test_labels), shard_index=sc.process_index(), num_shards=n_proc, shuffle=False
    )

    def test_metrics(state: sc.TrainState) -> dict[str, float]:
        metrics = sc.evaluate(eval_step, state, sc.take_batches(test, test_sampler.batches(local_batch)))
        return {"test/loss": metrics["loss"], "test/accuracy": metrics["accuracy"]}

    def end_of_epoch(state: sc.TrainState, *, step: int, epoch: int) -> dict[str, float]:
        return {"epoch": epoch + 1, **test_metrics(state)}  # joins the metrics of the epoch's last step

    last = total if config.max_steps is None else min(total, config.max_steps)
    rows: list[dict[str, Any]] = []
    epoch_steps: list[dict[str, float]] = []  # the metrics of the current epoch's steps so far
    show = config.progress and main_proc

    def epoch_bar(step: int) -> tqdm:  # the progress bar of the epoch that global step ``step`` (0-based) is in
        epoch, batch = divmod(step, per_epoch)
        end, desc = min(per_epoch, last - epoch * per_epoch), f"epoch {epoch + 1}/{config.epochs}"
        return tqdm(total=end, initial=batch, desc=desc, unit="step", disable=not show, file=sys.stdout)

    def add_row(end: dict[str, float]) -> None:
        rows.append(_epoch_row(epoch_steps, end))
        epoch_steps.clear()
        if main_proc:
            print(_epoch_line(rows[-1]), flush=True)

    def on_step(i: int, metrics: dict[str, float]) -> None:
        nonlocal bar
        bar.update()
        epoch_steps.append(metrics)
        if "epoch" in metrics:  # the epoch's last step, with the epoch hook's test metrics
            bar.close()
            add_row(metrics)
            if start + i + 1 < last:
                bar = epoch_bar(start + i + 1)

    loader = sc.Loader(train, sampler, batch_size=local_batch, epochs=config.epochs, mesh=state.mesh, axis=state.axis)
    hooks = [sc.Hook(end_of_epoch, every_epochs=1)]
    bar = epoch_bar(start) if start < last else None
    state, _ = sc.fit(
        step, state, loader, max_steps=config.max_steps, hooks=hooks, callback=on_step, **fit_options(config)
    )
    if bar is not None:
        bar.close()
    done = int(jax.device_get(state.step))
    if epoch_steps:  # stopped by max_steps mid-epoch: that epoch's row has the test metrics of the final state
        add_row({"epoch": (done - 1) // per_epoch + 1, **test_metrics(state)})
    if main_proc and done < total:
        then = "; run again without it to continue" if config.checkpoint_dir else ""
        print(f"stopped at step {done} of {total} (max_steps){then}", flush=True)
    return {
        "dataset": ds.name,
        "processes": n_proc,
        "devices": n_dev,
        "platform": jax.devices()[0].platform,
        "global_batch": step_batch,
        "accum_steps": config.accum_steps,
        "strategy": config.strategy,
        "restarts": sc.restart_count(),
        "step": done,
        "epochs": rows,
        # Without rows the restored checkpoint had trained every step asked for: evaluate what it holds.
        "final_test_accuracy": rows[-1]["test_accuracy"] if rows else test_metrics(state)["test/accuracy"],
        "params_sha256": params_digest(state),
    }


def create_train_state(config: Config, *, total_steps: int) -> sc.TrainState:
    """The CNN's parameters and Adam with a cosine schedule that reaches 0 at ``total_steps``, replicated
    over every device as ``config.strategy`` says (``"zero1"``: the Adam state split over the devices)."""
    model = CNN()
    # Under jit, initialisation is one compiled program; run eagerly, every initializer shape and layer operation
    # compiles its own (a few seconds in each process on a CPU). Flax's examples initialise the same way.
    params = jax.jit(model.init)(jax.random.key(config.seed), np.zeros((1, 28, 28, 1), np.float32))["params"]
    tx = optax.adam(optax.cosine_decay_schedule(config.lr, max(total_steps, 1)))
    return sc.TrainState.create(
        params=params,
        tx=tx,
        apply_fn=model.apply,
        rng=config.seed,
        strategy=config.strategy,
    )


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


def params_digest(state: sc.TrainState) -> str:
    """SHA-256 of the model's parameters (every leaf's bytes, in tree order): equal digests, equal bits."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(state.full_params()):
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


def _epoch_row(steps: list[dict[str, float]], end: dict[str, float]) -> dict[str, Any]:
    """An epoch's row from its steps' metrics (train loss over real examples, mean seconds per step of each phase,
    samples/s of the training alone, compilation left out) and ``end``: the epoch's number and test metrics."""
    n = len(steps)
    examples = sum(m["examples"] for m in steps)
    totals = {key: sum(m[name] for m in steps) for key, name in PHASE_KEYS.items()}
    seconds = sum(totals.values())  # a step's phases add up to its wall time
    return {
        "epoch": int(end["epoch"]),
        "train_loss": sum(m["loss"] * m["examples"] for m in steps) / examples,
        # neither the evaluation nor compiling is training
        "samples_per_s": examples / (seconds - totals["hooks_s"] - totals["compile_s"]),
        "seconds": seconds,
        "steps": n,
        **{key: total / n for key, total in totals.items()},
        "test_loss": end["test/loss"],
        "test_accuracy": end["test/accuracy"],
    }


def _epoch_line(row: dict[str, Any]) -> str:
    phases = ", ".join(f"{key.split('_')[0]} {1e3 * row[key]:.1f}" for key in PHASE_KEYS)
    return (
        f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, test loss {row['test_loss']:.4f}, "
        f"test accuracy {100 * row['test_accuracy']:.2f}%, {row['samples_per_s']:.0f} samples/s; ms per step: {phases}"
    )


def _global_batch(config: Config, dataset: str, n_dev: int) -> int:
    """The requested global batch, rounded down to a multiple of devices x accumulation steps."""
    wanted = config.batch_size or (128 if dataset == "mnist" else 32)  # digits has only 1,437 training images
    unit = n_dev * config.accum_steps
    got = max(wanted // unit, 1) * unit
    if got != wanted and sc.is_main_process():
        print(f"batch size {wanted} -> {got}, a multiple of {n_dev} devices x {config.accum_steps}")
    return got
