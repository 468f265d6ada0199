"""Expert parallelism: a mixture-of-experts layer's forward and backward pass on 8 fake CPU devices, ``sc.MoE`` with its
experts split over an ``expert`` axis against the programs a JAX user writes instead; and the MoE LM's train step
against the dense LMs with its active and its total parameters.

Run: ``python benchmarks/moe.py [--tokens 256] [--experts 8] [--width 128] [--hidden 256] [--rounds 5] [--steps 4]
[--skip-lm | --lm-only] [--smoke] [--json PATH]``.

The layer: ``E`` experts, each a GELU MLP ``width -> hidden -> width``, top-2 routing (softmax then top-k), a global
batch of ``8 * tokens`` tokens of ``width`` features. Each variant computes the layer's output and the gradients of
``sum(y * cotangent)`` with respect to the router, the experts and the input, on the same 8 devices:

- ``ours dropless``: ``sc.MoE(axis_name="expert")`` (grouped, the default) inside ``jax.shard_map``, each device
  holding ``E / 8`` experts and ``tokens`` tokens; the tokens move with two ``sc.ragged_all_to_all`` (the padded
  implementation on CPU) and its transposes, and each local expert runs on the rows it received (tiles of rows
  sorted by expert, a scan that skips the empty tiles);
- ``ours dropless buffer``: the same with ``grouped=False``: each local expert runs on a static buffer of every
  token of the expert axis (``8 * tokens`` rows, ``E / k`` times the routed rows);
- ``ours capacity 1.25``: grouped, with the capacity rule (one capacity over the global batch);
- ``gshard einsum, per-device groups, capacity 1.25``: the GShard paper's program under ``jax.jit`` with
  ``NamedSharding``: each device's tokens one group with its own capacity, one-hot dispatch and combine tensors
  ``[G, S, E, C]`` and einsums, the groups and then the experts split over ``expert`` (``with_sharding_constraint``),
  XLA choosing the collectives. It drops other assignments than ours (a capacity per group): it is compared with the
  one-device layer run on each device's tokens with capacity 1.25;
- ``gshard einsum, one global capacity 1.25``: the same einsums with one group, the global batch (our capacity
  rule: it drops what ``ours capacity 1.25`` drops);
- ``all-gather experts``: every device all-gathers every expert's weights and runs its own tokens through their
  experts on its own (the one-device layer), the gradients reduce-scattered back.

Reported per variant: tokens/s and ms per call (the median over rounds, the variants interleaved, at most 8 calls in
flight), the compiled program's temporaries per device (``memory_analysis().temp_size_in_bytes``), its all-to-all
and all-gather bytes per device (``sc.explain``), the counted matmul FLOPs summed over the devices
(``sc.explain(...).flops_total``; ``flops_bound``: exact, or an upper bound where a ``lax.cond`` counts at its largest
branch), the expert matmuls' FLOPs against the routed rows' ``2 * 3 * k * N * (2 width hidden)`` (forward and
backward; the grouped scan counted at its static bound, every tile; ``executed_expert_flops_vs_routed``: each tile
counted as often as it runs for this routing, ``Work.weighted``), the expert parameter bytes each device holds
(measured on the placed arrays: 1/8 of the experts for the split variants), and the output's largest difference from
the one-device layer.

The LM steps (``--skip-lm`` leaves them out, ``--lm-only`` the layer): examples/lm's ``Transformer``, AdamW, one
``sc.make_train_step`` step on ``8 * lm_windows`` windows of ``lm_length`` bytes, the rows interleaved:

- ``lm``: the MoE LM (every block's MLP ``E`` experts of ``4 * lm_width`` hidden units, top-2, dropless, grouped) on
  ``{"data": 8}`` (every expert on every device), and, beyond the smoke setting, on ``{"expert": 8}`` and
  ``{"data": 2, "expert": 4}``; the dense LM with the same active parameters (MLP hidden ``k * 4 * lm_width``: the
  same matmul work per token as the k experts, the router's aside) and the dense LM with the same total parameters
  (MLP hidden ``E * 4 * lm_width``), both on ``{"data": 8}``. Reported: tokens/s, the MoE's time over each dense
  LM's (``time_vs_dense_active``, ``time_vs_dense_total``), the counted FLOPs and their ratios
  (``flops_vs_dense_active``, ``flops_vs_dense_total``), parameters, temporaries, collective bytes, losses;
- ``lm_gshard``: ours (capacity 1.25, ``{"expert": 8}``) against the same model with each ``sc.MoE`` replaced by
  the GShard one-hot einsum layer (one global capacity 1.25, the same parameters and function), ``jax.jit`` of the
  loss's gradient and the update with the experts placed ``P("expert")`` and XLA choosing the collectives: tokens/s,
  temporaries, collective bytes, FLOPs and the two losses (equal within float32 rounding).

``breakdown`` (beyond the smoke setting, with the LM): where the layer's time goes, forward and forward + backward
(ms per call, interleaved) at two settings: the layer section's (``expert`` 8), grouped and buffer; and one MoE MLP of
the LM's ``{"data": 8}`` step (every expert local), grouped, buffer, grouped with an expert that does no matmul (the
routing, sorting and scan alone) and the dense MLP with the same active parameters.

``--smoke`` runs tiny sizes, one round of one step, and the LM's MoE on ``{"data": 8}`` only; its programs compile
without XLA:CPU's backend optimisation (a third less compile time).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from _common import run_facts, set_cpu_devices, write_json

if "--smoke" in sys.argv[1:] and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # The smoke run checks that everything runs: its programs compile without XLA:CPU's backend optimisation, as
    # _common.jit_once's do (a third less compile time; the values agree within float32 rounding).
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
set_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _moe import (  # noqa: E402
    FACTOR,
    K,
    Mlp,
    breakdown_rows,
    by_kind,
    gshard_moe,
    init_params,
    interleaved,
    lm_gshard_rows,
    lm_models,
    lm_rows,
    work,
)

import spmdcomm as sc  # noqa: E402
from spmdcomm.parallel.expert import expert_capacity, route  # noqa: E402
from spmdcomm.parallel.expert.grouped import tile_rows  # noqa: E402


def variants(args, mesh):
    """The layer's variants (module docstring), each ``(params, x) -> y`` over the 8 devices, with the one-device
    layer it must equal: ``None`` dropless, ``FACTOR`` one global capacity, ``"groups"`` a capacity per device."""
    mlp = Mlp(args.width, args.hidden)
    tok = jax.P("expert")
    specs = {"router": jax.P(), "experts": jax.P("expert")}

    def ours(capacity_factor, grouped=True):
        layer = sc.MoE(
            mlp, experts=args.experts, k=K, capacity_factor=capacity_factor, axis_name="expert", grouped=grouped
        )
        apply = lambda p, x: layer.apply({"params": p}, x)
        return jax.shard_map(apply, mesh=mesh, in_specs=(specs, tok), out_specs=tok)

    def gshard(groups):
        def fn(p, x):
            up, down = p["experts"]["up"], p["experts"]["down"]
            experts = lambda a: nn.gelu(a @ up["kernel"] + up["bias"][:, None]) @ down["kernel"] + down["bias"][:, None]
            return gshard_moe(x, x @ p["router"], experts, args.experts, mesh, groups)[0]

        return fn

    def gathered():
        layer = sc.MoE(mlp, experts=args.experts, k=K)

        def body(p, x):
            whole = {"router": p["router"], "experts": sc.all_gather(p["experts"], "expert")}
            return layer.apply({"params": whole}, x)

        return jax.shard_map(body, mesh=mesh, in_specs=(specs, tok), out_specs=tok)

    return {
        "ours dropless": (ours(None), None),
        "ours dropless buffer": (ours(None, grouped=False), None),
        "ours capacity 1.25": (ours(FACTOR), FACTOR),
        "gshard einsum, per-device groups, capacity 1.25": (gshard(args.devices), "groups"),
        "gshard einsum, one global capacity 1.25": (gshard(1), FACTOR),
        "all-gather experts": (gathered(), None),
    }


def executed_flops(report, x, params, args, capacity_factor):
    """Ours' counted FLOPs with each grouped-expert tile counted as often as it runs, not at the static bound: the
    share of the scan's tiles that hold rows (``lax.cond`` skips the others), the mean over the devices for this
    routing. None for a program without grouped tiles."""
    conds = [c for c in report.work.conditionals if "grouped_experts" in c.scope]
    if not conds:
        return None
    n, local, tokens = args.devices, args.experts // args.devices, args.tokens
    assigned = np.asarray(route(jnp.asarray(x) @ params["router"], K).experts)
    counts = np.bincount(assigned.reshape(-1), minlength=args.experts)
    bound = n * tokens * K
    if capacity_factor is not None:  # each expert keeps at most the capacity (global assignments, global order)
        capacity = expert_capacity(n * tokens, args.experts, K, capacity_factor)
        counts, bound = np.minimum(counts, capacity), min(bound, local * capacity)
    else:
        bound = min(bound, local * n * tokens)
    tile = tile_rows(tokens * K, local)
    tiles = -(-bound // tile) + local
    ran = -(-counts // tile)  # tiles per expert; a device runs its local experts'
    share = ran.reshape(n, local).sum(1).mean() / tiles
    return report.work.weighted({c.name: (1 - share, share) for c in conds}).total


def _output_and_loss(fn, cotangent):
    """``(p, x) -> (sum(fn(p, x) * cotangent), fn(p, x))``: the objective and, as auxiliary output, the layer's."""

    def loss(p, x):
        y = fn(p, x)
        return jnp.sum(y * cotangent), y

    return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lm-windows", type=int, default=4, help="LM step: windows per device")
    parser.add_argument("--lm-length", type=int, default=64)
    parser.add_argument("--lm-width", type=int, default=64)
    parser.add_argument("--lm-layers", type=int, default=2)
    parser.add_argument("--skip-lm", action="store_true", help="the layer only")
    parser.add_argument("--lm-only", action="store_true", help="the LM steps only")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that everything runs")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.width, args.hidden, args.rounds, args.steps = 16, 16, 32, 1, 1
        args.lm_windows, args.lm_length, args.lm_width, args.lm_layers = 1, 16, 32, 1
    rows, expert_bytes = ([], None) if args.lm_only else layer_rows(args)
    lm, lm_gshard = [], []
    if not args.skip_lm:
        models = lm_models(args)  # examples/lm's module, its MoE LM and the parameters every MoE variant starts from
        lm, lm_gshard = lm_rows(args, args.devices, *models), lm_gshard_rows(args, args.devices, *models)
    breakdown = [] if args.smoke or args.skip_lm or args.lm_only else breakdown_rows(args, args.devices)
    args_kept = {k: v for k, v in vars(args).items() if k != "json"}  # the output's path is this machine's
    result = {
        **run_facts(),
        "args": args_kept,
        "expert_param_bytes": expert_bytes,
        "rows": rows,
        "lm": lm,
        "lm_gshard": lm_gshard,
        "breakdown": breakdown,
    }
    if rows:
        print(f"expert parameters: {expert_bytes['per_device']} bytes per device of {expert_bytes['all']}")
        print(
            f"{'layer variant':48} {'tokens/s':>9} {'vs dropless':>11} {'temp MB':>8} {'max diff':>8} "
            f"{'GFLOP':>7} {'experts/routed':>14} {'run/routed':>10}  collectives (bytes)"
        )
    for row in rows:
        ran = row["executed_expert_flops_vs_routed"]
        ran = "" if ran is None else f"{ran:.2f}"
        print(
            f"{row['variant']:48} {row['tokens_per_s']:9.0f} {row['speed_vs_ours_dropless']:11.2f} "
            f"{row['temp_bytes'] / 2**20:8.2f} {row['max_abs_diff_to_one_device']:8.1e} "
            f"{row['flops_total'] / 1e9:7.2f} {row['expert_flops_vs_routed']:14.2f} {ran:>10}  "
            f"{row['collective_bytes']}"
        )
    if lm:
        print(
            f"LM step {'':32} {'tokens/s':>9} {'time/active':>11} {'time/total':>10} {'GFLOP':>7} "
            f"{'flops/active':>12} {'flops/total':>11} {'temp MB':>8} {'loss':>8}"
        )
    for row in lm:
        print(
            f"  {row['variant']:38} {row['tokens_per_s']:9.0f} {row['time_vs_dense_active']:11.2f} "
            f"{row['time_vs_dense_total']:10.2f} {row['flops_total'] / 1e9:7.2f} {row['flops_vs_dense_active']:12.2f} "
            f"{row['flops_vs_dense_total']:11.2f} {row['temp_bytes'] / 2**20:8.2f} {row['loss']:8.5f}"
        )
    if lm_gshard:
        print(f"LM step, capacity 1.25, experts over {args.devices} devices: tokens/s, vs ours, temp MB, loss")
    for row in lm_gshard:
        print(
            f"  {row['variant']:38} {row['tokens_per_s']:9.0f} {row['speed_vs_ours']:8.2f} "
            f"{row['temp_bytes'] / 2**20:8.2f} {row['loss']:9.6f}  {row['collective_bytes']}"
        )
    if breakdown:
        print("where the layer's time goes (ms per call):           forward  fwd+bwd")
    for row in breakdown:
        print(f"  {row['setting']:9} {row['variant']:40} {row['forward_ms']:8.2f} {row['forward+backward_ms']:8.2f}")
    write_json(args.json, result)


