"""Memory per device and samples/s of the data-parallel strategies: DDP, ZeRO-1, ZeRO-2 and FSDP, next to the
plain ``jax.jit`` program a JAX user writes for FSDP.

Run: ``python benchmarks/strategies.py [--rounds 11] [--steps 8] [--sizes 2,4,8] [--models mlp,cnn,odd-mlp,transformer]
[--smoke] [--json PATH]``; ``--markdown JSON`` prints the tables of a JSON written before and runs nothing. The
JSON's ``"markdown"`` holds the same tables (``_strategies_tables.py``): docs/sharded.md and benchmarks/README.md
show them.

Strategies: DDP, ZeRO-1, ZeRO-2, FSDP, and FSDP with ``reshard_after_forward=False``. Models, with Adam:

- ``mlp``: the MLP 784-512-512-10 of ``train_step.py``, cross-entropy, global batch 256;
- ``cnn``: the MNIST example's CNN (``examples/mnist/models.py``), cross-entropy, global batch 256;
- ``odd-mlp``: an MLP 300-1001-999-1003-10 (2.3 M parameters) whose layer widths no device count divides, global
  batch 256: under ZeRO and FSDP its leaves are stored padded (``TrainState.memory().padding``), where the jit
  program, whose ``NamedSharding`` s can only split evenly, keeps them replicated: its speed ratio is what padding
  costs next to the replicated layout it replaces;
- ``transformer``: a small causal language model (token embedding, vocabulary 256, width 128; 2 pre-LayerNorm
  blocks of 4-head causal self-attention and an MLP 128-512-128; final LayerNorm and a dense layer to the
  vocabulary; no position embedding: the causal mask orders the tokens) on random int32 sequences of 64 tokens,
  next-token cross-entropy (mean over the positions of a sequence, then over the sequences). Its global batch
  is 64 sequences (``LM_BATCH``), not 256: at 64 a step already takes about 12 times the MLP's floating-point
  operations (0.2 s on a 2-core CPU); 256 would make the speed loop about 4 times longer. Samples/s count
  sequences.

The comparison column ``jit+NamedSharding fsdp`` is the program a JAX user writes instead of our FSDP: one
``jax.jit`` of ``jax.value_and_grad`` of the plain mean loss over the whole global batch, ``tx.update`` and
``optax.apply_updates``, with every parameter and optimizer-state leaf placed by its own ``NamedSharding`` under
the rule a ``NamedSharding`` can express (:func:`even_spec`: split on the first dimension the device count divides,
else replicated; ours pads such leaves instead), the batch split over the devices, the outputs placed as the
inputs, parameters and optimizer state donated. XLA's SPMD partitioner inserts the collectives.

Memory, on N = 2, 4 and 8 fake CPU devices, per device (the largest one where devices differ): the bytes of the
parameters and of the optimizer state, read from the placed arrays (``addressable_shards``); the gradient each
device holds through the step (:func:`gradient_bytes` says what is counted); and what XLA reserved for the
compiled step (``sc.explain(step, state, batch).memory``; ``memory_analysis()`` for the jit program:
arguments, outputs, temporaries) at the global batch, and at one example per device, with ``accum_steps`` 1 and
4, where the activations are too small to hide the parameter-sized temporaries. ``peak_bytes`` is the compiled
step's peak per device at the global batch: arguments + temporaries (outputs reuse the donated arguments'
buffers). These numbers do not depend on timing: one run measures them. Goals of the FSDP rows: persistent
state (parameters + optimizer state) <= DDP's / N + the replicated leaves' extra (n - 1) / n of their bytes;
and a peak at least half the ideal saving below DDP's: ``ddp_peak - fsdp_peak >= 0.5 (N - 1) / N`` of DDP's
persistent bytes.

Speed, on 8 fake CPU devices: samples/s of every strategy and of the jit program, next to DDP, in one process;
the variants are interleaved round by round (the order reversed every other round), each number is a median
over rounds, and each ratio (``ratio_vs_ddp``, and ``ratio_vs_jit`` for our strategies) is the median over
rounds of that round's ratio. Every loop keeps at most 8 steps in flight (``_common.time_calls``). With the
speed comes each compiled step's floating-point operations per device (XLA's cost analysis): the cost of
recomputing the forward pass. Goals: FSDP >= 0.9x the jit program and >= 0.85x DDP; ZeRO-1 >= 0.95x DDP.

2-D layouts, on all 8 devices (:func:`layouts_memory`): hybrid FSDP (``replica`` 2 x ``shard`` 4) and model axes
(``data`` 4 x ``model`` 2, every kernel split by its last dimension over ``model``), with the message bytes each
step sends over each mesh axis (``explain(...).total_bytes(over=axis)``). Goals: hybrid persistent state <= DDP's
/ 4 + the replicated leaves' extra; the model axis halves the bytes of the parameters it splits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

from _common import jit_once, run_facts, set_cpu_devices, step_caller, time_calls, write_json
from _strategies_tables import JIT, markdown, speed_goals

set_cpu_devices(8)  # before JAX starts: the memory table takes meshes of 2, 4 and 8 of these devices
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_step import BATCH, MLP, data, loss_fn, plain_loss  # noqa: E402

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
LM_BATCH, LM_SEQ, LM_VOCAB = 64, 64, 256  # the transformer's global batch (sequences), tokens per sequence


def mnist_cnn():
    """The MNIST example's CNN, loaded from its file (the example is a script directory, not a package)."""
    spec = importlib.util.spec_from_file_location("mnist_models", ROOT / "examples" / "mnist" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CNN()


class OddMLP(nn.Module):
    """An MLP whose widths no device count divides: 300-1001-999-1003-10."""

    @nn.compact
    def __call__(self, x):
        for width in (1001, 999, 1003):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def odd_data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((BATCH, 300)).astype(np.float32), "y": rng.integers(0, 10, BATCH).astype(np.int32)}


