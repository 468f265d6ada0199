"""Memory per device and samples/s of the data-parallel strategies: DDP, ZeRO-1, ZeRO-2 and FSDP.

Run: ``python benchmarks/strategies.py [--rounds 11] [--steps 8] [--sizes 2,4,8] [--models mlp,cnn] [--json PATH]``.

Strategies: DDP, ZeRO-1, ZeRO-2, FSDP, and FSDP with ``reshard_after_forward=False``. Models: the MLP
784-512-512-10 of ``train_step.py`` and the MNIST example's CNN (``examples/mnist/models.py``), cross-entropy,
Adam, global batch 256.

Memory, on N = 2, 4 and 8 fake CPU devices, per device (the largest one where devices differ): the bytes of the
parameters and of the optimizer state, read from the placed arrays (``addressable_shards``); the gradient each
device holds through the step (:func:`gradient_bytes` says what is counted); and what XLA reserved for the
compiled step (``sc.explain(step, state, batch).memory``: arguments, outputs, temporaries) at the global
batch, and at one example per device, with ``accum_steps`` 1 and 4, where the activations are too small to
hide the parameter-sized temporaries. These numbers do not depend on timing: one run measures them.

Speed, on 8 fake CPU devices: samples/s of every strategy next to DDP in one process; the variants are
interleaved round by round (the order reversed every other round), each number is a median over rounds, and
each ratio is the median over rounds of that round's ratio to DDP. Every loop keeps at most 8 steps in flight
(``_common.time_calls``). With the speed comes each compiled step's floating-point operations per device
(XLA's cost analysis): the cost of recomputing the forward pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

from _common import set_cpu_devices, time_calls, write_json

set_cpu_devices(8)  # before JAX starts: the memory table takes meshes of 2, 4 and 8 of these devices
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from train_step import BATCH, MLP, data, loss_fn  # noqa: E402

import spmdcomm as sc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "fsdp": "fsdp",
    "fsdp reshard_after_forward=False": sc.FSDP(reshard_after_forward=False),
}
ACCUM = 4  # micro-batches of the accumulation column


def mnist_cnn():
    """The MNIST example's CNN, loaded from its file (the example is a script directory, not a package)."""
    spec = importlib.util.spec_from_file_location("mnist_models", ROOT / "examples" / "mnist" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CNN()


MODELS = {"mlp": MLP(), "cnn": mnist_cnn()}


def make_state(model_name: str, mesh, strategy) -> sc.TrainState:
    model = MODELS[model_name]
    params = model.init(jax.random.PRNGKey(0), data()["x"][:2])["params"]
    return sc.TrainState.create(
        params=jax.tree.map(np.asarray, dict(params)),
        apply_fn=model.apply,
        tx=optax.adam(1e-3),
        mesh=mesh,
        strategy=strategy,
    )


# --- memory ----------------------------------------------------------------------------------------


def memory(model_name: str, n: int, names: list[str]) -> list[dict]:
    """One row per strategy of ``names``: bytes per device on a mesh of ``n`` devices (module docstring)."""
    mesh = sc.data_mesh(devices=jax.devices()[:n])
    step, accum = sc.make_train_step(loss_fn), sc.make_train_step(loss_fn, accum_steps=ACCUM)
    rows = []
    for name in names:
        state = make_state(model_name, mesh, STRATEGIES[name])
        row = {
            "model": model_name,
            "devices": n,
            "strategy": name,
            "param_bytes": per_device_bytes(state.params),
            "opt_bytes": per_device_bytes(state.opt_state),
            "grad_bytes": gradient_bytes(state),
        }
        row["persistent_bytes"] = row["param_bytes"] + row["opt_bytes"]
        compiled = sc.explain(step, state, _rows(BATCH)).memory
        row.update(
            argument_bytes=compiled.argument_bytes,
            output_bytes=compiled.output_bytes,
            temp_bytes=compiled.temp_bytes,
            temp_bytes_1_per_device=sc.explain(step, state, _rows(n)).memory.temp_bytes,
            temp_bytes_accum_1_per_device=sc.explain(accum, state, _rows(ACCUM * n)).memory.temp_bytes,
        )
        if state.strategy.shards_params:
            row["padding_allowance_bytes"] = padding_allowance(state)
        rows.append(row)
    ddp = rows[0]
    for row in rows:
        for key in ("persistent_bytes", "grad_bytes", "argument_bytes", "temp_bytes", "temp_bytes_1_per_device"):
            row[f"{key} vs ddp"] = row[key] / ddp[key]
        if "padding_allowance_bytes" in row:  # the goal: FSDP persistent state <= DDP / N + padding
            row["goal_bound_bytes"] = ddp["persistent_bytes"] / n + row["padding_allowance_bytes"]
            row["goal_met"] = row["persistent_bytes"] <= row["goal_bound_bytes"]
    return rows


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s placed arrays on one device: the largest, where devices hold different amounts."""
    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


def gradient_bytes(state: sc.TrainState) -> int:
    """The gradient one device holds through a step, in bytes.

    DDP and ZeRO-1: the whole local gradient (as many bytes as the parameters). Each device differentiates its
    block of the batch into a whole gradient tree, which DDP all-reduces and ZeRO-1 reduce-scatters once at the
    end of the step; with ``accum_steps`` it is the whole accumulator. ZeRO-2 and FSDP: one 1/N shard of the
    padded flat gradient, the accumulator ZeRO-2 reduce-scatters each micro-batch into and the form FSDP's
    backward pass produces (the transpose of its all-gather). Their micro-batch gradient is whole only until
    its reduce-scatter; the ``temp_bytes_*`` columns measure what XLA actually keeps.
    """
    if state.strategy.name in ("zero2", "fsdp"):
        n = state.layout.shards
        sizes = state.layout.flat.sizes(n)  # entries per flat vector, padded to a multiple of n
        return sum(size // n * jnp.dtype(key.rsplit("/", 1)[-1]).itemsize for key, size in sizes.items())
    return per_device_bytes(state.params)


def padding_allowance(state: sc.TrainState) -> float:
    """What FSDP may hold beyond an exact 1/N of DDP's parameters and optimizer state, per device.

    A vector of ``s`` entries split ``n`` ways pads to ``ceil(s / n)`` entries per device: less than one entry
    more than ``s / n``. Leaves that stay whole (Adam's step count) are held by every device: ``(n - 1) / n``
    of them more than their 1/N share.
    """
    n = state.mesh.shape[state.axis]
    allowance = 0.0
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if leaf.sharding.is_fully_replicated:
            allowance += leaf.nbytes * (n - 1) / n
        else:
            allowance += leaf.dtype.itemsize
    return allowance


# --- speed -----------------------------------------------------------------------------------------


def speed(model_names: list[str], names: list[str], rounds: int, steps: int) -> dict:
    """Samples/s of each strategy of ``names`` on every device, interleaved; medians and paired ratios to DDP."""
    mesh = sc.data_mesh()
    runs = {(m, name): runner(m, mesh, STRATEGIES[name]) for m in model_names for name in names}
    for run in runs.values():  # compile and warm up
        run(3)
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for r in range(rounds):
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:  # reversed every other round: no order bias
            rates[key].append(BATCH * steps / runs[key](steps))
    out: dict = {}
    for m in model_names:
        ddp = np.array(rates[(m, "ddp")])
        out[m] = {
            name: {
                "samples_per_s": float(np.median(rates[(m, name)])),
                "ratio_vs_ddp": float(np.median(np.array(rates[(m, name)]) / ddp)),
                "gflops_per_device": runs[(m, name)].gflops,
            }
            for name in names
        }
    return out


def runner(model_name: str, mesh, strategy):
    """``run(steps) -> seconds`` for ``steps`` train steps of ``strategy`` on one placed batch."""
    state = make_state(model_name, mesh, strategy)
    step = sc.make_train_step(loss_fn)
    batch = jax.tree.map(lambda x: jax.device_put(x, sc.data_sharding(mesh=mesh)), data())
    holder = {"state": state}

    def call():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    def run(n: int) -> float:
        return time_calls(call, n)

    cost = step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict on older JAX
    run.gflops = float(cost["flops"]) / 1e9 if cost and "flops" in cost else None
    return run


def _rows(n: int) -> dict[str, np.ndarray]:
    """The first ``n`` rows of the benchmark batch (``n`` may exceed it: rows repeat)."""
    return {k: np.resize(v, (n, *v.shape[1:])) for k, v in data().items()}


# --- report ----------------------------------------------------------------------------------------


def print_tables(result: dict) -> None:
    kib = 1024
    print(f"jax {result['jax']}, {result['cpu_cores']} cores, global batch {BATCH}, Adam")
    print("memory per device (KiB): params + optimizer state, gradient, compiled arguments / temporaries")
    for row in result["memory"]:
        goal = ""
        if "goal_met" in row:
            verdict = "met" if row["goal_met"] else "MISSED"
            goal = f"  goal <= {row['goal_bound_bytes'] / kib:.1f}: {verdict}"
        print(
            f"{row['model']:4s} N={row['devices']} {row['strategy']:33s}"
            f" persistent {row['persistent_bytes'] / kib:9.1f} ({row['persistent_bytes vs ddp']:.3f}x)"
            f" grad {row['grad_bytes'] / kib:8.1f} args {row['argument_bytes'] / kib:9.1f}"
            f" temps {row['temp_bytes'] / kib:9.1f} / 1 per device {row['temp_bytes_1_per_device'] / kib:8.1f}"
            f" / accum {row['temp_bytes_accum_1_per_device'] / kib:8.1f}{goal}"
        )
    for model, variants in result.get("speed", {}).items():
        for name, v in variants.items():
            flops = "" if v["gflops_per_device"] is None else f"  {v['gflops_per_device']:.3f} GFLOP/device"
            print(f"{model:4s} {name:33s} {v['samples_per_s']:9.0f} samples/s  {v['ratio_vs_ddp']:.3f}x ddp{flops}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sizes", default="2,4,8", help="device counts of the memory table")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="a subset; ddp, the baseline, always runs")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    models = args.models.split(",")
    names = ["ddp", *(name for name in args.strategies.split(",") if name != "ddp")]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "cpu_cores": os.cpu_count(),
        "global_batch": BATCH,
        "memory": [row for m in models for n in map(int, args.sizes.split(",")) for row in memory(m, n, names)],
    }
    if not args.skip_speed:
        result["speed"] = speed(models, names, args.rounds, args.steps)
    print_tables(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
