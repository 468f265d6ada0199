"""The time a training step loses to a checkpoint save, synchronous against asynchronous, and the host memory the
asynchronous save costs.

A ``TrainState`` of ``--mb`` MB of float32 parameters in ``--leaves`` leaves, with Adam (so about 3x that in all:
parameters, mu and nu), on ``--devices`` fake CPU devices under DDP. Its train step reads every parameter and writes
the whole state (a loss linear in the parameters, Adam's update): memory-bound, as a large model's optimizer update
is. Each run trains ``--saves`` x ``--every`` steps and saves every ``--every`` steps, as ``sc.fit`` does (the loop
waits for the step's result before the save, then goes on), in one of three modes:

- ``none``: no save (the reference);
- ``sync``: ``sc.save_checkpoint(...)``: returns once the checkpoint is complete;
- ``async``: ``sc.save_checkpoint(..., asynchronous=True)``: returns once the state is referenced (on CPU) or
  copied (on GPU) to host memory; orbax writes it in the background while the next steps run.

Reported per mode (medians over ``--rounds`` interleaved rounds, each run a fresh process so that its memory is
its own): the seconds the loop spent inside ``save_checkpoint`` per save (``blocking_s``; for async it includes
waiting for the previous save), the loop's wall time, ``lost_per_save_s`` = (loop time - the ``none`` loop time) /
saves (what a save costs the training, the background writing's competition for the cores included), and
``extra_rss_mb``: the peak resident memory during the loop above the memory before it, sampled every 5 ms. The last
asynchronous save's remaining write is timed apart (``final_wait_s``): ``sc.fit`` waits for it before returning.

    python benchmarks/checkpoint.py [--mb 100] [--leaves 8] [--every 8] [--saves 4] [--rounds 3] [--dir DIR]
                                    [--json out.json] [--smoke]

``--dir`` is where the checkpoints go (default: a temporary directory beside the working directory, on its disk:
not /dev/shm). ``--smoke`` runs a 4 MB state for 2 saves once: it only checks that everything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import run_facts, set_cpu_devices, write_json

MODES = ("none", "sync", "async")


def main() -> None:
    args = _parser().parse_args()
    if args.run is not None:
        print(json.dumps(_run(args)), flush=True)
        return
    if args.smoke:
        args.mb, args.saves, args.every, args.rounds = 4, 2, 2, 1
    base = Path(args.dir or tempfile.mkdtemp(prefix="spmdcomm-ckpt-bench-", dir=os.getcwd()))
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for r in range(args.rounds):  # interleaved: every round runs every mode once
            for mode in MODES:
                directory = base / f"{mode}-{r}"
                out = _child(args, mode, directory)
                runs[mode].append(out)
                print(f"round {r} {mode}: {json.dumps(out)}", flush=True)
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    result = {**_summary(args, runs), "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1), flush=True)
    write_json(args.json, result)


def _child(args: argparse.Namespace, mode: str, directory: Path) -> dict[str, Any]:
    """One run of ``mode`` in a process of its own; its JSON result (the last line it prints)."""
    cmd = [sys.executable, __file__, "--run", mode, "--dir", str(directory)]
    for name in ("mb", "leaves", "every", "saves", "devices"):
        cmd += [f"--{name}", str(getattr(args, name))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=Path(__file__).parent)
    if out.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The medians per mode, and the ratios the README quotes."""
    first = runs["none"][0]
    median = {
        mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "state_mb"} for mode, rs in runs.items()
    }
    for mode in ("sync", "async"):
        median[mode]["lost_per_save_s"] = (median[mode]["loop_s"] - median["none"]["loop_s"]) / args.saves
    sync, asyn = median["sync"], median["async"]
    return {
        **run_facts(),
        "devices": args.devices,  # this process did not start JAX with them; each run did
        "state_mb": first["state_mb"],
        "leaves": args.leaves,
        "every": args.every,
        "saves": args.saves,
        "rounds": args.rounds,
        "step_s": median["none"]["loop_s"] / (args.saves * args.every),
        "modes": median,
        "lost_sync_over_async": sync["lost_per_save_s"] / max(asyn["lost_per_save_s"], 1e-9),
        "blocking_sync_over_async": sync["blocking_s"] / max(asyn["blocking_s"], 1e-9),
        "async_extra_rss_over_state": asyn["extra_rss_mb"] / first["state_mb"],
        "sync_extra_rss_over_state": sync["extra_rss_mb"] / first["state_mb"],
    }


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """One mode's loop (in the child process)."""
    set_cpu_devices(args.devices)
    import jax
    import numpy as np
    import optax

    import spmdcomm as sc

    n = args.mb * 2**20 // 4 // args.leaves
    rng = np.random.default_rng(0)  # random bits: a checkpoint of constants would compress to nothing
    params = {f"w{i}": rng.standard_normal(n, np.float32) for i in range(args.leaves)}
    state = sc.TrainState.create(params=params, tx=optax.adam(1e-4), mesh=sc.data_mesh())
    state_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):  # gradient = params: Adam's moments random too
        return sc.masked_mean(sum(0.5 * (p * p).sum() for p in jax.tree.leaves(params)) * batch, mask)

    step = sc.make_train_step(loss_fn)
    batch = np.ones(jax.device_count(), np.float32)
    for _ in range(2):  # compile and warm up
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    if args.run != "none":  # the first save of a process sets orbax up: not the steady state this measures
        warm = sc.save_checkpoint(os.path.join(args.dir, "warm"), state, asynchronous=args.run == "async")
        if args.run == "async":
            warm.wait()
    sampler = _PeakRss()
    blocking, loop_start = 0.0, time.perf_counter()
    with sampler:
        for i in range(1, args.saves * args.every + 1):
            state, metrics = step(state, batch)
            if i % args.every == 0:
                jax.block_until_ready(metrics)  # as fit does: the saved state is complete
                start = time.perf_counter()
                if args.run == "sync":
                    sc.save_checkpoint(args.dir, state, step=i)
                elif args.run == "async":
                    sc.save_checkpoint(args.dir, state, step=i, asynchronous=True)
                blocking += time.perf_counter() - start
            elif i % 4 == 0:
                jax.block_until_ready(metrics)  # a bounded number of steps in flight
        jax.block_until_ready(state)
        loop_s = time.perf_counter() - loop_start
        start = time.perf_counter()
        if args.run == "async":
            sc.checkpoint._async.wait_for_save_in_flight()
        final_wait_s = time.perf_counter() - start
    if args.run != "none":
        restored = sc.restore_checkpoint(args.dir, state)
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True))
        assert same, "the last checkpoint differs from the state it saved"
    return {
        "state_mb": state_mb,
        "blocking_s": blocking / args.saves,
        "loop_s": loop_s,
        "final_wait_s": final_wait_s,
        "extra_rss_mb": sampler.peak_mb - sampler.start_mb,
    }


class _PeakRss:
    """The process's peak resident memory while the block runs, sampled every 5 ms by a thread (Linux)."""

    def __enter__(self) -> _PeakRss:
        self.start_mb = self.peak_mb = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_mb = max(self.peak_mb, _rss_mb())


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=100, help="MB of float32 parameters (the state is about 3x with Adam)")
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--every", type=int, default=8, help="steps between saves")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory in the working directory)")
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)  # one mode's loop, in a child process
    return p


if __name__ == "__main__":
    main()