def even_spec(shape: tuple[int, ...], n: int) -> P:
    """The jit program's placement: split over ``"data"`` on the first dimension ``n`` divides, else replicated (a
    ``NamedSharding`` must split evenly)."""
    dim = next((d for d, size in enumerate(shape) if size >= n and size % n == 0), None)
    return P() if dim is None else P(*([None] * dim), "data")


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then an MLP, each added to its input."""

    heads: int = 4
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(x[..., 0])
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.Dense(self.hidden)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class TransformerLM(nn.Module):
    """Token embedding, ``layers`` pre-LayerNorm blocks (``heads`` heads, an MLP of 4 x ``width``), a final
    LayerNorm and a dense layer to the vocabulary. The defaults are the benchmark's model; benchmarks/gpu.py
    measures a larger one."""

    vocab: int = LM_VOCAB
    width: int = 128
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(self.layers):
            x = Block(heads=self.heads, hidden=4 * self.width)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def lm_token_losses(apply_fn, params, tokens):
    """Cross-entropy of each next token: ``(sequences, positions - 1)``."""
    logits = apply_fn({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def lm_loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    """Our steps' loss: the mean over positions of each sequence, then over this device's real sequences."""
    return sc.masked_mean(lm_token_losses(apply_fn, params, batch["tokens"]).mean(axis=1), mask)


def lm_plain_loss(apply_fn, params, batch):
    """The jit program's loss: the same mean, over the whole global batch."""
    return lm_token_losses(apply_fn, params, batch["tokens"]).mean()


def lm_data(seed: int = 0) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(seed).integers(0, LM_VOCAB, (LM_BATCH, LM_SEQ)).astype(np.int32)}


