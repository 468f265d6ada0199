"""Training and evaluation of the byte-level language model example; ``main.py`` is its command line.

``train_and_evaluate(Config(...))`` trains the transformer of ``models.py`` on the Python standard library's source
(``input_pipeline.py``) on a mesh the config names (``"data=4,model=2"``: the batch split over ``data``, attention
heads and MLP units over ``model``; ``"replica=2,shard=4"``: hybrid sharding; ``"data=2,expert=4"`` with
``experts``: the experts split over ``expert``, the batch over both; ``"data=2,stage=2,model=2"``: the blocks a
pipeline of the config's ``schedule``), with the config's strategy, AdamW
with a warm-up cosine schedule, and one ``sc.fit`` call over an ``sc.Loader``. An ``sc.Hook`` computes the
validation loss every ``eval_every`` steps through ``sc.evaluate``; each evaluation prints validation bits per byte
next to the unigram baseline's (the training bytes' frequencies). The loss is token-weighted (``sc.weighted``): the
mean over every real byte of the global batch, the same number on every layout; ``packed=True`` cuts every window
into documents of different lengths padded at the end (``input_pipeline.packed_bytes``). With a ``checkpoint_dir``
a stopped run started again resumes at the step of its latest checkpoint, with the data position, the schedule and
the random state.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import input_pipeline
import jax
import jax.numpy as jnp
import numpy as np
import optax
from input_pipeline import bits
from jax.sharding import Mesh
from models import MODEL_AXIS, Transformer, logical_axis_rules, make_loss_fn, make_metric_fn

import spmdcomm as sc

PIPELINE_AXIS = "stage"  # the mesh axis of pipeline stages
CONTEXT_AXIS = "context"  # the mesh axis every sequence is split over
EXPERT_AXIS = "expert"  # the mesh axis the experts are split over (and the batch, as over a data axis)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Config:
    """What to train and how; ``main.py`` has one command-line option per field."""

    mesh: str = "data=-1"  # mesh axes and sizes; -1 takes the devices the others leave
    strategy: str = "ddp"  # one of spmdcomm.train.STRATEGIES, over the data axes
    microbatches: int = 1  # a pipeline's micro-batches; without a stage axis, gradient accumulation's
    repeats: int = 1  # a pipeline's layer groups per stage (needs a "stage" axis)
    schedule: str = "gpipe"  # a pipeline's: "gpipe", "1f1b" (with repeats: interleaved 1F1B) or "zb-h1"
    attention: str = "ring"  # how attention crosses a "context" axis: "ring" or "all_to_all"
    experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (split over an "expert" axis)
    top_k: int = 2  # experts per token
    mlp_ratio: int = 4  # an MLP's (or expert's) hidden units per unit of width
    packed: bool = False  # rows of documents of different lengths, padded at the end (else whole windows)
    width: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 128  # bytes of context; each window holds seq_len + 1 bytes
    batch_size: int = 32  # windows per step, global over every device and process
    steps: int = 500  # the schedule's length; the run ends here unless max_steps stops it sooner
    lr: float = 3e-3  # peak AdamW learning rate, after the warm-up; cosine decay to lr / 10 at `steps`
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on kernels only
    corpus_bytes: int = 8_000_000  # bytes of source read (train and validation together)
    eval_windows: int = 256  # validation windows of seq_len + 1 bytes
    eval_every: int = 100  # steps between validation losses
    dtype: str = "float32"  # the computation's ("bfloat16" on accelerators); parameters stay float32
    seed: int = 0
    max_steps: int | None = None  # stop once state.step reaches this (saved with a checkpoint_dir)
    checkpoint_dir: str | None = None  # save here every save_every steps and at the end; resume from here
    save_every: int = 200


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,stage=2,model=2"`` as ``{"data": 2, "stage": 2, "model": 2}`` (in order; one size may be -1).

    Raises:
      ValueError: for an entry that is not ``name=size``, a repeated name, or a size that is not an int.
    """
    axes: dict[str, int] = {}
    for entry in text.split(","):
        name, sep, size = (part.strip() for part in entry.partition("="))
        if not sep or not name.isidentifier() or name in axes:
            raise ValueError(f"--mesh {text!r}: {entry!r} is not name=size with a new name (e.g. data=4,model=2)")
        try:
            axes[name] = int(size)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: the size of {name!r} is {size!r}, not an int") from None
    return axes


