"""Context parallelism: tokens/s and memory of a causal transformer LM with its sequences split over a ``context``
axis (ring and all-to-all attention), next to no split, at one global batch on 8 fake CPU devices; and the errors of
every shape that cannot split.

Run: ``python benchmarks/context.py [--lengths 64,128,256,512,1024] [--rounds 5] [--round-tokens 1024] [--variants
none,ring4,a2a4,ring8,a2a8] [--layers 2] [--json PATH]``.

The model: token embedding (vocabulary 256, width 128) plus sinusoidal features of the positions
``sc.context_positions`` gives, 2 pre-LayerNorm blocks of 8-head causal self-attention through ``sc.context_attention``
and an MLP 128-512-128, a final LayerNorm and a dense layer to the vocabulary; next-token cross-entropy, Adam, DDP
(the default strategy). The parameters are drawn with NumPy from their shapes (no compiled init). The global batch is
8 random sequences of ``T`` tokens (inputs and targets, separate leaves) for each length ``T``. Variants, all on the
same 8 devices:

- ``none``, "no split": ``data 8``, each device holding one whole sequence (plain attention);
- ``ring4`` and ``a2a4``, "data 2 x context 4, ring / all-to-all": 4 sequences per data group, each device holding
  ``T / 4`` tokens of each (zig-zag layout);
- ``ring8`` and ``a2a8``, "context 8, ring / all-to-all": ``data 1 x context 8``, ``T / 8`` tokens of every sequence.

At one global batch every variant does the same attention arithmetic per device (``T^2`` query/key pairs per head of
one row: one sequence whole; 4 quarter-sequences against 4 key blocks each; or ``h / c`` heads of 4 whole sequences),
the ring's backward pass computing each block's scores once more. What differs is the size of the blocks a device
computes at once, what it keeps, and what crosses the context axis.

Speed: the variants of one length are interleaved round by round (the order reversed every other round), each running
``round_tokens // T`` steps (at least one) per round on one placed batch, at most 8 steps in flight
(``_common.time_calls``); tokens/s is the median over rounds and every ratio (to no split, ring / all-to-all on one
mesh) the median of the per-round ratios. The losses of the 2 warm-up steps from the same parameters are compared with
no split's (``loss_max_rel_diff``: float round-off).

Memory and traffic, per device, from the compiled step (``sc.explain``): the temporaries XLA reserves
(``memory.temp_bytes``); the message bytes over the context axis, ``total_bytes(over="context")``
(``bytes_over_context``, which counts a collective inside a loop once) and per step (``bytes_over_context_per_step``,
by kind: the ring's permutes, inside its two scans of ``c - 1`` hops, counted ``c - 1`` times). The gradients'
all-reduce spans the context axis too; ``attention_bytes_per_step`` is the rest, what attention moves.

Errors: a sequence that does not split into the layout's chunks (``2c`` zig-zag, ``c`` contiguous), query heads that
the context size does not divide under all-to-all (the ring takes them; KV heads that it does not divide are
repeated), and a mesh without a context axis: the
error's type and message, and how many programs were lowered and compiled by the call that raised (0: the errors come
from tracing, before anything is compiled).

Where each wins on this machine (benchmarks/README.md has the table; about 3.5 minutes on 2 cores). The 8 fake
devices share 2 cores in one process, so the numbers show total work and memory traffic, not communication overlapped
with compute: a collective here is a copy between threads. No split is fastest at short sequences (64-128 tokens),
where the context collectives cost more than anything a split saves. From 256 tokens the ring is the fastest (3.1-3.3x
no split at 1024) and keeps the fewest temporaries (0.2-0.5x no split's): it computes ``T / c x T / c`` score blocks
that stay in cache, where no split and the all-to-all compute the whole ``T x T`` scores of a row and head and keep its
probabilities for the backward pass. The all-to-all sends the fewest bytes (0.2-0.8x the ring's) and beats the ring
at short sequences, but at the same global batch it keeps no split's temporaries and runs at about its speed: per
device it attends over whole sequences, only fewer heads of more of them.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import run_facts, set_cpu_devices, step_caller, time_calls, write_json

set_cpu_devices(8)  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spmdcomm as sc  # noqa: E402

BATCH, VOCAB, WIDTH, LAYERS, HEADS = 8, 256, 128, 2, 8
WARMUP = 2  # steps before timing; their losses are compared with no split's
NO_SPLIT = "no split"
# key -> (name, mesh axes, context split or None, attention algorithm)
VARIANTS = {
    "none": (NO_SPLIT, {"data": 8}, None, "ring"),  # outside a context split both algorithms are plain attention
    "ring4": ("data 2 x context 4, ring", {"data": 2, "context": 4}, sc.ContextParallel(), "ring"),
    "a2a4": ("data 2 x context 4, all-to-all", {"data": 2, "context": 4}, sc.ContextParallel(), "all_to_all"),
    "ring8": ("context 8, ring", {"data": 1, "context": 8}, sc.ContextParallel(), "ring"),
    "a2a8": ("context 8, all-to-all", {"data": 1, "context": 8}, sc.ContextParallel(), "all_to_all"),
}
PAIRS = {"data 2 x context 4": ("ring4", "a2a4"), "context 8": ("ring8", "a2a8")}  # (ring, all-to-all) on one mesh


def sinusoid(positions: jax.Array, width: int) -> jax.Array:
    """``[tokens, width]`` sine and cosine features of the global ``positions`` (any sequence length)."""
    rates = 1.0 / 10_000 ** (jnp.arange(width // 2) / (width // 2))
    angles = positions[:, None].astype(jnp.float32) * rates
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention (``heads`` query heads, ``kv_heads`` key/value heads) through
    ``sc.context_attention``, then an MLP of 4 x the width, each added to its input."""

    heads: int
    kv_heads: int
    algorithm: str

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        head = width // self.heads
        y = nn.LayerNorm()(x)
        split = lambda z, n: z.reshape(z.shape[:2] + (n, head))
        q = split(nn.Dense(width)(y), self.heads)
        k = split(nn.Dense(self.kv_heads * head)(y), self.kv_heads)
        v = split(nn.Dense(self.kv_heads * head)(y), self.kv_heads)
        y = sc.context_attention(q, k, v, causal=True, algorithm=self.algorithm)
        x = x + nn.Dense(width)(y.reshape(x.shape))
        return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))


