"""Training and evaluation of the data-parallel MNIST example; ``main.py`` is its command line.

``train_and_evaluate(Config(...))`` trains the CNN of ``models.py`` DDP-style on every device of every process
(spmdcomm's train step, sampler and prefetch; data preparation under ``main_process_first``; a barrier at
each epoch end), evaluates it on the test split after every epoch, and returns a JSON-ready summary. Call
``spmdcomm.initialize()`` first when the job has several processes.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class Config:
    """What to train and how; ``main.py`` has one command-line option per field."""

    dataset: str = "auto"  # "mnist", "digits", or "auto": MNIST if present or downloadable, else digits
    data_dir: str | None = None  # folder with the four MNIST IDX files (default: a cache folder)
    download: bool = False  # fetch MNIST if it is not there
    epochs: int = 3
    batch_size: int | None = None  # global, all devices; default 128 for MNIST, 32 for the small digits set
    lr: float = 2e-3  # peak Adam learning rate, cosine decay to 0 by the last step
    backend: str = "shard_map"  # or "pmap"
    accum_steps: int = 1
    strategy: str = "ddp"  # one of sc.STRATEGIES: "ddp" (replicated), "zero1"/"zero2" (Adam state split), "fsdp"
    seed: int = 0
    max_steps: int | None = None  # stop each epoch after this many steps
    checkpoint_dir: str | None = None  # save after every epoch; resume from the latest
    progress: bool = True  # a progress bar on the main process


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains and evaluates as ``config`` says; returns the summary (one row per epoch, final accuracy)."""
    main_proc = sc.is_main_process()
    with sc.main_process_first():  # process 0 downloads/decompresses first; the others then read its files
        ds = input_pipeline.load_dataset(config.dataset, config.data_dir, download=config.download)
    n_dev, n_proc = sc.device_count(), sc.process_count()
    step_batch = _global_batch(config, ds.name, n_dev)
    local_batch = step_batch // n_proc
    sampler = sc.ShardedSampler(
        len(ds.train_labels), shard_index=sc.process_index(), num_shards=n_proc, seed=config.seed
    )
    steps_per_epoch = min(sampler.num_batches(local_batch), config.max_steps or sampler.num_batches(local_batch))
    state = create_train_state(config, total_steps=config.epochs * steps_per_epoch)
    step = sc.make_train_step(make_loss_fn(), backend=config.backend, accum_steps=config.accum_steps)
    evaluate_step = sc.make_eval_step(make_metric_fn(), backend=config.backend)
    first_epoch = 0
    if config.checkpoint_dir and sc.latest_checkpoint_step(config.checkpoint_dir) is not None:
        state = sc.restore_checkpoint(config.checkpoint_dir, state)
        first_epoch = int(state.step) // steps_per_epoch
        if main_proc:
            print(f"resumed from {config.checkpoint_dir} at step {int(state.step)} (epoch {first_epoch})")
    if main_proc:
        print(
            f"{ds.name}: {len(ds.train_labels)} train / {len(ds.test_labels)} test images, {n_proc} process(es) "
            f"x {sc.local_device_count()} {jax.devices()[0].platform} device(s), global batch {step_batch}"
        )
    train = {"image": ds.train_images, "label": ds.train_labels}
    test = {"image": ds.test_images, "label": ds.test_labels}
    test_sampler = sc.ShardedSampler(
        len(ds.test_labels), shard_index=sc.process_index(), num_shards=n_proc, shuffle=False
    )
    history = []
    for epoch in range(first_epoch, config.epochs):
        index_batches = list(sampler.batches(local_batch, epoch=epoch))[: config.max_steps]
        state, row = train_epoch(step, state, sc.take_batches(train, index_batches), len(index_batches), epoch, config)
        test_metrics = evaluate(evaluate_step, state, sc.take_batches(test, test_sampler.batches(local_batch)))
        sc.barrier(f"end of epoch {epoch}")
        if config.checkpoint_dir:
            sc.save_checkpoint(config.checkpoint_dir, state)
        row.update(test_loss=test_metrics["loss"], test_accuracy=test_metrics["accuracy"])
        history.append(row)
        if main_proc:
            print(
                f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, test loss {row['test_loss']:.4f}, "
                f"test accuracy {100 * row['test_accuracy']:.2f}%, {row['samples_per_s']:.0f} samples/s, "
                f"waited {1e3 * row['data_wait_s']:.0f} ms for data",
                flush=True,
            )
    return {
        "dataset": ds.name,
        "processes": n_proc,
        "devices": n_dev,
        "platform": jax.devices()[0].platform,
        "backend": config.backend,
        "global_batch": step_batch,
        "accum_steps": config.accum_steps,
        "strategy": config.strategy,
        "epochs": history,
        "final_test_accuracy": history[-1]["test_accuracy"] if history else None,
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


def train_epoch(step, state: sc.TrainState, batches, num_steps: int, epoch: int, config: Config):
    """One epoch over ``batches`` (this process's part of each global batch), prefetched to the devices.

    Returns the new state and the epoch's row: mean train loss over real examples, samples/s, seconds,
    time spent waiting for data, steps.
    """
    show = config.progress and sc.is_main_process()
    bar = tqdm(
        total=num_steps, desc=f"epoch {epoch + 1}/{config.epochs}", unit="step", disable=not show, file=sys.stdout
    )
    start = time.perf_counter()
    with sc.prefetch_to_device(batches) as placed:
        state, steps = sc.fit(step, state, placed, callback=lambda i, m: bar.update(1))
        waited = placed.stats.total_wait
    seconds = time.perf_counter() - start
    bar.close()
    examples = sum(m["examples"] for m in steps)
    return state, {
        "epoch": epoch + 1,
        "train_loss": sum(m["loss"] * m["examples"] for m in steps) / examples,
        "samples_per_s": examples / seconds,
        "seconds": seconds,
        "data_wait_s": waited,
        "steps": len(steps),
    }


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


def _global_batch(config: Config, dataset: str, n_dev: int) -> int:
    """The requested global batch, rounded down to a multiple of devices x accumulation steps."""
    wanted = config.batch_size or (128 if dataset == "mnist" else 32)  # digits has only 1,437 training images
    unit = n_dev * config.accum_steps
    got = max(wanted // unit, 1) * unit
    if got != wanted and sc.is_main_process():
        print(f"batch size {wanted} -> {got}, a multiple of {n_dev} devices x {config.accum_steps}")
    return got
