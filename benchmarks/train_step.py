"""Samples/s of the DDP train step against hand-written and single-device baselines.

Run: ``python benchmarks/train_step.py [--rounds 21] [--steps 12] [--repeats 3] [--skip-multiprocess]
[--variants A,B]``.

One process with 2 fake CPU devices runs, interleaved round by round (medians reported): our step
(accumulation, bf16 reduction, flat buffer, buckets, ZeRO-1), a hand-written shard_map + pmean + optax
step on the same model, and the same model on a single device with the whole batch. There is no pmap
variant: the step's pmap backend was retired, and a hand-written ``jax.pmap`` step would time the
hand-written shard_map one again (since JAX 0.10 ``jax.pmap`` is ``jax.jit(jax.shard_map(...))``).
Models: MLP 784-512-512-10 and a small CNN on MNIST-shaped data, global batch 256, Adam. Then 2
processes x 1 device through the launcher (gloo), with the default leaf-by-leaf reduction and with one
flat buffer, and, where torch is importable, torch DDP with the same 2 workers (gloo on loopback, CPU,
same models, same global batch, Adam with the same hyper-parameters; one intra-op thread per worker, and
torch's default thread count). The multi-process settings run ``--repeats`` times in alternating order;
samples/s are medians over the repeats of each run's median over rounds. Every JAX loop keeps at most 8
steps in flight (``_common.time_calls``; our steps also bound themselves); torch runs each step
synchronously.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import jit_once, set_cpu_devices, step_caller, time_calls, write_json

set_cpu_devices(2)  # before JAX starts; the launched workers keep the launcher's 1 device each
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spmdcomm as sc  # noqa: E402
from spmdcomm.runtime import process as runtime  # noqa: E402

BATCH = 256
FLAT = sc.DDP(bucket_bytes=2**40)  # every gradient in one flat buffer


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


MODELS = {"mlp": MLP(), "cnn": CNN()}
# Each model's init compiled once, as one program: eagerly every initializer shape compiles its own, and a new
# jax.jit wrapper per call would compile the whole program again each time.
INITS = {name: jit_once(model.init) for name, model in MODELS.items()}


def data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((BATCH, 28, 28, 1)).astype(np.float32),
        "y": rng.integers(0, 10, BATCH).astype(np.int32),
    }


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["x"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)


def plain_loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def init_params(model_name: str) -> dict:
    variables = INITS[model_name](jax.random.PRNGKey(0), data()["x"][:2])
    return jax.tree.map(np.asarray, dict(variables["params"]))


# --- variants: each returns run(steps) -> seconds -------------------------------------------------


def ours(model_name: str, mesh, strategy: sc.train.Strategy | str = "ddp", **step_options):
    state = sc.TrainState.create(
        params=init_params(model_name),
        apply_fn=MODELS[model_name].apply,
        tx=optax.adam(1e-3),
        mesh=mesh,
        strategy=strategy,
    )
    step = sc.make_train_step(loss_fn, **step_options)
    batch = jax.tree.map(lambda x: jax.device_put(x, sc.data_sharding(mesh=mesh)), data())
    call = step_caller(step, state, batch)

    def run(steps: int) -> float:
        return time_calls(call, steps)

    run.state = call.state  # for optimizer-state bytes
    return run


def handwritten(model_name: str, mesh):
    """What a careful user writes by hand: shard_map, local grads (params cast to varying), pmean,
    optax."""
    apply_fn, tx = MODELS[model_name].apply, optax.adam(1e-3)

    def body(params, opt_state, batch):
        local = jax.lax.pcast(params, "data", to="varying")
        loss, grads = jax.value_and_grad(lambda p: plain_loss(apply_fn, p, batch))(local)
        loss, grads = jax.lax.pmean((loss, grads), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(sc.P(), sc.P(), sc.P("data")), out_specs=sc.P()),
        donate_argnums=(0, 1),
    )
    rep = sc.replicated_sharding(mesh=mesh)
    params = jax.device_put(init_params(model_name), rep)
    return _loop(
        step,
        params,
        jax.jit(tx.init, out_shardings=rep)(params),
        jax.tree.map(lambda x: jax.device_put(x, sc.data_sharding(mesh=mesh)), data()),
    )


def single_device(model_name: str):
    apply_fn, tx = MODELS[model_name].apply, optax.adam(1e-3)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: plain_loss(apply_fn, p, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    device = jax.devices()[0]
    params = jax.device_put(init_params(model_name), device)
    return _loop(
        jax.jit(step, donate_argnums=(0, 1)),
        params,
        tx.init(params),
        jax.device_put(data(), device),
    )


def _loop(step, params, opt_state, batch):
    holder = {"p": params, "o": opt_state}

    def call():
        holder["p"], holder["o"], loss = step(holder["p"], holder["o"], batch)
        return loss

    def run(steps: int) -> float:
        return time_calls(call, steps)

    return run


# --- driver ---------------------------------------------------------------------------------------


def in_process(rounds: int, steps: int, models: list[str], only: list[str] | None = None) -> dict[str, float]:
    """Samples/s of every variant (``only``: of the variants so named, without the model's prefix)."""
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    builders: dict[str, Callable[[], Any]] = {}
    for m in models:
        builders[f"{m}/single device"] = functools.partial(single_device, m)
        builders[f"{m}/hand-written shard_map"] = functools.partial(handwritten, m, mesh)
        builders[f"{m}/ours"] = functools.partial(ours, m, mesh)
        builders[f"{m}/ours flat buffer"] = functools.partial(ours, m, mesh, FLAT)
    m = "mlp"
    builders[f"{m}/ours accum_steps=4"] = functools.partial(ours, m, mesh, accum_steps=4)
    builders[f"{m}/ours bf16 reduce"] = functools.partial(ours, m, mesh, reduce_dtype=jnp.bfloat16)
    builders[f"{m}/ours buckets 256 KiB"] = functools.partial(ours, m, mesh, sc.DDP(bucket_bytes=256 * 1024))
    builders[f"{m}/ours ZeRO-1"] = functools.partial(ours, m, mesh, "zero1")
    known = {k.split("/", 1)[1] for k in builders}
    if only is not None and set(only) - known:
        raise SystemExit(f"--variants: unknown {sorted(set(only) - known)}; the in-process variants: {sorted(known)}")
    variants = {k: build() for k, build in builders.items() if only is None or k.split("/", 1)[1] in only}
    for run in variants.values():  # compile and warm up
        run(3)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(BATCH * steps / run(steps))
    results = {k: float(np.median(v)) for k, v in times.items()}
    # The machine is noisy: the median over rounds of the ratio within a round is the fairer ratio.
    for m in models:
        for base in ("hand-written shard_map", "single device"):
            for name in ("ours", "ours flat buffer"):
                if f"{m}/{name}" not in times or f"{m}/{base}" not in times:
                    continue
                ratio = np.array(times[f"{m}/{name}"]) / np.array(times[f"{m}/{base}"])
                results[f"{m}/ratio {name} / {base} (paired median)"] = float(np.median(ratio))
    for name in ("mlp/ours", "mlp/ours ZeRO-1"):
        if name in variants:
            results[f"{name} optimizer-state bytes/device"] = sc.optimizer_state_bytes(variants[name].state())
    return results


def multi_process(steps: int, rounds: int, repeats: int) -> dict[str, float]:
    """2 processes x 1 device through the launcher: our step in several settings and, where torch is
    importable, torch DDP; samples/s from process 0, median over ``repeats`` alternating runs."""
    settings = {
        "mlp/2 processes x 1 device, ours": ["--model", "mlp"],
        "mlp/2 processes x 1 device, ours flat buffer": ["--model", "mlp", "--flat"],
        "mlp/2 processes x 1 device, ours flat buffer, 1 XLA thread": ["--model", "mlp", "--flat", "--one-thread"],
        "cnn/2 processes x 1 device, ours": ["--model", "cnn"],
        "cnn/2 processes x 1 device, ours flat buffer": ["--model", "cnn", "--flat"],
    }
    torch_names = {}
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"torch DDP not measured: torch is not importable ({e})", file=sys.stderr)
    else:
        for m in ("mlp", "cnn"):
            torch_names[m] = f"{m}/2 processes x 1 device, torch DDP, 1 thread each"
            settings[torch_names[m]] = ["--model", m, "--torch", "--threads", "1"]
        settings["mlp/2 processes x 1 device, torch DDP, default threads"] = ["--model", "mlp", "--torch"]
    runs: list[dict[str, float]] = []
    for r in range(repeats):
        order = list(settings) if r % 2 == 0 else list(settings)[::-1]
        runs.append({})
        for name in order:
            rate = _launch_rate(name, [*settings[name], "--steps", str(steps), "--rounds", str(rounds)])
            if rate is not None:
                runs[-1][name] = rate
    out = {name: float(np.median(rates)) for name in settings if (rates := [run[name] for run in runs if name in run])}
    for m, torch_name in torch_names.items():
        ours_names = [n for n in settings if n.startswith(f"{m}/") and "torch" not in n and "XLA thread" not in n]
        for name in ours_names:
            ratios = [run[name] / run[torch_name] for run in runs if name in run and torch_name in run]
            if ratios:
                label = name.split(", ", 1)[1]
                out[f"{m}/ratio 2 processes {label} / torch DDP 1 thread (paired median)"] = float(np.median(ratios))
    return out


