"""Host-to-device prefetch: steps/s with no prefetch, flax's prefetch_to_device, and spmdcomm's.

Part 1 (loader vs step): a loader takes L ms per batch and a jit step takes S ms; for L/S in {0, 0.5, 1, 2}
it reports steps/s for each mode, once with an I/O-like loader (it sleeps, as waiting on storage does)
and once with a CPU-bound loader (NumPy work holding a core). "vs zero-cost" divides by the same mode's
steps/s with L = 0.

Part 2 (hidden transfer): a 16 MiB batch and a ~2 ms step, zero-cost loader. hidden = (T_sync - T_mode) /
(T_sync - T_preplaced): the fraction of the host-to-device time that the mode takes off the step, where
T_sync is synchronous device_put of a plain NumPy batch. Two loaders: a plain NumPy array (16 bytes past a
64-byte boundary, as NumPy's large arrays usually are) and one from spmdcomm.data.aligned_empty, which CPU
devices alias without a copy, for synchronous device_put ("none aligned") as much as for prefetch.
``Bench.hidden_transfer`` takes other batch sizes and a step timed against the copy (benchmarks/gpu.py runs it at
16, 64 and 256 MiB), and "ours pageable": ours with the staging through pinned host memory switched off.

Plain loaders' batches are 16 mod 64 in both parts so that runs do not depend on where malloc put them.

Variants are interleaved (every repetition runs every mode once) and medians are reported. Every loop
waits on the step from two steps earlier, so at most two steps are in flight.

    python benchmarks/prefetch.py [--devices 2] [--reps 5] [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import set_cpu_devices, write_json

set_cpu_devices(2)  # before JAX starts

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import jax_utils  # noqa: E402

import spmdcomm as sc  # noqa: E402
from spmdcomm.data import prefetch_threads  # noqa: E402


def main() -> None:
    args = _parser().parse_args()
    bench = Bench(args)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpus": os.cpu_count(),
        "reps": args.reps,
        "steps": args.steps,
        "loader_vs_step": bench.loader_vs_step(),
        "hidden_transfer": bench.hidden_transfer(),
    }
    write_json(args.json, results)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="fake CPU devices (ignored on GPU)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per variant")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--step-ms", type=float, default=4.0, help="S for part 1")
    p.add_argument("--json", help="write the results to this file")
    return p


MODES = ("none", "flax", "ours")


class Bench:
    """The measurements, on every device (``sc.data_sharding()``); ``args`` has ``steps``, ``reps`` and ``step_ms``."""

    def __init__(self, args):
        self.args = args
        self.sharding = sc.data_sharding()
        self.ndev = jax.device_count()

    # ---- part 1 -----------------------------------------------------------------------------------------

    def loader_vs_step(self) -> dict:
        s_ms = self.args.step_ms
        host = _unaligned(np.random.default_rng(0).normal(size=(256, 1024)).astype(np.float32))  # 1 MiB
        step = self._calibrated_step(host, s_ms)
        burn = _calibrate_cpu_work()
        out = {"batch_mib": host.nbytes / 2**20, "step_ms": self._measure_step(step, host) * 1e3}
        print(
            f"\n== loader vs step: batch {out['batch_mib']:.0f} MiB, S = {out['step_ms']:.1f} ms "
            f"(target {s_ms}), {self.ndev} devices =="
        )
        for kind in ("io", "cpu"):
            rows = {}
            for ratio in (0, 0.5, 1, 2):
                loader = _loader(kind, host, ratio * s_ms / 1e3, burn)
                times = self._interleaved({m: (lambda m=m, ld=loader: self._run(m, ld, step)) for m in MODES})
                rows[ratio] = {m: 1.0 / statistics.median(t) for m, t in times.items()}
            for row in rows.values():
                row.update({f"{m}_vs_zero_cost": row[m] / rows[0][m] for m in MODES})
            out[kind] = rows
            print(f"-- {'I/O-like' if kind == 'io' else 'CPU-bound'} loader: steps/s (x of the same mode at L=0)")
            print(f"{'L/S':>5} " + " ".join(f"{m:>16}" for m in MODES))
            for ratio, row in rows.items():
                print(f"{ratio:>5} " + " ".join(f"{row[m]:8.1f} ({row[m + '_vs_zero_cost']:.2f}x)" for m in MODES))
        return out

    # ---- part 2 -----------------------------------------------------------------------------------------

    def hidden_transfer(
        self,
        mib: int = 16,
        step_ms: float = 2.0,
        *,
        step_vs_copy: float | None = None,
        aligned: bool = True,
        pageable: bool = False,
    ) -> dict:
        """ms per step and the fraction hidden of a ``mib`` MiB batch's copy, for each mode (module docstring).

        The step takes ``step_ms``, or ``step_vs_copy`` times the copy (a synchronous ``device_put`` of the plain
        batch, waited for) when given. ``aligned`` adds the loaders of aligned batches, ``pageable`` the mode
        "ours pageable" (no staging through pinned host memory).
        """
        rows = mib * 256  # of 1024 float32
        host = _unaligned(np.random.default_rng(1).normal(size=(rows, 1024)).astype(np.float32))
        copy_ms = self._measure_copy(host) * 1e3
        step = self._calibrated_step(host, step_ms if step_vs_copy is None else step_vs_copy * copy_ms)
        plain_loader = _loader("io", host, 0.0, None)
        modes = [*MODES, "ours pageable"] if pageable else MODES
        variants = {m: (lambda m=m: self._run(m, plain_loader, step)) for m in modes}
        if aligned:
            copy = sc.data.aligned_empty(host.shape, host.dtype)
            copy[...] = host
            aligned_loader = _loader("io", copy, 0.0, None)
            variants.update(
                {f"{m} aligned": (lambda m=m: self._run(m, aligned_loader, step)) for m in ("none", "ours")}
            )
        placed = jax.device_put(host, self.sharding)
        variants["preplaced"] = lambda: self._run("preplaced", lambda: placed, step)
        times = {m: statistics.median(t) for m, t in self._interleaved(variants).items()}
        span = times["none"] - times["preplaced"]
        hidden = {
            m: (times["none"] - t) / span if span > 0 else float("nan")
            for m, t in times.items()
            if m not in ("none", "preplaced")
        }
        out = {
            "batch_mib": host.nbytes / 2**20,
            "step_ms": self._measure_step(step, host) * 1e3,
            "copy_ms": copy_ms,
            "pinned_host": prefetch_threads.pinned_sharding(self.sharding) is not None,
            "plain_mod_64": host.ctypes.data % 64,
            "ms_per_step": {m: t * 1e3 for m, t in times.items()},
            "hidden": hidden,
        }
        print(
            f"\n== hidden transfer: {out['batch_mib']:.0f} MiB batch, step {out['step_ms']:.1f} ms, copy "
            f"{copy_ms:.1f} ms; plain batch at 64n+{out['plain_mod_64']}, aligned batch at 64n; hidden vs "
            "synchronous device_put of the plain batch =="
        )
        for m, t in out["ms_per_step"].items():
            extra = f"   hidden = {hidden[m]:.2f}" if m in hidden else ""
            print(f"{m:>13}: {t:7.2f} ms/step{extra}")
        return out

    # ---- loops ------------------------------------------------------------------------------------------

    def _run(self, mode: str, loader, step) -> float:
        """Seconds per step of one timed run (after 3 warm-up steps)."""
        n = self.args.steps + 3
        source = (loader() for _ in range(n))
        if mode == "preplaced":
            batches = source
        elif mode == "none":
            batches = (jax.device_put(b, self.sharding) for b in source)
        elif mode == "flax":
            batches = jax_utils.prefetch_to_device((b.reshape(self.ndev, -1, *b.shape[1:]) for b in source), 2)
        else:  # "ours" or "ours pageable": the switch is read when the prefetcher is made
            pinned, prefetch_threads.PINNED_HOST = prefetch_threads.PINNED_HOST, mode == "ours"
            try:
                batches = sc.prefetch_to_device(source, 2)
            finally:
                prefetch_threads.PINNED_HOST = pinned
        pending = []
        for i, b in enumerate(batches):
            if i == 3:
                jax.block_until_ready(pending)
                start = time.perf_counter()
            pending.append(step(b))
            if len(pending) > 2:
                pending.pop(0).block_until_ready()
        jax.block_until_ready(pending)
        if mode.startswith("ours"):
            batches.close()
        return (time.perf_counter() - start) / self.args.steps

    def _interleaved(self, variants: dict) -> dict[str, list[float]]:
        for run in variants.values():  # compile and warm every variant first
            run()
        times: dict[str, list[float]] = {m: [] for m in variants}
        for _ in range(self.args.reps):
            for m, run in variants.items():
                times[m].append(run())
        return times

    def _calibrated_step(self, host, target_ms: float):
        jnp = jax.numpy
        w = jnp.full((64, 64), 1.0 / 64, jnp.float32)

        def make(k):
            # A loop XLA keeps as a loop: unrolled in Python, the thousands of layers a fast device (an H100)
            # needs for a 4 ms step took minutes to compile.
            @jax.jit
            def step(x):
                h = x.reshape(-1, x.shape[-1])[:, :64]
                return jax.lax.fori_loop(0, k, lambda _, h: jnp.tanh(h @ w), h).sum()

            return step

        k = 1
        while True:
            step = make(k)
            t = self._measure_step(step, host)
            if t * 1e3 >= target_ms or k >= 4096:
                return make(max(1, round(k * target_ms / 1e3 / t)))
            k *= 4

    def _measure_copy(self, host) -> float:
        """Median seconds of a synchronous ``device_put`` of ``host``, waited for."""
        jax.device_put(host, self.sharding).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            jax.device_put(host, self.sharding).block_until_ready()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    def _measure_step(self, step, host) -> float:
        x = jax.device_put(host, self.sharding)
        step(x).block_until_ready()
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            step(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)


def _loader(kind: str, host, seconds: float, burn):
    """A zero-argument function returning a host batch after ``seconds`` of waiting or CPU work."""
    if seconds <= 0:
        return lambda: host
    if kind == "io":

        def io():
            time.sleep(seconds)
            return host

        return io

    def cpu():
        burn(seconds)
        return host

    return cpu


def _unaligned(a):
    """A copy of ``a`` whose data starts 16 bytes past a 64-byte boundary."""
    raw = sc.data.aligned_empty(a.nbytes + 16, "uint8")
    out = raw[16 : 16 + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _calibrate_cpu_work():
    """``burn(seconds)``: NumPy work (like decoding or augmenting) that keeps one core busy that long."""
    scratch = np.random.default_rng(0).normal(size=64 * 1024).astype(np.float32)

    def chunk():
        np.sin(scratch, out=scratch)
        np.add(scratch, 1.0, out=scratch)

    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        chunk()
        reps += 1
    per = (time.perf_counter() - start) / reps

    def burn(seconds):
        for _ in range(max(1, round(seconds / per))):
            chunk()

    return burn


if __name__ == "__main__":
    main()