MODELS = {"mlp": MLP(), "cnn": mnist_cnn(), "odd-mlp": OddMLP(), "transformer": TransformerLM()}
LOSSES = {"mlp": loss_fn, "cnn": loss_fn, "odd-mlp": loss_fn, "transformer": lm_loss_fn}  # our steps' loss_fn
# The jit program's loss: f(apply_fn, params, batch)
PLAIN_LOSSES = {"mlp": plain_loss, "cnn": plain_loss, "odd-mlp": plain_loss, "transformer": lm_plain_loss}
INPUT_KEY = {"mlp": "x", "cnn": "x", "odd-mlp": "x", "transformer": "tokens"}  # what the model is applied to
# Each model's init compiled once, as one program (as in train_step.py).
INITS = {name: jit_once(model.init) for name, model in MODELS.items()}


def model_data(model_name: str) -> dict[str, np.ndarray]:
    """The benchmark's global batch of ``model_name``: MNIST-shaped images and labels, or token sequences."""
    return lm_data() if model_name == "transformer" else odd_data() if model_name == "odd-mlp" else data()


def global_batch(model_name: str) -> int:
    return len(model_data(model_name)[INPUT_KEY[model_name]])


def init_params(model_name: str) -> dict:
    inputs = model_data(model_name)[INPUT_KEY[model_name]][:2]
    return jax.tree.map(np.asarray, dict(INITS[model_name](jax.random.PRNGKey(0), inputs)["params"]))


def make_state(model_name: str, mesh, strategy) -> sc.TrainState:
    return sc.TrainState.create(
        params=init_params(model_name),
        apply_fn=MODELS[model_name].apply,
        tx=optax.adam(1e-3),
        mesh=mesh,
        strategy=strategy,
    )