def gloo_probe(steps: int, rounds: int) -> dict[str, float]:
    """2 processes x 1 device: ms per all-reduce (tiny, flat, leaf by leaf) and per local step."""
    res = _launch(["--probe", "--steps", str(steps), "--rounds", str(rounds)])
    return {
        f"gloo probe, {line.split('PROBE ')[1].rsplit(' ', 1)[0]} (ms)": float(line.split()[-1])
        for line in res.stdout.splitlines()
        if "PROBE" in line
    }


def probe_worker(steps: int, rounds: int) -> None:
    """Times gloo all-reduces of the MLP's gradient bytes, and the step's compute alone."""
    sc.initialize()
    mesh = sc.data_mesh()
    params = init_params("mlp")
    shapes = [x.shape for x in jax.tree.leaves(params)]
    sharded = sc.data_sharding(mesh=mesh)

    def put(shape):
        return jax.make_array_from_process_local_data(sharded, np.ones(shape, np.float32))

    def psum_all(*xs):
        return [jax.lax.psum(x, "data") for x in xs]

    summed = jax.jit(jax.shard_map(psum_all, mesh=mesh, in_specs=sc.P("data"), out_specs=sc.P("data")))
    total = sum(int(np.prod(s)) for s in shapes)
    cases = {
        "all-reduce 16 bytes": [put((4,))],
        f"all-reduce one flat buffer of {4 * total / 2**20:.1f} MiB": [put((total,))],
        f"all-reduce {len(shapes)} leaves, same bytes": [put(s) for s in shapes],
    }
    times = {name: _time(summed, args, steps, rounds) for name, args in cases.items()}
    device = jax.local_devices()[0]
    local = jax.device_put(data(), device)
    local = {k: v[: BATCH // 2] for k, v in local.items()}
    apply_fn, tx = MODELS["mlp"].apply, optax.adam(1e-3)

    def compute(p, o, batch):
        grads = jax.grad(lambda q: plain_loss(apply_fn, q, batch))(p)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    p = jax.device_put(params, device)
    times["local step without all-reduce, batch 128"] = _time(jax.jit(compute), [p, tx.init(p), local], steps, rounds)
    if jax.process_index() == 0:
        for name, ms in times.items():
            print("PROBE", name, f"{ms:.2f}", flush=True)


def _time(fn, args, steps: int, rounds: int) -> float:
    """Median over ``rounds`` of the milliseconds per call of ``fn(*args)``."""
    jax.block_until_ready(fn(*args))
    return float(np.median([time_calls(lambda: fn(*args), steps) / steps * 1e3 for _ in range(rounds)]))


def worker(model_name: str, steps: int, rounds: int, flat: bool) -> None:
    sc.initialize()
    run = ours(model_name, sc.data_mesh(), FLAT if flat else "ddp")
    run(3)
    rate = float(np.median([BATCH * steps / run(steps) for _ in range(rounds)]))
    if jax.process_index() == 0:
        print("RESULT", rate, flush=True)


def torch_worker(model_name: str, steps: int, rounds: int, threads: int | None) -> None:
    """One torch DDP worker (gloo, CPU) training on its slice of the global batch. The launcher's
    coordinator address, unused because JAX is not initialized here, serves as torch's rendezvous."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if threads:
        torch.set_num_threads(threads)
    rank, world = int(os.environ[runtime.ENV_PROCESS_ID]), int(os.environ[runtime.ENV_NUM_PROCESSES])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ[runtime.ENV_COORDINATOR]}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.manual_seed(0)
    net = _torch_model(model_name)
    shapes = jax.eval_shape(lambda: MODELS[model_name].init(jax.random.PRNGKey(0), jnp.zeros((2, 28, 28, 1))))
    n_params = sum(x.size for x in jax.tree.leaves(shapes))  # abstract: JAX starts no backend here
    assert sum(p.numel() for p in net.parameters()) == n_params, "torch model differs from the flax one"
    model = DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # optax.adam(1e-3)'s betas and eps
    per = BATCH // world
    local = {k: torch.from_numpy(v[rank * per : (rank + 1) * per]) for k, v in data().items()}
    x = local["x"].permute(0, 3, 1, 2).contiguous()  # NCHW
    y = local["y"].long()

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return time.perf_counter() - start

    run(3)
    rate = float(np.median([BATCH * steps / run(steps) for _ in range(rounds)]))
    if rank == 0:
        print("RESULT", rate, f"(torch {torch.__version__}, {torch.get_num_threads()} threads)", flush=True)
    dist.destroy_process_group()


def _torch_model(model_name: str):
    """The torch twin of ``MODELS[model_name]`` (same layers and parameter count; NCHW input)."""
    from torch import nn as tnn

    if model_name == "mlp":
        return tnn.Sequential(
            tnn.Flatten(), tnn.Linear(784, 512), tnn.ReLU(), tnn.Linear(512, 512), tnn.ReLU(), tnn.Linear(512, 10)
        )
    return tnn.Sequential(
        tnn.Conv2d(1, 16, 3, stride=2, padding=1),
        tnn.ReLU(),
        tnn.Conv2d(16, 32, 3, stride=2, padding=1),
        tnn.ReLU(),
        tnn.AdaptiveAvgPool2d(1),
        tnn.Flatten(),
        tnn.Linear(32, 10),
    )


def _launch_rate(name: str, worker_args: list[str]) -> float | None:
    """Samples/s that process 0 of a 2-process launch reports, or None (with a note) if it failed."""
    res = _launch(worker_args)
    lines = [ln.split("RESULT ", 1)[1] for ln in res.stdout.splitlines() if "RESULT" in ln]
    if res.returncode or not lines:
        print(f"multi-process {name} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}", file=sys.stderr)
        return None
    print(f"  {name}: {lines[0]}", file=sys.stderr)
    return float(lines[0].split()[0])


def _launch(worker_args: list[str]) -> subprocess.CompletedProcess:
    """Runs this file as 2 processes x 1 device through the launcher, bounded by its timeout."""
    cmd = [sys.executable, "-m", "spmdcomm.launch", "-n", "2", "--devices-per-process", "1", "--timeout", "300"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("XLA_FLAGS", None)
    if "--one-thread" in worker_args:
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return subprocess.run(
        [*cmd, __file__, "--worker", *worker_args], env=env, capture_output=True, text=True, timeout=360
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of the multi-process settings")
    parser.add_argument("--skip-multiprocess", action="store_true")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--models", default="mlp,cnn", help="the in-process comparisons' models")
    parser.add_argument("--variants", help="comma-separated in-process variants, e.g. 'ours,single device' (all)")
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("--one-thread", action="store_true")
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads per worker (0: default)")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.worker and args.probe:
        probe_worker(args.steps, args.rounds)
        return
    if args.worker and args.torch:
        torch_worker(args.model, args.steps, args.rounds, args.threads or None)
        return
    if args.worker:
        worker(args.model, args.steps, args.rounds, args.flat)
        return
    only = args.variants.split(",") if args.variants else None
    results = {} if args.skip_in_process else in_process(args.rounds, args.steps, args.models.split(","), only)
    if not args.skip_multiprocess:
        results.update(multi_process(args.steps, args.rounds, args.repeats))
        results.update(gloo_probe(args.steps, args.rounds))
    print(f"jax {jax.__version__}, optax {optax.__version__}, {os.cpu_count()} cores, global batch {BATCH}")
    for name, value in results.items():
        print(f"{name:64s} {value:12.3f}" if "ratio" in name or "(ms)" in name else f"{name:64s} {value:12.0f}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
