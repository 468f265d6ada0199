"""Data-parallel MNIST with spmdcomm: a Flax CNN trained DDP-style on every device of every process.

    python examples/mnist/main.py --devices 2                           # one process, 2 fake CPU devices
    spmdcomm-launch -n 2 --devices-per-process 2 examples/mnist/main.py  # 2 processes, the same code
    spmdcomm-launch -n 2 --max-restarts 3 examples/mnist/main.py --checkpoint-dir ckpt  # restarted on failure

Without MNIST on disk (--data-dir, or --download) it trains on scikit-learn's bundled digits. With
--checkpoint-dir a killed or preempted run started again continues where its latest checkpoint was taken.
The last line printed is the JSON summary (also written to --json). The training logic is in train.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = vars(parser.parse_args(argv))
    if args.get("tensorboard_dir") and importlib.util.find_spec("tensorboardX") is None:
        parser.error("--tensorboard-dir needs tensorboardX: pip install 'spmdcomm[tensorboard]' (or tensorboardX)")
    devices, json_path = args.pop("devices", None), args.pop("json", None)
    if devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Before JAX starts; under spmdcomm-launch --devices-per-process the launcher has set it.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    import train  # imports JAX

    import spmdcomm as sc

    sc.initialize()  # a no-op for one process; joins the job under spmdcomm-launch, SLURM, Kubernetes...
    summary = train.train_and_evaluate(train.Config(**args))
    if sc.is_main_process():
        print(json.dumps(summary))
        if json_path:
            Path(json_path).write_text(json.dumps(summary, indent=1))
    return summary


def _parser() -> argparse.ArgumentParser:
    # Options left out keep train.Config's defaults, which say what they are.
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS
    )
    p.add_argument("--dataset", choices=["auto", "mnist", "digits"], help="auto (default): MNIST if found, else digits")
    p.add_argument("--data-dir", help="folder with the four MNIST IDX files (default: a cache folder)")
    p.add_argument("--download", action="store_true", help="fetch MNIST if it is not there")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="global batch over all devices")
    p.add_argument("--lr", type=float, help="peak Adam learning rate, cosine decay to 0")
    p.add_argument("--devices", type=int, help="fake CPU devices per process (CPU only)")
    p.add_argument("--accum-steps", type=int, help="micro-batches per step")
    p.add_argument(
        "--strategy",
        choices=["ddp", "zero1", "zero2", "fsdp"],
        help="ddp (default), zero1/zero2 (Adam state split), fsdp (all split)",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--max-steps", type=int, help="stop the run at this step (saved with --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; a run started again resumes from the latest")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (default 100), and at the end")
    p.add_argument("--watchdog-timeout", type=float, help="seconds: a longer step ends the job, naming who is stuck")
    p.add_argument("--metrics-log", help="JSON-lines file, one record per step; {process} for one per process")
    p.add_argument("--tensorboard-dir", help="TensorBoard scalars of the same records (needs tensorboardX)")
    p.add_argument("--json", help="write the summary to this file")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


if __name__ == "__main__":
    main()
