"""The job of tests/test_watchdog.py's blame test and of ``benchmarks/watchdog_blame.py``: a small ``sc.fit`` run
with checkpoints and a watchdog in which one rank stalls, on each attempt of a job restarted by ``spmdcomm-launch
--max-restarts``.

Usage: python blame_job.py CKPT_DIR --plan KIND:RANK:STEP[,KIND:RANK:STEP...] [--timeout S]
                          [--interval S]

Attempt ``a`` (``sc.restart_count()``) runs the ``a``-th entry of ``--plan``: on rank RANK, the STEP-th step of the
attempt stalls forever, either in a ``jax.debug.callback`` inside the compiled step (``callback``) or in the data
source (``data``). Every process prints ``PLAN a KIND:RANK:STEP`` on stderr first. The watchdog (timeout
``--timeout``, default 4 s) must end the attempt, naming RANK.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import jax
import numpy as np
import optax

import spmdcomm as sc

EXAMPLES, FEATURES, GLOBAL_BATCH = 64, 8, 8


class Stall:
    """Where and when this process stalls on this attempt (``kind`` None: it does not)."""

    def __init__(self, kind: str | None, at: int):
        self.kind, self.at = kind, at
        self.calls, self.lock = 0, threading.Lock()

    def tick(self, _value: object) -> None:
        """The host callback of every step (on each local device): sleeps forever at the ``at``-th step."""
        with self.lock:
            self.calls += 1
            calls = self.calls
        if self.kind == "callback" and calls > self.at * jax.local_device_count():
            print(f"HANGING in a host callback at call {calls} at {time.time():.3f}", file=sys.stderr, flush=True)
            time.sleep(1e9)


class Data:
    """A resumable data source whose ``at``-th batch of this attempt never comes when ``stall.kind == "data"``."""

    def __init__(self, loader: sc.Loader, stall: Stall):
        self.loader, self.stall = loader, stall

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self):
        for handed, batch in enumerate(self.loader):
            if self.stall.kind == "data" and handed == self.stall.at:
                print(f"HANGING in the data source at {time.time():.3f}", file=sys.stderr, flush=True)
                time.sleep(1e9)
            yield batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--timeout", type=float, default=4.0)
    parser.add_argument("--interval", type=float)
    args = parser.parse_args()
    sc.initialize()
    attempt, me = sc.restart_count(), sc.process_index()
    plan = args.plan.split(",")
    kind, rank, at = plan[attempt % len(plan)].split(":")
    print(f"PLAN {attempt} {kind}:{rank}:{at}", file=sys.stderr, flush=True)
    stall = Stall(kind if int(rank) == me else None, int(at))

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        jax.debug.callback(stall.tick, batch["x"][0, 0])
        return sc.masked_mean(((batch["x"] @ params["w"]) - batch["y"]) ** 2, mask)

    mesh = sc.data_mesh()
    rng = np.random.default_rng(0)
    dataset = {
        "x": rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32),
        "y": rng.standard_normal(EXAMPLES).astype(np.float32),
    }
    sampler = sc.ShardedSampler(EXAMPLES, shard_index=me, num_shards=sc.process_count(), seed=3)
    loader = sc.Loader(dataset, sampler, batch_size=GLOBAL_BATCH // sc.process_count(), epochs=1000, mesh=mesh)
    state = sc.TrainState.create(params={"w": np.zeros(FEATURES, np.float32)}, tx=optax.sgd(0.01), mesh=mesh)
    options = {} if args.interval is None else {"watchdog_interval": args.interval}
    sc.fit(
        sc.make_train_step(loss_fn),
        state,
        Data(loader, stall),
        checkpoint_dir=args.ckpt_dir,
        save_every=4,
        watchdog_timeout=args.timeout,
        **options,
    )
    raise AssertionError("the watchdog did not end the job")


if __name__ == "__main__":
    main()
