"""Expert parallelism: a mixture-of-experts layer's forward and backward pass on 8 fake CPU devices, ``sc.MoE`` with its
experts split over an ``expert`` axis against the two programs a JAX user writes instead.

Run: ``python benchmarks/moe.py [--tokens 256] [--experts 8] [--width 128] [--hidden 256] [--rounds 5] [--steps 4]
[--smoke] [--json PATH]``.

The layer: ``E`` experts, each a GELU MLP ``width -> hidden -> width``, top-2 routing (softmax then top-k), a global
batch of ``8 * tokens`` tokens of ``width`` features. Each variant computes the layer's output and the gradients of
``sum(y * cotangent)`` with respect to the router, the experts and the input, on the same 8 devices:

- ``ours dropless`` / ``ours capacity 1.25``: ``sc.MoE(axis_name="expert")`` inside ``jax.shard_map``, each device
  holding ``E / 8`` experts and ``tokens`` tokens; the tokens move with two ``sc.ragged_all_to_all`` (the padded
  implementation on CPU) and its transposes;
- ``gshard einsum capacity 1.25``: the GShard program under ``jax.jit`` with ``NamedSharding``: one-hot dispatch and
  combine tensors ``[N, E, C]`` and einsums, the expert dimension of the weights and of the dispatched tokens split
  over ``expert`` (``with_sharding_constraint``), XLA choosing the collectives;
- ``all-gather experts``: every device all-gathers every expert's weights and runs its own tokens through their
  experts on its own (the one-device layer), the gradients reduce-scattered back.

Reported per variant: tokens/s (the median over rounds, the variants interleaved, at most 8 calls in flight), the
compiled program's temporaries per device (``memory_analysis().temp_size_in_bytes``), its all-to-all and all-gather
bytes per device (``sc.explain``), the expert parameter bytes each device holds (measured on the placed arrays: 1/8 of
the experts for the split variants), and the output's largest difference from the one-device layer (the GShard
variant, which drops by its own capacity rule, is compared with ``ours capacity``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import run_facts, set_cpu_devices, time_calls, write_json

set_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spmdcomm as sc  # noqa: E402
from spmdcomm.parallel.expert import expert_capacity, route  # noqa: E402

K, FACTOR = 2, 1.25


class Mlp(nn.Module):
    width: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, name="down")(nn.gelu(nn.Dense(self.hidden, name="up")(x)))


def variants(args, mesh):
    mlp = Mlp(args.width, args.hidden)
    tok = jax.P("expert")
    specs = {"router": jax.P(), "experts": jax.P("expert")}

    def ours(capacity_factor):
        layer = sc.MoE(mlp, experts=args.experts, k=K, capacity_factor=capacity_factor, axis_name="expert")
        apply = lambda p, x: layer.apply({"params": p}, x)
        return jax.shard_map(apply, mesh=mesh, in_specs=(specs, tok), out_specs=tok)

    def gshard(p, x):
        e, tokens = args.experts, x.shape[0]
        r = route(x @ p["router"], K)
        capacity = expert_capacity(tokens, e, K, FACTOR)
        onehot = jax.nn.one_hot(r.experts, e, dtype=jnp.int32)  # [N, k, E], first choices before second ones
        order = jnp.cumsum(onehot.transpose(1, 0, 2).reshape(-1, e), axis=0).reshape(K, tokens, e).transpose(1, 0, 2)
        slot = jnp.sum((order - 1) * onehot, axis=-1)  # [N, k]
        at = jax.nn.one_hot(slot, capacity)  # [N, k, C]: zeros past the capacity, the dropped assignments
        dispatch = jnp.einsum("nke,nkc->nec", onehot, at)
        combine = jnp.einsum("nk,nke,nkc->nec", r.weights, onehot, at)
        split = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, jax.P("expert")))
        inputs = split(jnp.einsum("nec,nd->ecd", dispatch, x))
        w = p["experts"]
        h = nn.gelu(jnp.einsum("ecd,edh->ech", inputs, w["up"]["kernel"]) + w["up"]["bias"][:, None])
        out = split(jnp.einsum("ech,ehd->ecd", h, w["down"]["kernel"]) + w["down"]["bias"][:, None])
        return jnp.einsum("nec,ecd->nd", combine, out)

    def gathered():
        layer = sc.MoE(mlp, experts=args.experts, k=K)

        def body(p, x):
            whole = {"router": p["router"], "experts": sc.all_gather(p["experts"], "expert")}
            return layer.apply({"params": whole}, x)

        return jax.shard_map(body, mesh=mesh, in_specs=(specs, tok), out_specs=tok)

    return {
        "ours dropless": ours(None),
        "ours capacity 1.25": ours(FACTOR),
        "gshard einsum capacity 1.25": gshard,
        "all-gather experts": gathered(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that everything runs")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.width, args.hidden, args.rounds, args.steps = 16, 16, 32, 1, 1
    mesh = sc.make_mesh({"expert": args.devices}, devices=jax.devices()[: args.devices])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.devices * args.tokens, args.width)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    layer = sc.MoE(Mlp(args.width, args.hidden), experts=args.experts, k=K)
    params = nn.unbox(layer.init(jax.random.key(0), x[:1])["params"])  # the arrays, without the logical names
    placed = {
        "router": jax.device_put(params["router"], NamedSharding(mesh, jax.P())),
        "experts": jax.device_put(params["experts"], NamedSharding(mesh, jax.P("expert"))),
    }
    xs, cots = (jax.device_put(a, NamedSharding(mesh, jax.P("expert"))) for a in (x, cot))
    reference = {
        cf: sc.MoE(Mlp(args.width, args.hidden), experts=args.experts, k=K, capacity_factor=cf).apply(
            {"params": params}, x
        )
        for cf in (None, FACTOR)
    }
    programs, rows = {}, []
    for name, fn in variants(args, mesh).items():
        step = jax.jit(lambda p, x, c, fn=fn: jax.value_and_grad(lambda p, x: jnp.sum(fn(p, x) * c), (0, 1))(p, x))
        compiled = step.lower(placed, xs, cots).compile()
        report = sc.explain(compiled, mesh=mesh)
        by_kind: dict[str, int] = {}
        for c in report.collectives:
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.total_bytes
        y = jax.jit(fn)(placed, xs)
        want = reference[None if name == "ours dropless" or name == "all-gather experts" else FACTOR]
        rows.append(
            {
                "variant": name,
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "collective_bytes": by_kind,
                "max_abs_diff_to_one_device": float(np.abs(np.asarray(y) - np.asarray(want)).max()),
            }
        )
        programs[name] = compiled
    expert_bytes = {
        "per_device": sum(
            s.data.nbytes for leaf in jax.tree.leaves(placed["experts"]) for s in leaf.addressable_shards[:1]
        ),
        "all": sum(leaf.nbytes for leaf in jax.tree.leaves(placed["experts"])),
    }
    times: dict[str, list[float]] = {name: [] for name in programs}
    for r in range(args.rounds):
        order = list(programs) if r % 2 == 0 else list(reversed(programs))
        for name in order:
            call = lambda name=name: programs[name](placed, xs, cots)
            call()
            times[name].append(time_calls(call, args.steps))
    tokens = args.devices * args.tokens
    for row in rows:
        row["tokens_per_s"] = tokens * args.steps / float(np.median(times[row["variant"]]))
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_ours_dropless"] = row["tokens_per_s"] / base
    result = {**run_facts(), "args": vars(args), "expert_param_bytes": expert_bytes, "rows": rows}
    print(f"expert parameters: {expert_bytes['per_device']} bytes per device of {expert_bytes['all']}")
    print(f"{'variant':30} {'tokens/s':>10} {'vs dropless':>11} {'temp MB':>8} {'max diff':>9}  collectives (bytes)")
    for row in rows:
        print(
            f"{row['variant']:30} {row['tokens_per_s']:10.0f} {row['speed_vs_ours_dropless']:11.2f} "
            f"{row['temp_bytes'] / 2**20:8.2f} {row['max_abs_diff_to_one_device']:9.1e}  {row['collective_bytes']}"
        )
    write_json(args.json, result)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