class ContextLM(nn.Module):
    """The benchmark's language model (module docstring)."""

    algorithm: str = "ring"
    heads: int = HEADS
    kv_heads: int = HEADS
    layers: int = LAYERS

    @nn.compact
    def __call__(self, tokens):
        positions = sc.context_positions(tokens.shape[1])  # this device's tokens' global positions
        x = nn.Embed(VOCAB, WIDTH)(tokens) + sinusoid(positions, WIDTH)
        for _ in range(self.layers):
            x = Block(self.heads, self.kv_heads, self.algorithm)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    """Each sequence's mean next-token cross-entropy over this device's tokens, averaged over its real sequences."""
    logits = apply_fn({"params": params}, batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return sc.masked_mean(losses.mean(-1), mask)


def lm_data(length: int, seed: int = 0) -> dict[str, np.ndarray]:
    text = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, length + 1)).astype(np.int32)
    return {"inputs": text[:, :-1], "targets": text[:, 1:]}


def init_params(model: ContextLM) -> dict:
    """The model's parameters, drawn with NumPy from their shapes (no compiled init: quick for every model here):
    LayerNorm scales 1, biases 0, embeddings N(0, 0.02^2), kernels N(0, 1 / fan_in)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 16), jnp.int32))["params"]
    rng = np.random.default_rng(0)

    def draw(path, leaf) -> np.ndarray:
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(leaf.shape, np.float32)
        if "bias" in name:
            return np.zeros(leaf.shape, np.float32)
        std = 0.02 if "embedding" in name else leaf.shape[0] ** -0.5
        return (std * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, dict(shapes))


def make_state(key: str, params: dict, layers: int) -> sc.TrainState:
    _, axes, context, algorithm = VARIANTS[key]
    return sc.TrainState.create(
        params=params,
        apply_fn=ContextLM(algorithm, layers=layers).apply,
        tx=optax.adam(1e-3),
        mesh=sc.make_mesh(axes),
        context=context,
    )


# --- speed, memory, traffic ------------------------------------------------------------------------


def measure(length: int, keys: list[str], rounds: int, round_tokens: int, layers: int = LAYERS) -> list[dict]:
    """One row per variant of ``keys`` (the first is the baseline, no split) at sequence length ``length``: tokens/s,
    ratios, the compiled step's temporaries and bytes over the context axis, the first steps' losses. Each variant
    runs ``round_tokens // length`` steps (at least 1) per round."""
    steps = max(1, round_tokens // length)
    params = init_params(ContextLM(layers=layers))  # the same parameters for every variant
    batch = lm_data(length)
    step = sc.make_train_step(loss_fn)
    rows, runs = {}, {}
    for key in keys:
        t0 = time.perf_counter()
        name, axes, context, algorithm = VARIANTS[key]
        state = make_state(key, params, layers)
        report = sc.explain(step, state, batch)
        c = axes.get("context", 1)
        per_step: dict[str, int] = {}  # kind -> bytes per step: the ring's in-loop permutes run c - 1 times
        for x in report.collectives:
            if context is not None and x.axes and "context" in x.axes:
                per_step[x.kind] = per_step.get(x.kind, 0) + x.total_bytes * (c - 1 if x.in_loop else 1)
        call = step_caller(
            step, state, jax.device_put(batch, sc.data_sharding(mesh=state.mesh, axis=state.roles.batch))
        )
        losses = [float(call()["loss"]) for _ in range(WARMUP)]
        rows[key] = {
            "length": length,
            "variant": name,
            "mesh": dict(axes),
            "algorithm": None if context is None else algorithm,
            "temp_bytes": report.memory.temp_bytes,
            "argument_bytes": report.memory.argument_bytes,
            "bytes_over_context": report.total_bytes(over="context") if context is not None else 0,
            "bytes_over_context_per_step": sum(per_step.values()),
            "attention_bytes_per_step": sum(b for kind, b in per_step.items() if kind != "all-reduce"),
            "bytes_over_context_per_step_by_kind": per_step,
            "losses": losses,
            "steps_per_round": steps,
            "setup_s": time.perf_counter() - t0,
        }
        runs[key] = call
    base = np.array(rows[keys[0]]["losses"])
    for row in rows.values():
        row["loss_max_rel_diff"] = float(np.max(np.abs(np.array(row["losses"]) - base) / np.abs(base)))
    rates: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:  # reversed every other round: no order bias
            rates[key].append(BATCH * length * steps / time_calls(runs[key], steps))
    base = np.array(rates[keys[0]])
    for key, row in rows.items():
        own = np.array(rates[key])
        row["tokens_per_s"] = float(np.median(own))
        row["tokens_per_s_rounds"] = [float(x) for x in own]
        row["ratio_vs_no_split"] = float(np.median(own / base))
        row["temp_bytes_vs_no_split"] = row["temp_bytes"] / rows[keys[0]]["temp_bytes"]
    for ring, a2a in PAIRS.values():
        if ring in rates and a2a in rates:
            ratio = float(np.median(np.array(rates[ring]) / np.array(rates[a2a])))
            rows[ring]["ratio_ring_vs_all_to_all"] = rows[a2a]["ratio_ring_vs_all_to_all"] = ratio
    return list(rows.values())


# --- errors ----------------------------------------------------------------------------------------


class _Compiles:
    """Counts the programs JAX lowers and compiles (its monitoring events), to show where an error stops."""

    def __init__(self) -> None:
        self.lowered = self.compiled = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.lowered += 1
        elif event == "/jax/core/compile/backend_compile_duration":
            self.compiled += 1


def errors(length: int) -> list[dict]:
    """Each shape that cannot split, around ``length`` tokens: what it raises, and the programs lowered and compiled
    by the call that raised (the model has one block here: the errors come from its first attention); and the ring
    on the heads the all-to-all refuses, and the all-to-all on KV heads it repeats, traced and lowered."""
    bad = length + length // 2 + 4  # a multiple of 4, not of 8
    zigzag, contiguous = sc.ContextParallel(), sc.ContextParallel(layout="contiguous")
    split = {"data": 2, "context": 4}
    # (case, the documented error or None, mesh, context split, model, tokens)
    cases = [
        (f"{bad} tokens, zig-zag over context 4 (2c = 8 chunks)", "ShapeError", split, zigzag, ContextLM(), bad),
        (f"{bad + 2} tokens, contiguous over context 4", "ShapeError", split, contiguous, ContextLM(), bad + 2),
        ("2 heads, all-to-all over context 4", "ShapeError", split, zigzag, ContextLM("all_to_all", 2, 2), length),
        (
            "8 heads, 2 KV heads, all-to-all over context 4 (accepted: KV heads repeated)",
            None,
            split,
            zigzag,
            ContextLM("all_to_all", 8, 2),
            length,
        ),
        ("2 heads, ring over context 4 (accepted)", None, split, zigzag, ContextLM("ring", 2, 2), length),
        ("a mesh without a context axis", "AxisError", {"data": 8}, zigzag, ContextLM(), length),
    ]
    counter = _Compiles()
    step = sc.make_train_step(loss_fn)
    return [error_case(counter, step, *case) for case in cases]


def error_case(
    counter: _Compiles, step, what: str, expected, axes: dict, context, model: ContextLM, tokens: int
) -> dict:
    """One row of :func:`errors`: ``model`` (with one block) on ``axes`` with ``context``, a batch of ``tokens``."""
    model = model.clone(layers=1)
    row = {"case": what, "mesh": axes, "tokens": tokens, "heads": model.heads, "kv_heads": model.kv_heads}
    row.update(algorithm=model.algorithm, layout=context.layout, expected=expected)
    params, batch = init_params(model), lm_data(tokens)
    lowered, compiled = counter.lowered, counter.compiled
    try:
        mesh = sc.make_mesh(axes)
        state = sc.TrainState.create(params=params, apply_fn=model.apply, tx=optax.sgd(0.1), mesh=mesh, context=context)
        lowered, compiled = counter.lowered, counter.compiled  # from here on: the step alone
        if expected is None:
            step.lower(state, batch)  # traced and lowered: the ring takes these heads, the all-to-all repeats KV heads
        else:
            step(state, batch)
        row.update(raised=None, message=None)
    except sc.SpmdError as e:
        row.update(raised=type(e).__name__, message=str(e))
    row["as_documented"] = row["raised"] == expected
    row["programs_lowered"] = counter.lowered - lowered
    row["programs_compiled"] = counter.compiled - compiled
    return row


# --- report ----------------------------------------------------------------------------------------


def print_tables(result: dict) -> None:
    kib = 1024
    print(
        f"jax {result['jax']}, {result['cpu_cores']} cores, {result['devices']} devices, global batch {BATCH} "
        f"sequences; tokens/s (ratio to no split; ring / all-to-all), temporaries KiB (ratio to no split), "
        "KiB over the context axis per step, losses' max relative difference to no split"
    )
    for row in result["rows"]:
        ratio = f" ({row['ratio_vs_no_split']:.2f}x)" if "ratio_vs_no_split" in row else ""
        pair = f" r/a {row['ratio_ring_vs_all_to_all']:.2f}" if "ratio_ring_vs_all_to_all" in row else ""
        temps = f" ({row['temp_bytes_vs_no_split']:.2f}x)" if "temp_bytes_vs_no_split" in row else ""
        diff = f"  loss diff {row['loss_max_rel_diff']:.1e}" if "loss_max_rel_diff" in row else ""
        print(
            f"T={row['length']:5d} {row['variant']:31s} {row['tokens_per_s']:8.0f} tokens/s{ratio}{pair}"
            f"  temps {row['temp_bytes'] / kib:9.0f}{temps}  context {row['bytes_over_context_per_step'] / kib:7.0f}"
            f"{diff}"
        )
    for row in result["errors"]:
        verdict = "as documented" if row["as_documented"] else "NOT AS DOCUMENTED"
        print(
            f"{row['case']}: {row['raised'] or 'no error'} ({verdict}; lowered {row['programs_lowered']}, compiled "
            f"{row['programs_compiled']})"
        )
        if row["message"]:
            print(f"    {row['message']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,128,256,512,1024", help="sequence lengths, each a multiple of 16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a subset of these keys; none always runs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-tokens", type=int, default=1024, help="steps per round: this // length, at least 1")
    parser.add_argument("--layers", type=int, default=LAYERS, help="transformer blocks (1 for a quick check)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    keys = ["none", *(k for k in VARIANTS if k != "none" and k in args.variants.split(","))]
    lengths = [int(n) for n in args.lengths.split(",")]
    t0 = time.perf_counter()
    result = {
        **run_facts(),
        "model": {"vocab": VOCAB, "width": WIDTH, "layers": args.layers, "heads": HEADS, "optimizer": "adam"},
        "global_batch": BATCH,
        "rounds": args.rounds,
        "round_tokens": args.round_tokens,
        "rows": [
            row for length in lengths for row in measure(length, keys, args.rounds, args.round_tokens, args.layers)
        ],
        "errors": errors(min(lengths)),
    }
    result["seconds"] = time.perf_counter() - t0
    print_tables(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
