"""A byte-level transformer language model trained with spmdcomm on the Python standard library's own source.

    python examples/lm/main.py --devices 8                                     # DDP over 8 fake CPU devices
    python examples/lm/main.py --devices 8 --mesh data=4,model=2               # heads and MLP split over model
    python examples/lm/main.py --devices 8 --mesh replica=2,shard=4 --strategy fsdp    # hybrid sharding
    python examples/lm/main.py --devices 8 --packed --mesh data=2,context=4    # documents of different lengths
    python examples/lm/main.py --devices 8 --checkpoint-dir ckpt --max-steps 200       # stop; run again to resume
    python examples/lm/main.py --devices 8 --experts 8 --top-k 2 --mesh data=2,expert=4       # mixture of experts
    python examples/lm/main.py --devices 8 --experts 8 --mesh data=2,stage=2,expert=2 --microbatches 2 --schedule zb-h1

The corpus is this Python's standard library (no download). Every evaluation prints validation bits per byte next
to the unigram baseline's; the last line printed is the JSON summary (also written to --json). The training logic
is in train.py, the model in models.py, the data in input_pipeline.py.
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
    p.add_argument(
        "--mesh",
        help="mesh axes and sizes, e.g. data=4,model=2, replica=2,shard=4, data=2,stage=2,model=2, "
        "data=2,context=4 or data=2,expert=4 (default data=-1)",
    )
    p.add_argument("--strategy", choices=["ddp", "zero1", "zero2", "fsdp"], help="over the data axes")
    p.add_argument("--microbatches", type=int, help="a pipeline's micro-batches (else gradient accumulation's)")
    p.add_argument("--packed", action="store_true", help="rows of documents of different lengths, padded at the end")
    p.add_argument("--attention", choices=["ring", "all_to_all"], help="context parallelism's algorithm")
    p.add_argument("--repeats", type=int, help="a pipeline's layer groups per stage (needs a stage axis)")
    p.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zb-h1"],
        help="a pipeline's schedule (needs a stage axis; default gpipe)",
    )
    p.add_argument("--experts", type=int, help="a mixture of this many experts in every block (0: dense MLPs)")
    p.add_argument("--top-k", type=int, help="experts per token")
    p.add_argument("--mlp-ratio", type=int, help="an MLP's (or expert's) hidden units per unit of width")
    p.add_argument("--width", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq-len", type=int, help="bytes of context")
    p.add_argument("--batch-size", type=int, help="global windows per step (a multiple of the data devices)")
    p.add_argument("--steps", type=int, help="the learning-rate schedule's length and the run's")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate after the warm-up")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--weight-decay", type=float, help="on kernels only")
    p.add_argument("--corpus-bytes", type=int, help="bytes of the standard library's source to read")
    p.add_argument("--eval-windows", type=int, help="validation windows")
    p.add_argument("--eval-every", type=int, help="steps between validation losses")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="of the computation; parameters stay float32")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-steps", type=int, help="stop the run at this step (saved with --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; a run started again resumes from the latest")
    p.add_argument("--save-every", type=int, help="steps between checkpoints")
    p.add_argument("--devices", type=int, help="fake CPU devices per process (CPU only)")
    p.add_argument("--json", help="write the summary to this file")
    return p


if __name__ == "__main__":
    main()
