"""Data-parallel MNIST with spmdcomm: a Flax CNN trained DDP-style on every device of every process.

One process with 8 fake CPU devices, or 2 processes through the launcher: the same code.

    python examples/mnist_data_parallel.py --devices 8
    spmdcomm-launch -n 2 --devices-per-process 2 examples/mnist_data_parallel.py

Without MNIST on disk (``--data-dir``, or ``--download``) it trains on scikit-learn's bundled digits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("--dataset", choices=["auto", "mnist", "digits"], default="auto")
_parser.add_argument("--data-dir", help="folder with the four MNIST IDX files (default: a cache folder)")
_parser.add_argument("--download", action="store_true", help="fetch MNIST if it is not there")
_parser.add_argument("--epochs", type=int, default=3)
_parser.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="global batch size, all devices (default: 128 for MNIST, 32 for the small digits set)",
)
_parser.add_argument("--lr", type=float, default=2e-3, help="peak Adam learning rate (cosine decay to 0)")
_parser.add_argument("--devices", type=int, default=None, help="fake CPU devices per process (CPU only)")
_parser.add_argument("--backend", choices=["shard_map", "pmap"], default="shard_map")
_parser.add_argument("--accum-steps", type=int, default=1)
_parser.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1: split the Adam state over devices")
_parser.add_argument("--seed", type=int, default=0)
_parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
_parser.add_argument("--checkpoint-dir", help="save a checkpoint after every epoch here; resume from the latest")
_parser.add_argument("--json", help="write the summary to this file")
_parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> dict:
    args = _parser.parse_args(argv)
    if args.devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import spmdcomm as sc

    sc.initialize()  # a no-op for one process; joins the job under spmdcomm-launch, SLURM, Kubernetes...
    import jax
    import numpy as np
    import optax
    from tqdm import tqdm

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mnist_data
    from mnist_model import CNN, make_loss_fn, make_metric_fn

    main_proc = sc.is_main_process()
    with sc.main_process_first():  # process 0 downloads/decompresses first; the others then read its files
        ds = mnist_data.load_dataset(args.dataset, args.data_dir, download=args.download)
    n_dev, n_proc = sc.device_count(), sc.process_count()
    if args.batch_size is None:
        args.batch_size = 128 if ds.name == "mnist" else 32  # digits has only 1,437 training images
    step_batch = args.batch_size // (n_dev * args.accum_steps) * n_dev * args.accum_steps
    if step_batch != args.batch_size and main_proc:
        print(f"batch size {args.batch_size} -> {step_batch}, a multiple of {n_dev} devices x {args.accum_steps}")
    local_batch = step_batch // n_proc

    model = CNN()
    params = model.init(jax.random.key(args.seed), np.zeros((1, 28, 28, 1), np.float32))["params"]
    total_steps = args.epochs * _steps_per_epoch(len(ds.train_labels), local_batch, n_proc, args)
    tx = optax.adam(optax.cosine_decay_schedule(args.lr, max(total_steps, 1)))  # decays to 0 by the last step
    state = sc.TrainState.create(
        params=params, tx=tx, apply_fn=model.apply, rng=args.seed, shard_optimizer=args.shard_optimizer
    )
    step = sc.make_train_step(
        make_loss_fn(), backend=args.backend, accum_steps=args.accum_steps, shard_optimizer=args.shard_optimizer
    )
    evaluate = sc.make_eval_step(make_metric_fn(), backend=args.backend)
    first_epoch = 0
    if args.checkpoint_dir and sc.latest_checkpoint_step(args.checkpoint_dir) is not None:
        state = sc.restore_checkpoint(args.checkpoint_dir, state)
        first_epoch = int(state.step) // _steps_per_epoch(len(ds.train_labels), local_batch, n_proc, args)
        if main_proc:
            print(f"resumed from {args.checkpoint_dir} at step {int(state.step)} (epoch {first_epoch})")

    train = {"image": ds.train_images, "label": ds.train_labels}
    test = {"image": ds.test_images, "label": ds.test_labels}
    sampler = sc.ShardedSampler(len(ds.train_labels), shard_index=sc.process_index(), num_shards=n_proc, seed=args.seed)
    test_sampler = sc.ShardedSampler(
        len(ds.test_labels), shard_index=sc.process_index(), num_shards=n_proc, shuffle=False
    )
    history = []
    if main_proc:
        print(
            f"{ds.name}: {len(ds.train_labels)} train / {len(ds.test_labels)} test images, {n_proc} process(es) "
            f"x {sc.local_device_count()} {jax.devices()[0].platform} device(s), global batch {step_batch}"
        )
    for epoch in range(first_epoch, args.epochs):
        index_batches = list(sampler.batches(local_batch, epoch=epoch))[: args.max_steps]
        bar = tqdm(
            total=len(index_batches),
            desc=f"epoch {epoch + 1}/{args.epochs}",
            unit="step",
            disable=args.no_progress or not main_proc,
            file=sys.stdout,
        )
        t0 = time.perf_counter()
        with sc.prefetch_to_device(sc.take_batches(train, index_batches)) as batches:
            state, steps = sc.fit(step, state, batches, callback=lambda i, m, bar=bar: bar.update(1))
            waited = batches.stats.total_wait
        seconds = time.perf_counter() - t0
        bar.close()
        examples = sum(m["examples"] for m in steps)
        train_loss = sum(m["loss"] * m["examples"] for m in steps) / examples
        test_metrics = _evaluate(evaluate, state, sc.take_batches(test, test_sampler.batches(local_batch)), sc)
        sc.barrier(f"end of epoch {epoch}")
        if args.checkpoint_dir:
            sc.save_checkpoint(args.checkpoint_dir, state)
        row = {
            "epoch": epoch + 1,
            "train_loss": train_loss,
            "test_loss": test_metrics["loss"],
            "test_accuracy": test_metrics["accuracy"],
            "samples_per_s": examples / seconds,
            "seconds": seconds,
            "data_wait_s": waited,
            "steps": len(steps),
        }
        history.append(row)
        if main_proc:
            print(
                f"epoch {epoch + 1}: train loss {train_loss:.4f}, test loss {test_metrics['loss']:.4f}, "
                f"test accuracy {100 * test_metrics['accuracy']:.2f}%, {row['samples_per_s']:.0f} samples/s, "
                f"waited {1e3 * waited:.0f} ms for data",
                flush=True,
            )
    summary = {
        "dataset": ds.name,
        "processes": n_proc,
        "devices": n_dev,
        "platform": jax.devices()[0].platform,
        "backend": args.backend,
        "global_batch": step_batch,
        "accum_steps": args.accum_steps,
        "shard_optimizer": args.shard_optimizer,
        "epochs": history,
        "final_test_accuracy": history[-1]["test_accuracy"] if history else None,
    }
    if main_proc:
        print(json.dumps(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def _evaluate(evaluate, state, batches, sc) -> dict[str, float]:
    """Exact test metrics: every batch's means weighted by its real-example count."""
    totals: dict[str, float] = {}
    count = 0.0
    for batch in batches:
        m = {k: float(v) for k, v in evaluate(state, batch).items()}
        count += m["examples"]
        for k, v in m.items():
            if k != "examples":
                totals[k] = totals.get(k, 0.0) + v * m["examples"]
    return {k: v / count for k, v in totals.items()}


def _steps_per_epoch(num_examples: int, local_batch: int, n_proc: int, args) -> int:
    full = -(-num_examples // (local_batch * n_proc))
    return min(full, args.max_steps) if args.max_steps else full


if __name__ == "__main__":
    main()
