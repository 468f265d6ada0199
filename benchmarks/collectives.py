"""nccl-tests style collective benchmark: spmdcomm vs hand-written jax.lax, side by side in one run.

For each collective and message size, the variants run interleaved (A B A B ...) and the median time is
reported with algbw = S / t and busbw = algbw * factor (nccl-tests: all_reduce 2(n-1)/n with S the bytes per
device; all_gather and reduce_scatter (n-1)/n with S the full gathered size; all_to_all (n-1)/n; broadcast 1).
The machine's NumPy memcpy bandwidth is printed as the reference line. In-flight calls are bounded (XLA:CPU
deadlocks when too many collective executions are queued).

    python benchmarks/collectives.py --devices 8 --json results.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import set_cpu_devices, time_calls, write_json

set_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmdcomm as sc  # noqa: E402

_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("--devices", type=int, default=8, help="fake CPU devices when on CPU (default 8)")
_parser.add_argument("--backend", choices=["shard_map", "pmap"], default="shard_map")
_parser.add_argument("--min-bytes", type=int, default=1 << 10, help="smallest message (default 1 KiB)")
_parser.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default 64 MiB)")
_parser.add_argument("--step", type=int, default=4, help="size multiplier between rows (default 4)")
_parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,all_to_all,broadcast")
_parser.add_argument("--trials", type=int, default=7, help="interleaved trials per variant (median reported)")
_parser.add_argument("--target-seconds", type=float, default=0.05, help="time per trial and variant")
_parser.add_argument("--json", help="write the results to this JSON file")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser.parse_args(argv)
    devices = jax.devices()[: args.devices]
    n = len(devices)
    mesh = sc.data_mesh(devices=devices)
    memcpy = memcpy_gbps()
    print(
        f"# spmdcomm collectives benchmark: {n} x {devices[0].platform} devices, backend={args.backend}, "
        f"jax {jax.__version__}"
    )
    print(f"# NumPy memcpy reference: {memcpy:.2f} GB/s   (times are medians of {args.trials} interleaved trials)")
    rows = []
    for op in args.ops.split(","):
        print(f"\n## {op}")
        print(f"{'bytes':>10} {'variant':>16} {'time_us':>10} {'algbw':>8} {'busbw':>8} {'vs lax':>7}")
        size = args.min_bytes
        while size <= args.max_bytes:
            rows.extend(bench_size(op, size, n, mesh, args))
            size *= args.step
    result = {
        "devices": n,
        "platform": devices[0].platform,
        "backend": args.backend,
        "jax": jax.__version__,
        "memcpy_gbps": memcpy,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }
    write_json(args.json, result)
    return result


BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def variants(op: str, n: int) -> dict[str, Callable]:
    """name -> per-device function; names starting with "lax" are the hand-written baselines."""
    ring_free = {
        "all_reduce": {
            "lax": lambda x: lax.psum(x, "data"),
            "spmdcomm": lambda x: sc.psum(x, "data", algorithm="native"),
            "spmdcomm_rs_ag": lambda x: sc.psum(x, "data", algorithm="rs_ag"),
            "spmdcomm_auto": lambda x: sc.psum(x, "data", algorithm="auto"),
        },
        "all_gather": {
            "lax": lambda x: lax.all_gather(x, "data", tiled=True),
            "spmdcomm": lambda x: sc.all_gather(x, "data"),
        },
        "reduce_scatter": {
            "lax": lambda x: lax.psum_scatter(x, "data", tiled=True),
            "spmdcomm": lambda x: sc.reduce_scatter(x, "data"),
        },
        "all_to_all": {
            "lax": lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True),
            "spmdcomm": lambda x: sc.all_to_all(x, "data", split_dim=0, concat_dim=0),
        },
        "broadcast": {
            # jax.lax.pbroadcast has no CPU lowering. The hand-written baseline is the exact idiom spmdcomm uses
            # for small messages (one all-gather, keep the root's block; from BROADCAST_SPLIT_MIN_BYTES on it
            # switches to all-to-all + all-gather). "lax_bits_psum" and "lax_bits_rs_ag" are the exact idioms
            # spmdcomm used before (masked psum / reduce-scatter + all-gather of the bit pattern: not
            # differentiable); "lax_f32" is the common float idiom, which loses -0.0 and denormals.
            "lax": lambda x: lax.all_gather(x, "data", tiled=False)[0],
            "lax_bits_psum": lambda x: lax.bitcast_convert_type(
                lax.psum(
                    jnp.where(lax.axis_index("data") == 0, lax.bitcast_convert_type(x, jnp.uint32), 0),
                    "data",
                ),
                jnp.float32,
            ),
            "lax_bits_rs_ag": lambda x: lax.bitcast_convert_type(
                lax.all_gather(
                    lax.psum_scatter(
                        jnp.where(lax.axis_index("data") == 0, lax.bitcast_convert_type(x, jnp.uint32), 0),
                        "data",
                        tiled=True,
                    ),
                    "data",
                    tiled=True,
                ),
                jnp.float32,
            ),
            "lax_f32": lambda x: lax.psum(jnp.where(lax.axis_index("data") == 0, x, 0), "data"),
            "spmdcomm": lambda x: sc.broadcast(x, "data", root=0),
            "spmdcomm_split": lambda x: sc.collectives.rooted._broadcast_leaf(x, "data", 0, n, split=True),
        },
    }
    return ring_free[op]


def input_elems(op: str, size: int, n: int) -> int:
    """float32 elements per device for message size S (nccl-tests conventions)."""
    elems = max(size // 4, n)
    elems -= elems % n
    return elems // n if op == "all_gather" else elems


def bench_size(op: str, size: int, n: int, mesh, args) -> list[dict[str, Any]]:
    elems = input_elems(op, size, n)
    sharding = NamedSharding(mesh, P("data"))
    same_shape = op in ("all_reduce", "all_to_all", "broadcast")
    flat = lambda: jax.device_put(np.zeros((n * elems,), np.float32), sharding)  # noqa: E731 - zeros stay zeros
    stacked = lambda: jax.device_put(np.zeros((n, elems), np.float32), sharding)  # noqa: E731 - pmap layout
    donate = 0 if same_shape else ()
    fns = {}
    for name, body in variants(op, n).items():
        if not name.startswith("lax"):
            fns[name] = (
                sc.spmd(
                    body,
                    mesh=mesh,
                    in_specs=P("data"),
                    out_specs=P("data"),
                    backend=args.backend,
                    donate_argnums=donate,
                ),
                flat,
            )
        elif args.backend == "pmap":
            fns[name] = (
                jax.jit(jax.pmap(body, axis_name="data", devices=list(mesh.devices.flat)), donate_argnums=donate),
                stacked,
            )
        else:
            fns[name] = (
                jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")), donate_argnums=donate),
                flat,
            )

    # Warm up (compile) and pick an iteration count that fills the target time.
    for f, make in fns.values():
        jax.block_until_ready(f(make()))
    f, make = fns["lax"]
    x = make()
    jax.block_until_ready(x)
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    one = max(time.perf_counter() - t0, 1e-6)
    iters = int(min(200, max(2, args.target_seconds / one)))

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.trials):
        for name, (f, make) in fns.items():  # interleaved: A B C A B C ...
            times[name].append(_time(f, make, iters, same_shape) / iters)
    base = statistics.median(times["lax"])
    out = []
    for name in fns:
        t = statistics.median(times[name])
        algbw = size / t / 1e9
        row = {
            "op": op,
            "bytes": size,
            "variant": name,
            "time_us": t * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * BUS_FACTOR[op](n),
            "ratio_vs_lax": t / base,
        }
        out.append(row)
        print(
            f"{size:>10} {name:>16} {t * 1e6:>10.1f} {algbw:>8.2f} {row['busbw_gbps']:>8.2f} {t / base:>7.3f}",
            flush=True,
        )
    return out


def memcpy_gbps(nbytes: int = 64 << 20) -> float:
    """The best of 5 NumPy copies of ``nbytes``, in GB/s: the reference line."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _time(f, make, iters: int, same_shape: bool) -> float:
    """Seconds for ``iters`` calls of ``f``. Same-shape collectives donate their input, so each call's
    output (zeros) feeds the next one; the others take one fresh input every time."""
    x = make()
    jax.block_until_ready(x)
    if not same_shape:
        return time_calls(lambda: f(x), iters)
    chain = [x]

    def call():
        chain[0] = f(chain[0])
        return chain[0]

    return time_calls(call, iters, chained=True)


if __name__ == "__main__":
    main()