def jit_program(model_name: str, mesh):
    """The plain ``jax.jit`` FSDP program (module docstring): ``(step, params, opt_state)``, placed on ``mesh``;
    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` donates its first two arguments."""
    apply_fn, tx, loss = MODELS[model_name].apply, optax.adam(1e-3), PLAIN_LOSSES[model_name]
    n = mesh.shape["data"]

    def placement(tree):
        return jax.tree.map(lambda x: NamedSharding(mesh, even_spec(np.shape(x), n)), tree)

    params = init_params(model_name)
    p_sharding = placement(params)
    o_sharding = placement(jax.eval_shape(tx.init, params))
    params = jax.device_put(params, p_sharding)
    opt_state = jax.jit(tx.init, out_shardings=o_sharding)(params)
    batch_sharding = jax.tree.map(lambda _: sc.data_sharding(mesh=mesh), model_data(model_name))

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(lambda p: loss(apply_fn, p, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(
        step,
        in_shardings=(p_sharding, o_sharding, batch_sharding),
        out_shardings=(p_sharding, o_sharding, sc.replicated_sharding(mesh=mesh)),
        donate_argnums=(0, 1),
    )
    return jitted, params, opt_state


# --- memory ----------------------------------------------------------------------------------------


def memory(model_name: str, n: int, names: list[str], *, small_batches: bool = True) -> list[dict]:
    """One row per strategy of ``names``, then one of the jit program: bytes per device on a mesh of ``n``
    devices (module docstring); ``small_batches=False``: no temporaries at one row per device (None)."""
    mesh = sc.data_mesh(devices=jax.devices()[:n])
    loss = LOSSES[model_name]
    step, accum = sc.make_train_step(loss), sc.make_train_step(loss, accum_steps=ACCUM)
    batch = global_batch(model_name)
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
        compiled = sc.explain(step, state, _rows(model_name, batch)).memory
        row.update(
            argument_bytes=compiled.argument_bytes,
            output_bytes=compiled.output_bytes,
            temp_bytes=compiled.temp_bytes,
            peak_bytes=compiled.argument_bytes + compiled.temp_bytes,
            temp_bytes_1_per_device=None,
            temp_bytes_accum_1_per_device=None,
        )
        if small_batches:
            row["temp_bytes_1_per_device"] = sc.explain(step, state, _rows(model_name, n)).memory.temp_bytes
            row["temp_bytes_accum_1_per_device"] = sc.explain(
                accum, state, _rows(model_name, ACCUM * n)
            ).memory.temp_bytes
        if state.strategy.shards_params:
            row["replication_allowance_bytes"] = replication_allowance(state)
        rows.append(row)
    rows.append(jit_memory(model_name, mesh, small_batches=small_batches))
    ddp = rows[0]
    for row in rows:
        for key in ("persistent_bytes", "grad_bytes", "argument_bytes", "temp_bytes", "temp_bytes_1_per_device"):
            if row[key] is not None:
                row[f"{key} vs ddp"] = row[key] / ddp[key]
        row["peak_bytes vs ddp"] = row["peak_bytes"] / ddp["peak_bytes"]
        if "replication_allowance_bytes" in row:  # the goals: FSDP persistent state <= DDP/N + replicated leaves
            row["goal_bound_bytes"] = ddp["persistent_bytes"] / n + row["replication_allowance_bytes"]
            row["goal_met"] = row["persistent_bytes"] <= row["goal_bound_bytes"]
            # and its peak at least half the ideal saving, (n - 1) / n of DDP's persistent state, below DDP's
            row["peak_goal_saving_bytes"] = 0.5 * (n - 1) / n * ddp["persistent_bytes"]
            row["peak_saving_bytes"] = ddp["peak_bytes"] - row["peak_bytes"]
            row["peak_goal_met"] = row["peak_saving_bytes"] >= row["peak_goal_saving_bytes"]
    return rows


def jit_memory(model_name: str, mesh, *, small_batches: bool = True) -> dict:
    """The memory row of the jit program (no gradient column: where its gradient lives is XLA's choice)."""
    step, params, opt_state = jit_program(model_name, mesh)

    def analysis(rows: int):
        return step.lower(params, opt_state, _rows(model_name, rows)).compile().memory_analysis()

    n = mesh.shape["data"]
    full = analysis(global_batch(model_name))
    row = {
        "model": model_name,
        "devices": n,
        "strategy": JIT,
        "param_bytes": per_device_bytes(params),
        "opt_bytes": per_device_bytes(opt_state),
        "grad_bytes": None,
    }
    row["persistent_bytes"] = row["param_bytes"] + row["opt_bytes"]
    row.update(
        argument_bytes=int(full.argument_size_in_bytes),
        output_bytes=int(full.output_size_in_bytes),
        temp_bytes=int(full.temp_size_in_bytes),
        peak_bytes=int(full.argument_size_in_bytes + full.temp_size_in_bytes),
        temp_bytes_1_per_device=int(analysis(n).temp_size_in_bytes) if small_batches else None,
        temp_bytes_accum_1_per_device=None,  # the plain program has no accumulation
    )
    return row


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
    end of the step; with ``accum_steps`` it is the whole accumulator. ZeRO-2 and FSDP: this device's block of
    every split leaf (1/N of its bytes: the dimension it is split on is a multiple of N, so there is no padding)
    and every replicated leaf whole (a leaf that no dimension of it divides: a count, a bias of 10 entries on 8
    devices). That is the accumulator ZeRO-2 reduce-scatters each micro-batch into and the form FSDP's backward
    pass produces (the transpose of its all-gather). Their micro-batch gradient is whole only until its
    reduce-scatter; the ``temp_bytes_*`` columns measure what XLA actually keeps.
    """
    if state.strategy.name in ("zero2", "fsdp"):
        n = state.mesh.shape[state.axis]
        pairs = zip(jax.tree.leaves(state.params), state.layout.grad_leaf_specs, strict=True)
        return sum(leaf.nbytes if spec == sc.P() else leaf.nbytes // n for leaf, spec in pairs)
    return per_device_bytes(state.params)


def replication_allowance(state: sc.TrainState) -> float:
    """What FSDP may hold beyond an exact 1/N of DDP's parameters and optimizer state, per device.

    A split leaf's block is 1/N of it, padded where N divides none of its dimensions (``TrainState.memory().padding``
    per device). A leaf that stays whole (Adam's step count, fewer elements than devices) is held by every device:
    ``(N - 1) / N`` of its bytes more than its 1/N share.
    """
    n = state.mesh.shape[state.axis]
    leaves = jax.tree.leaves((state.params, state.opt_state))
    whole = sum(leaf.nbytes * (n - 1) / n for leaf in leaves if leaf.sharding.is_fully_replicated)
    return whole + state.memory().padding


def layouts_memory(model_name: str, *, smoke: bool = False) -> list[dict]:
    """Bytes per device on all 8 devices under 2-D layouts, next to DDP on one axis: hybrid FSDP (``replica`` 2 x
    ``shard`` 4) and model axes (``data`` 4 x ``model`` 2, every kernel split by its last dimension over ``model``).
    Goals: hybrid persistent state <= DDP's / 4 (the shard group) + the replicated leaves' extra; a model axis
    divides the bytes of the parameters it splits by its size. ``smoke``: the layouts with goals only."""
    batch = _rows(model_name, global_batch(model_name))
    step = sc.make_train_step(LOSSES[model_name])
    params = init_params(model_name)
    by_model = jax.tree.map(
        lambda x: sc.P(*[None] * (x.ndim - 1), "model") if x.ndim > 1 and x.shape[-1] % 2 == 0 else None, params
    )
    layouts = {
        "ddp": ({"data": 8}, "data", "ddp", None),
        "fsdp hybrid replica=2 x shard=4": ({"replica": 2, "shard": 4}, ("replica", "shard"), "fsdp", None),
        "ddp data=4 x model=2": ({"data": 4, "model": 2}, "data", "ddp", by_model),
        "fsdp data=4 x model=2": ({"data": 4, "model": 2}, "data", "fsdp", by_model),
    }
    if smoke:
        del layouts["fsdp data=4 x model=2"]
    rows = []
    for name, (axes, data_axes, strategy, specs) in layouts.items():
        state = sc.TrainState.create(
            params=params,
            apply_fn=MODELS[model_name].apply,
            tx=optax.adam(1e-3),
            mesh=sc.make_mesh(axes),
            axis=data_axes,
            strategy=strategy,
            param_specs=specs,
        )
        compiled = sc.explain(step, state, batch)
        row = {
            "model": model_name,
            "layout": name,
            "param_bytes": per_device_bytes(state.params),
            "opt_bytes": per_device_bytes(state.opt_state),
            "peak_bytes": compiled.memory.argument_bytes + compiled.memory.temp_bytes,
            "bytes_over_axis": {a: compiled.total_bytes(over=a) for a in state.mesh.axis_names},
        }
        row["persistent_bytes"] = row["param_bytes"] + row["opt_bytes"]
        rows.append(row)
        if name == "fsdp hybrid replica=2 x shard=4":
            n = 4
            extra = state.memory().padding + sum(
                x.nbytes * (n - 1) / n
                for x in jax.tree.leaves((state.params, state.opt_state))
                if x.sharding.is_fully_replicated
            )
            row["goal_bound_bytes"] = rows[0]["persistent_bytes"] / n + extra
            row["goal_met"] = row["persistent_bytes"] <= row["goal_bound_bytes"]
        if name == "ddp data=4 x model=2":
            split = sum(
                x.nbytes
                for x, s in zip(
                    jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda v: v is None), strict=True
                )
                if s is not None
            )
            row["goal_bound_bytes"] = rows[0]["param_bytes"] - split / 2
            row["goal_met"] = row["param_bytes"] <= row["goal_bound_bytes"]
    for row in rows:
        row["persistent_bytes vs ddp"] = row["persistent_bytes"] / rows[0]["persistent_bytes"]
    return rows


# --- speed -----------------------------------------------------------------------------------------


def speed(model_names: list[str], names: list[str], rounds: int, steps: int, mesh=None) -> dict:
    """Samples/s of each strategy of ``names`` and of the jit program on ``mesh`` (default: every device),
    interleaved; medians and paired ratios to DDP and, for our strategies, to the jit program."""
    mesh = sc.data_mesh() if mesh is None else mesh
    runs = {(m, name): runner(m, mesh, STRATEGIES[name]) for m in model_names for name in names}
    runs.update({(m, JIT): jit_runner(m, mesh) for m in model_names})
    for run in runs.values():  # compile and warm up
        run(3)
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for r in range(rounds):
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:  # reversed every other round: no order bias
            rates[key].append(global_batch(key[0]) * steps / runs[key](steps))
    out: dict = {}
    for m in model_names:
        ddp, jit = np.array(rates[(m, "ddp")]), np.array(rates[(m, JIT)])
        out[m] = {}
        for name in [*names, JIT]:
            own = np.array(rates[(m, name)])
            out[m][name] = {
                "samples_per_s": float(np.median(own)),
                "ratio_vs_ddp": float(np.median(own / ddp)),
                "gflops_per_device": runs[(m, name)].gflops,
            }
            if name != JIT:
                out[m][name]["ratio_vs_jit"] = float(np.median(own / jit))
    return out


def runner(model_name: str, mesh, strategy):
    """``run(steps) -> seconds`` for ``steps`` train steps of ``strategy`` on one placed batch."""
    state = make_state(model_name, mesh, strategy)
    step = sc.make_train_step(LOSSES[model_name])
    batch = jax.device_put(model_data(model_name), sc.data_sharding(mesh=mesh))
    call = step_caller(step, state, batch)

    def run(n: int) -> float:
        return time_calls(call, n)

    run.gflops = _gflops(step.lower(state, batch))
    return run


def jit_runner(model_name: str, mesh):
    """``run(steps) -> seconds`` for ``steps`` steps of the jit program on one placed batch."""
    step, params, opt_state = jit_program(model_name, mesh)
    batch = jax.device_put(model_data(model_name), sc.data_sharding(mesh=mesh))
    holder = {"p": params, "o": opt_state}

    def call():
        holder["p"], holder["o"], loss = step(holder["p"], holder["o"], batch)
        return loss

    def run(n: int) -> float:
        return time_calls(call, n)

    run.gflops = _gflops(step.lower(params, opt_state, batch))
    return run


def _gflops(lowered) -> float | None:
    """Floating-point operations per device of a lowered program, in billions (XLA's cost analysis)."""
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict on older JAX
    return float(cost["flops"]) / 1e9 if cost and "flops" in cost else None


def _rows(model_name: str, n: int) -> dict[str, np.ndarray]:
    """The first ``n`` rows of ``model_name``'s benchmark batch (``n`` may exceed it: rows repeat)."""
    return {k: np.resize(v, (n, *v.shape[1:])) for k, v in model_data(model_name).items()}


# --- report ----------------------------------------------------------------------------------------


def print_tables(result: dict) -> None:
    kib = 1024
    batches = ", ".join(f"{m} {b}" for m, b in result.get("batch_per_model", {}).items())
    print(f"jax {result['jax']}, {result['cpu_cores']} cores, global batch {batches or result['global_batch']}, Adam")
    print(
        "memory per device (KiB): params + optimizer state, gradient, compiled arguments / temporaries,"
        " peak = arguments + temporaries"
    )

    def kb(value) -> str:
        return "-" if value is None else f"{value / kib:.1f}"

    for row in result["memory"]:
        goal = ""
        if "goal_met" in row:
            verdict = "met" if row["goal_met"] else "MISSED"
            goal = f"  goal <= {row['goal_bound_bytes'] / kib:.1f}: {verdict}"
        if "peak_goal_met" in row:
            verdict = "met" if row["peak_goal_met"] else "MISSED"
            goal += (
                f"; peak saving {row['peak_saving_bytes'] / kib:.1f} >= {row['peak_goal_saving_bytes'] / kib:.1f}:"
                f" {verdict}"
            )
        print(
            f"{row['model']:11s} N={row['devices']} {row['strategy']:33s}"
            f" persistent {row['persistent_bytes'] / kib:9.1f} ({row['persistent_bytes vs ddp']:.3f}x)"
            f" grad {kb(row['grad_bytes']):>8s} args {row['argument_bytes'] / kib:9.1f}"
            f" temps {row['temp_bytes'] / kib:9.1f} / 1 per device {kb(row['temp_bytes_1_per_device']):>8s}"
            f" / accum {kb(row['temp_bytes_accum_1_per_device']):>8s}"
            f" peak {row['peak_bytes'] / kib:9.1f} ({row['peak_bytes vs ddp']:.3f}x){goal}"
        )
    print("2-D layouts on 8 devices (KiB per device): params + optimizer state, peak, bytes over each axis per step")
    for row in result.get("layouts", []):
        goal = ""
        if "goal_met" in row:
            goal = f"  goal <= {row['goal_bound_bytes'] / kib:.1f}: {'met' if row['goal_met'] else 'MISSED'}"
        axes = ", ".join(f"{a} {b / kib:.1f}" for a, b in row["bytes_over_axis"].items())
        print(
            f"{row['model']:11s} {row['layout']:33s} params {row['param_bytes'] / kib:9.1f}"
            f" persistent {row['persistent_bytes'] / kib:9.1f} ({row['persistent_bytes vs ddp']:.3f}x)"
            f" peak {row['peak_bytes'] / kib:9.1f}  over {axes}{goal}"
        )
    for model, variants in result.get("speed", {}).items():
        for name, v in variants.items():
            flops = "" if v["gflops_per_device"] is None else f"  {v['gflops_per_device']:.3f} GFLOP/device"
            vs_jit = f"  {v['ratio_vs_jit']:.3f}x jit" if "ratio_vs_jit" in v else " " * 12
            print(
                f"{model:11s} {name:33s} {v['samples_per_s']:9.0f} samples/s  {v['ratio_vs_ddp']:.3f}x ddp"
                f"{vs_jit}{flops}"
            )
        for name, base, ratio, bound, met in speed_goals(variants):
            base = "jit" if base == JIT else base
            print(f"{model:11s} goal {name} >= {bound}x {base}: {ratio:.3f}x, {'met' if met else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sizes", default="2,4,8", help="device counts of the memory table")
    parser.add_argument("--models", default="mlp,cnn,odd-mlp,transformer")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="a subset; ddp, the baseline, always runs")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="no temporaries at one row per device; only the layouts with goals; speed on the first of --sizes",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--markdown", type=Path, metavar="JSON", help="print the tables of a JSON this script wrote; runs nothing"
    )
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    models = args.models.split(",")
    names = ["ddp", *(name for name in args.strategies.split(",") if name != "ddp")]
    result = {
        **run_facts(),
        "global_batch": BATCH,
        "batch_per_model": {m: global_batch(m) for m in models},
        "memory": [
            row
            for m in models
            for n in map(int, args.sizes.split(","))
            for row in memory(m, n, names, small_batches=not args.smoke)
        ],
        "layouts": [row for m in models for row in layouts_memory(m, smoke=args.smoke)],
    }
    if not args.skip_speed:
        # The smoke setting times the memory table's first mesh: its programs are compiled already (the same
        # programs, found in the compilation cache where one is set).
        mesh = sc.data_mesh(devices=jax.devices()[: int(args.sizes.split(",")[0])]) if args.smoke else None
        result["speed"] = speed(models, names, args.rounds, args.steps, mesh=mesh)
        result["speed_devices"] = jax.device_count() if mesh is None else mesh.size
    print_tables(result)
    result["markdown"] = markdown(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