def data_axes(axis_names: Sequence[str]) -> str | tuple[str, ...]:
    """The data axes: every axis but the model's, the pipeline's, the context's and the experts', in mesh order
    (several: hybrid sharding, ZeRO and FSDP splitting over the last one).

    Raises:
      ValueError: when no axis is left for the data.
    """
    axes = tuple(a for a in axis_names if a not in (MODEL_AXIS, PIPELINE_AXIS, CONTEXT_AXIS, EXPERT_AXIS))
    if not axes:
        raise ValueError(f"the mesh {tuple(axis_names)} has no data axis: add one, e.g. data=-1")
    return axes[0] if len(axes) == 1 else axes


def make_model(config: Config) -> Transformer:
    """The transformer ``config`` describes."""
    return Transformer(
        width=config.width,
        layers=config.layers,
        heads=config.heads,
        max_len=config.seq_len,
        dtype=DTYPES[config.dtype],
        attention=config.attention,
        mlp_ratio=config.mlp_ratio,
        experts=config.experts,
        top_k=config.top_k,
    )


def count_parameters(config: Config) -> tuple[int, int]:
    """The model's parameters and those active for one token (``top_k`` of each mixture's experts), counted from
    their shapes (nothing is initialised or gathered)."""
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    shapes = jax.eval_shape(make_model(config).init, jax.random.key(0), tokens)["params"]
    total = active = 0
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        size = math.prod(x.shape)
        total += size
        experts = any(getattr(k, "key", None) == "experts" for k in path)
        active += size * config.top_k // config.experts if experts else size
    return total, active


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW (decay on kernels only) after clipping the global gradient norm to 1, with a linear warm-up to ``lr``
    and a cosine decay to ``lr / 10`` at ``config.steps``; the learning rate is every step's metric."""
    warmup = max(min(config.warmup_steps, config.steps - 1), 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, warmup_steps=warmup, decay_steps=max(config.steps, warmup + 1), end_value=config.lr / 10
    )
    kernels = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)
    # optax.adamw's pieces: inject_hyperparams would call the mask as if it were a schedule.
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b2=0.95),
        optax.add_decayed_weights(config.weight_decay, mask=kernels),
        optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=schedule),
    )


def init_params(config: Config) -> Any:
    """The model's initial parameters (boxed with their logical names), from ``config.seed``."""
    # One compiled program for the initialisation, as Flax's examples do (eagerly, each initializer compiles).
    tokens = np.zeros((1, config.seq_len), np.int32)
    return jax.jit(make_model(config).init)(jax.random.key(config.seed), tokens)["params"]