def layer_rows(args):
    """The layer's rows (module docstring) and the expert parameter bytes per device and in all."""
    mesh = sc.make_mesh({"expert": args.devices}, devices=jax.devices()[: args.devices])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.devices * args.tokens, args.width)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    mlp = Mlp(args.width, args.hidden)
    params = nn.unbox(init_params(sc.MoE(mlp, experts=args.experts, k=K), x[:1]))  # the arrays, no logical names
    placed = {
        "router": jax.device_put(params["router"], NamedSharding(mesh, jax.P())),
        "experts": jax.device_put(params["experts"], NamedSharding(mesh, jax.P("expert"))),
    }
    xs, cots = (jax.device_put(a, NamedSharding(mesh, jax.P("expert"))) for a in (x, cot))

    # The one-device layer: dropless, with one global capacity, and with a capacity per device's tokens.
    def one_device(p, x):
        layer = lambda cf: functools.partial(
            sc.MoE(mlp, experts=args.experts, k=K, capacity_factor=cf).apply, {"params": p}
        )
        groups = jax.vmap(layer(FACTOR))(x.reshape(args.devices, args.tokens, -1)).reshape(x.shape)
        return [layer(None)(x), layer(FACTOR)(x), groups]

    reference = dict(zip((None, FACTOR, "groups"), jax.jit(one_device)(params, x), strict=True))
    routed = 2 * 3 * K * len(x) * (2 * args.width * args.hidden)  # the routed rows' expert matmuls, fwd + bwd
    programs, rows = {}, []
    for name, (fn, want) in variants(args, mesh).items():
        # The step returns the layer's output beside the gradients: the comparison below needs no second program.
        step = jax.jit(lambda p, x, c, fn=fn: jax.value_and_grad(_output_and_loss(fn, c), (0, 1), has_aux=True)(p, x))
        compiled = step.lower(placed, xs, cots).compile()
        report = sc.explain(compiled, mesh=mesh)
        y = compiled(placed, xs, cots)[0][1]
        counted = work(report)
        ran = executed_flops(report, x, params, args, None if want is None else FACTOR) if "ours" in name else None
        rows.append(
            {
                "variant": name,
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "collective_bytes": by_kind(report),
                "max_abs_diff_to_one_device": float(np.abs(np.asarray(y) - np.asarray(reference[want])).max()),
                **counted,
                "routed_expert_flops": routed,
                "expert_flops_vs_routed": (counted["expert_flops"] or counted["flops_total"]) / routed,
                "executed_expert_flops_vs_routed": None if ran is None else ran / routed,
            }
        )
        programs[name] = compiled
    expert_bytes = {
        "per_device": sum(
            s.data.nbytes for leaf in jax.tree.leaves(placed["experts"]) for s in leaf.addressable_shards[:1]
        ),
        "all": sum(leaf.nbytes for leaf in jax.tree.leaves(placed["experts"])),
    }
    calls = {name: lambda name=name: programs[name](placed, xs, cots) for name in programs}
    times = interleaved(calls, args.rounds, args.steps)
    for row in rows:
        row["tokens_per_s"] = len(x) * args.steps / float(np.median(times[row["variant"]]))
        row["ms_per_call"] = 1e3 * float(np.median(times[row["variant"]])) / args.steps
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_ours_dropless"] = row["tokens_per_s"] / base
    return rows, expert_bytes


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
