"""A small ResNet with synchronised BatchNorm, trained data-parallel with spmdcomm on generated shape images.

    python examples/resnet/main.py --devices 4                                   # one process, 4 fake CPU devices
    python examples/resnet/main.py --devices 4 --half-precision                  # float16, dynamic loss scaling
    spmdcomm-launch -n 2 --devices-per-process 2 examples/resnet/main.py --checkpoint-dir ckpt

The data is generated from the seed (no download). The last line printed is the JSON summary (also written to
--json). The training logic is in train.py, the model in models.py, the data in input_pipeline.py.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    args = vars(_parser().parse_args(argv))
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
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="global batch over all devices (a multiple of the device count)")
    p.add_argument("--lr", type=float, help="peak SGD learning rate after the warm-up, cosine decay to 0")
    p.add_argument("--warmup-epochs", type=float)
    p.add_argument("--weight-decay", type=float, help="on convolution and dense kernels only")
    p.add_argument("--half-precision", action="store_true", help="compute in float16 with dynamic loss scaling")
    p.add_argument("--widths", type=_widths, help="channels of each stage, comma-separated (default 16,32,64)")
    p.add_argument("--strategy", choices=["ddp", "zero1", "zero2", "fsdp"])
    p.add_argument("--train-size", type=int)
    p.add_argument("--test-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-steps", type=int, help="stop the run at this step (saved with --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; a run started again resumes from the latest")
    p.add_argument("--save-every", type=int, help="steps between checkpoints")
    p.add_argument("--devices", type=int, help="fake CPU devices per process (CPU only)")
    p.add_argument("--json", help="write the summary to this file")
    return p


def _widths(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in text.split(","))


if __name__ == "__main__":
    main()