def datasets(config: Config, corpus: input_pipeline.Corpus) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training and validation datasets (dicts of lazily indexed leaves of ``[rows, seq_len]``): random
    training windows and fixed validation ones, each cut into documents when ``config.packed``."""
    windows = input_pipeline.train_windows(corpus.train, config.seq_len, seed=config.seed)
    val = input_pipeline.eval_windows(corpus.val, config.seq_len, config.eval_windows)
    if config.packed:
        # The validation documents do not depend on the seed: every run validates on the same ones.
        return input_pipeline.packed_bytes(windows, seed=config.seed), input_pipeline.packed_bytes(val, seed=0)
    return input_pipeline.next_bytes(windows), input_pipeline.next_bytes(val)


def build_state(
    config: Config, mesh: Mesh, *, params: Any = None, pipeline: sc.Pipeline | None = None
) -> tuple[sc.TrainState, sc.TrainStep]:
    """The train state on ``mesh`` (the strategy over its data axes, the model's logical names mapped to its
    model axis, a pipeline over a ``"stage"`` axis, a context split over a ``"context"`` axis) and the train step.

    ``config.microbatches`` is the pipeline's micro-batches on a mesh with a ``"stage"`` axis, and gradient
    accumulation's otherwise.

    Args:
      config: what to build.
      mesh: the devices and their axes.
      params: the initial parameters, boxed with their logical names as :func:`init_params` returns them (its by
        default); a caller that builds states on several meshes initialises once.
      pipeline: on a mesh with a ``"stage"`` axis, the schedule (e.g. ``remat=False``); default
        ``config.schedule`` (GPipe with remat), ``config.microbatches`` micro-batches and ``config.repeats`` repeats.

    Raises:
      ValueError: for ``config.repeats`` other than 1, a ``config.schedule`` other than GPipe, or a ``pipeline``,
        without a ``"stage"`` axis (a pipeline's settings).
    """
    pipelined = PIPELINE_AXIS in mesh.axis_names
    if config.repeats != 1 and not pipelined:
        raise ValueError(f"--repeats {config.repeats}: repeats are a pipeline's, and the mesh has no 'stage' axis")
    if config.schedule != "gpipe" and not pipelined:
        raise ValueError(f"--schedule {config.schedule}: schedules are a pipeline's, and the mesh has no 'stage' axis")
    if pipeline is not None and not pipelined:
        raise ValueError(f"{pipeline}: the mesh has no 'stage' axis to pipeline over")
    model = make_model(config)
    params = init_params(config) if params is None else params
    if pipelined and pipeline is None:
        pipeline = sc.Pipeline(config.microbatches, PIPELINE_AXIS, config.repeats, schedule=config.schedule)
    state = sc.TrainState.create(
        params=params,
        tx=make_optimizer(config),
        apply_fn=model.apply,
        rng=config.seed,
        mesh=mesh,
        axis=data_axes(mesh.axis_names),
        strategy=config.strategy,
        logical_axis_rules=logical_axis_rules(mesh.axis_names),
        pipeline=pipeline,
        context=sc.ContextParallel(CONTEXT_AXIS) if CONTEXT_AXIS in mesh.axis_names else None,
    )
    return state, sc.make_train_step(make_loss_fn(), accum_steps=1 if pipelined else config.microbatches)


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains and evaluates as ``config`` says; returns the summary: one row per validation loss computed by this
    call, the final validation bits per byte and the unigram baseline's, steps and seconds."""
    mesh = sc.make_mesh(parse_mesh(config.mesh))
    _check_batch(config, mesh)
    state, step = build_state(config, mesh)
    eval_step = sc.make_eval_step(make_metric_fn())
    corpus = input_pipeline.load_corpus(config.corpus_bytes)
    train_data, val = datasets(config, corpus)
    unigram = input_pipeline.unigram_bits_per_byte(corpus.train, input_pipeline.real_targets(val))
    n_proc = sc.process_count()
    local_batch = config.batch_size // n_proc
    shard = dict(shard_index=sc.process_index(), num_shards=n_proc)
    sampler = sc.ShardedSampler(len(train_data["inputs"]), **shard, seed=config.seed, drop_remainder=True)
    val_sampler = sc.ShardedSampler(len(val["inputs"]), **shard, shuffle=False)
    start = (sc.latest_checkpoint_step(config.checkpoint_dir) if config.checkpoint_dir else None) or 0
    params, active = count_parameters(config)
    say(
        f"corpus: {len(corpus.train_files)} files ({corpus.train.size / 1e6:.1f} MB) for training, "
        f"{len(corpus.val_files)} ({corpus.val.size / 1e6:.1f} MB) for validation, {len(val['inputs'])} validation "
        f"{'rows of documents' if config.packed else 'windows'}; "
        f"unigram baseline {unigram:.3f} bits/byte"
    )
    say(
        f"model: {params / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token), {config.layers} layers of "
        f"width {config.width}{f', {config.experts} experts, top-{config.top_k}' if config.experts else ''}; mesh "
        f"{dict(mesh.shape)}, {state.strategy} over {state.axis}, global batch {config.batch_size} x "
        f"{config.seq_len} bytes"
    )
    if start:
        say(f"resuming from {config.checkpoint_dir} at step {start}, restart {sc.restart_count()}")

    def validation(state: sc.TrainState) -> dict[str, float]:
        metrics = sc.evaluate(eval_step, state, sc.take_batches(val, val_sampler.batches(local_batch)))
        return {"val/loss": metrics["loss"], "val/accuracy": metrics["accuracy"]}

    rows = EvalRows(unigram, start=start)
    per_epoch = sampler.num_batches(local_batch)
    epochs = math.ceil(config.steps / per_epoch)
    loader = sc.Loader(
        train_data,
        sampler,
        batch_size=local_batch,
        epochs=epochs,
        mesh=state.mesh,
        axis=state.roles.batch,
    )
    checkpoints = {}
    if config.checkpoint_dir:
        checkpoints = {"checkpoint_dir": config.checkpoint_dir, "save_every": config.save_every, "max_to_keep": 2}
    last = config.steps if config.max_steps is None else min(config.steps, config.max_steps)
    began = time.perf_counter()
    state, _ = sc.fit(
        step,
        state,
        loader,
        max_steps=last,
        hooks=[sc.Hook(lambda state, *, step, epoch: validation(state), every_steps=config.eval_every)],
        callback=rows.add,
        **checkpoints,
    )
    seconds = time.perf_counter() - began
    final_step = int(jax.device_get(state.step))
    if not rows.rows or rows.rows[-1]["step"] != final_step:  # the last step was not an evaluation's
        rows.add_evaluation(final_step, validation(state))
    final = rows.rows[-1]
    say(
        f"step {final_step}: validation {final['val_bits_per_byte']:.3f} bits/byte against the unigram baseline's "
        f"{unigram:.3f}, {seconds:.0f} s for {final_step - start} steps"
    )
    return {
        "mesh": dict(mesh.shape),
        "strategy": config.strategy,
        "processes": n_proc,
        "devices": sc.device_count(),
        "platform": jax.devices()[0].platform,
        "parameters": params,
        "active_parameters": active,
        "experts": config.experts,
        "global_batch": config.batch_size,
        "seq_len": config.seq_len,
        "restarts": sc.restart_count(),
        "resumed_from": start,
        "step": final_step,
        "seconds": seconds,
        "train_seconds": rows.train_seconds,
        "evaluations": rows.rows,
        "losses": rows.losses,
        "tokens": rows.tokens,
        "val_bits_per_byte": final["val_bits_per_byte"],
        "unigram_bits_per_byte": unigram,
    }


class EvalRows:
    """``fit``'s callback: one row per validation loss (the hook's metrics arrive with their step's), holding the
    mean training loss of the steps since the previous one; printed on the main process."""

    def __init__(self, unigram: float, *, start: int):
        self.unigram = unigram
        self.start = start  # the global step this call of fit starts from
        self.rows: list[dict[str, Any]] = []
        self.train_seconds = 0.0  # the steps' wall time, evaluations left out
        self.losses: list[float] = []  # every step's training loss (nats per real byte)
        self.tokens = 0  # the real target bytes trained on
        self._losses: list[float] = []

    def add(self, i: int, metrics: dict[str, float]) -> None:
        self._losses.append(metrics["loss"])
        self.losses.append(metrics["loss"])
        self.tokens += round(metrics["tokens"])
        self.train_seconds += sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/hooks")
        if "val/loss" in metrics:
            self.add_evaluation(self.start + i + 1, metrics)

    def add_evaluation(self, step: int, metrics: dict[str, float]) -> None:
        losses, self._losses = self._losses, []
        row = {
            "step": step,
            "train_bits_per_byte": bits(float(np.mean(losses))) if losses else None,
            "val_bits_per_byte": bits(metrics["val/loss"]),
            "val_accuracy": metrics["val/accuracy"],
            "unigram_bits_per_byte": self.unigram,
            "train_seconds": self.train_seconds,
        }
        self.rows.append(row)
        train = "" if row["train_bits_per_byte"] is None else f"train {row['train_bits_per_byte']:.3f}, "
        say(
            f"step {step}: {train}validation {row['val_bits_per_byte']:.3f} bits/byte (unigram "
            f"{self.unigram:.3f}), next-byte accuracy {100 * row['val_accuracy']:.1f}%, {self.train_seconds:.0f} s"
        )


def say(line: str) -> None:
    """Prints on the main process."""
    if sc.is_main_process():
        print(line, flush=True)


def _check_batch(config: Config, mesh: Mesh) -> None:
    """The global batch must split over the processes and the data axes (and the expert and stage axes), and each
    data replica's rows into the micro-batches (a pipeline's, or accumulation's per device)."""
    names = data_axes(mesh.axis_names)
    data = math.prod(mesh.shape[a] for a in (names if isinstance(names, tuple) else (names,)))
    data *= mesh.shape.get(EXPERT_AXIS, 1)  # the batch is split over the expert axis too
    stages = mesh.shape.get(PIPELINE_AXIS, 1)
    per_device = 1 if PIPELINE_AXIS in mesh.axis_names else data
    need = math.lcm(data * stages, per_device * config.microbatches, data * config.microbatches)
    if config.batch_size % need or config.batch_size % sc.process_count():
        raise ValueError(
            f"--batch-size {config.batch_size} must be a multiple of {need}: the {data} data devices x {stages} "
            f"stage(s), and {config.microbatches} micro-batches per data replica (and of the {sc.process_count()} "
            "processes)"
        )
