"""Training and evaluation of the ResNet example; ``main.py`` is its command line.

``train_and_evaluate(Config(...))`` trains the ResNet of ``models.py`` data-parallel on every device of every
process with ``sc.fit`` over an ``sc.Loader``: synchronised BatchNorm, SGD with Nesterov momentum, weight decay on
the convolution and dense kernels only, and a linear warm-up into a cosine decay. ``half_precision`` computes in
float16 with dynamic loss scaling carried in the train state (the step skips a step whose gradients overflow and
adapts the scale). An ``sc.Hook`` evaluates on the test split after every epoch (``sc.evaluate``: exact means, the
padded last test batch counted by its real rows). With a ``checkpoint_dir`` a stopped run started again resumes
where its latest checkpoint was taken and ends with the same numbers as a run that never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import input_pipeline
import jax
import jax.numpy as jnp
import numpy as np
import optax
from models import ResNet, make_loss_fn, make_metric_fn

import spmdcomm as sc


@dataclasses.dataclass
class Config:
    """What to train and how; ``main.py`` has one command-line option per field."""

    epochs: int = 6
    batch_size: int = 64  # global, over all devices and processes
    lr: float = 0.1  # peak learning rate, reached after the warm-up
    warmup_epochs: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 5e-4  # on kernels only (not on BatchNorm scales and biases)
    half_precision: bool = False  # float16 computation with dynamic loss scaling
    widths: tuple[int, ...] = (16, 32, 64)  # channels of each stage (one residual block per stage)
    strategy: str = "ddp"  # one of spmdcomm.train.STRATEGIES
    train_size: int = 3000
    test_size: int = 600  # not a multiple of the batch: the last test batch is padded
    seed: int = 0
    max_steps: int | None = None  # stop once state.step reaches this (saved with a checkpoint_dir)
    checkpoint_dir: str | None = None  # save here every save_every steps and at the end; resume from here
    save_every: int = 50


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains and evaluates as ``config`` says; returns the summary (one row per epoch trained by this call, the
    final test accuracy, the steps skipped for overflow and the final loss scale)."""
    train = input_pipeline.make_split(config.train_size, seed=config.seed)
    test = input_pipeline.make_split(config.test_size, seed=config.seed + 1)
    n_proc, local_batch = sc.process_count(), _local_batch(config)
    sampler = sc.ShardedSampler(config.train_size, shard_index=sc.process_index(), num_shards=n_proc, seed=config.seed)
    per_epoch = sampler.num_batches(local_batch)
    state = create_train_state(config, steps_per_epoch=per_epoch)
    step = sc.make_train_step(make_loss_fn())
    eval_step = sc.make_eval_step(make_metric_fn())
    test_sampler = sc.ShardedSampler(config.test_size, shard_index=sc.process_index(), num_shards=n_proc, shuffle=False)

    def test_metrics(state: sc.TrainState) -> dict[str, float]:
        metrics = sc.evaluate(eval_step, state, sc.take_batches(test, test_sampler.batches(local_batch)))
        return {"test/loss": metrics["loss"], "test/accuracy": metrics["accuracy"]}

    def end_of_epoch(state: sc.TrainState, *, step: int, epoch: int) -> dict[str, float]:
        return {**test_metrics(state), "epoch": epoch + 1}

    loader = sc.Loader(train, sampler, batch_size=local_batch, epochs=config.epochs, mesh=state.mesh, axis=state.axis)
    rows = EpochRows(per_epoch)
    checkpoints = {}
    if config.checkpoint_dir:
        checkpoints = {"checkpoint_dir": config.checkpoint_dir, "save_every": config.save_every, "max_to_keep": 2}
    state, history = sc.fit(
        step,
        state,
        loader,
        max_steps=config.max_steps,
        hooks=[sc.Hook(end_of_epoch, every_epochs=1)],
        callback=rows.add,
        **checkpoints,
    )
    final_step = int(jax.device_get(state.step))
    rows.close(final_step)
    return {
        "dataset": "shapes",
        "processes": n_proc,
        "devices": sc.device_count(),
        "platform": jax.devices()[0].platform,
        "global_batch": local_batch * n_proc,
        "half_precision": config.half_precision,
        "strategy": config.strategy,
        "restarts": sc.restart_count(),
        "step": final_step,
        "epochs": rows.rows,
        "final_train_loss": rows.rows[-1]["train_loss"] if rows.rows else None,
        "final_test_accuracy": test_metrics(state)["test/accuracy"],
        "skipped_steps": int(sum(m.get("skipped", 0.0) for m in history)),
        "final_loss_scale": float(state.loss_scale.scale) if state.loss_scale is not None else None,
    }


def create_train_state(config: Config, *, steps_per_epoch: int) -> sc.TrainState:
    """The ResNet's variables, and SGD with a warm-up cosine schedule over every epoch (the learning rate is a
    metric of every step through ``optax.inject_hyperparams``)."""
    dtype = jnp.float16 if config.half_precision else jnp.float32
    model = ResNet(num_classes=len(input_pipeline.CLASSES), widths=config.widths, dtype=dtype)
    shape = (1, input_pipeline.SIZE, input_pipeline.SIZE, 3)
    # One compiled program, not one per initializer shape and layer operation (as the MNIST example says).
    variables = jax.jit(functools.partial(model.init, train=False))(
        jax.random.key(config.seed), np.zeros(shape, np.float32)
    )
    total = config.epochs * steps_per_epoch
    warmup = max(min(int(config.warmup_epochs * steps_per_epoch), total - 1), 1)  # leaves the cosine a step or more
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, warmup_steps=warmup, decay_steps=max(total, warmup + 1)
    )
    kernels = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)
    tx = optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=kernels),
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=config.momentum, nesterov=True),
    )
    return sc.TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        tx=tx,
        apply_fn=model.apply,
        rng=config.seed,
        strategy=config.strategy,
        loss_scale="dynamic" if config.half_precision else None,
    )


class EpochRows:
    """``fit``'s callback: folds each step's metrics into one row per epoch (printed on the main process when the
    epoch's evaluation arrives with its last step)."""

    def __init__(self, per_epoch: int):
        self.per_epoch = per_epoch
        self.rows: list[dict[str, Any]] = []
        self._steps: list[dict[str, float]] = []

    def add(self, i: int, metrics: dict[str, float]) -> None:
        self._steps.append(metrics)
        if "test/accuracy" in metrics:
            self._row(metrics)

    def close(self, final_step: int) -> None:
        """Adds the row of a partly trained last epoch (a run stopped by max_steps at global step ``final_step``)."""
        if self._steps:
            self._row({"epoch": (final_step - 1) // self.per_epoch + 1})

    def _row(self, last: dict[str, float]) -> None:
        steps, self._steps = self._steps, []
        examples = sum(m["examples"] for m in steps)
        # fit reports each step's metrics one in-flight window late, so the wall clock here says little; the
        # steps' phase times add up to each step's wall time (the evaluation is the hooks phase: left out).
        seconds = sum(v for m in steps for k, v in m.items() if k.startswith("time/") and k != "time/hooks")
        row = {
            "epoch": int(last["epoch"]),
            "steps": len(steps),
            "train_loss": sum(m["loss"] * m["examples"] for m in steps) / examples,
            "train_accuracy": sum(m["accuracy"] * m["examples"] for m in steps) / examples,
            "learning_rate": steps[-1]["learning_rate"],
            "test_loss": last.get("test/loss"),
            "test_accuracy": last.get("test/accuracy"),
            "skipped_steps": int(sum(m.get("skipped", 0.0) for m in steps)),
            "loss_scale": steps[-1].get("loss_scale"),
            "samples_per_s": examples / seconds,
        }
        self.rows.append(row)
        if sc.is_main_process():
            print(_line(row), flush=True)


def _line(row: dict[str, Any]) -> str:
    test = "" if row["test_accuracy"] is None else f", test accuracy {100 * row['test_accuracy']:.1f}%"
    scale = "" if row["loss_scale"] is None else f", loss scale {row['loss_scale']:g} ({row['skipped_steps']} skipped)"
    return (
        f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, train accuracy {100 * row['train_accuracy']:.1f}%"
        f"{test}, lr {row['learning_rate']:.4f}{scale}, {row['samples_per_s']:.0f} samples/s"
    )


def _local_batch(config: Config) -> int:
    """This process's rows of each global batch: the global batch must split evenly over processes and devices."""
    if config.batch_size % sc.device_count():
        raise SystemExit(f"--batch-size {config.batch_size} is not a multiple of the {sc.device_count()} devices")
    return config.batch_size // sc.process_count()
