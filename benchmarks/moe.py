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

The LM step (``--lm``, on by default; ``--lm-only`` skips the layer): examples/lm's ``Transformer`` with a MoE MLP in
every block (``E`` experts, top-2, capacity factor 1.25 in both variants, so that they compute the same function),
one AdamW train step on ``8 * lm_windows`` windows of ``lm_length`` bytes:

- ``ours``: ``sc.make_train_step`` on a state over a mesh ``{"expert": 8}`` (the experts and the batch split over it);
- ``jit+NamedSharding gshard``: the same model with each ``sc.MoE`` replaced by the GShard one-hot einsum layer (the
  same parameters), ``jax.jit`` of the loss's gradient and the update with the experts placed ``P("expert")``, the
  batch ``P("expert")`` and XLA choosing the collectives.

Reported: tokens/s (interleaved rounds), the compiled temporaries per device, the all-to-all and all-gather bytes
per device, and the two steps' losses (equal within float32 rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from unittest import mock

from _common import jit_once, run_facts, set_cpu_devices, time_calls, write_json

set_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spmdcomm as sc  # noqa: E402
from spmdcomm.parallel.expert import expert_capacity, route  # noqa: E402

K, FACTOR = 2, 1.25
LM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "lm")


class Mlp(nn.Module):
    width: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, name="down")(nn.gelu(nn.Dense(self.hidden, name="up")(x)))


def gshard_moe(x, logits, experts, e, mesh):
    """The GShard layer a JAX user writes: one-hot dispatch and combine tensors ``[N, E, C]`` and einsums, the expert
    dimension split over ``expert`` by sharding constraints; ``experts`` maps ``[E, C, d]`` to ``[E, C, d]``.
    Returns the output ``[N, d]`` and the Switch/GShard load-balancing loss over the ``N`` tokens."""
    tokens = x.shape[0]
    r = route(logits, K)
    capacity = expert_capacity(tokens, e, K, FACTOR)
    onehot = jax.nn.one_hot(r.experts, e, dtype=jnp.int32)  # [N, k, E], first choices before second ones
    order = jnp.cumsum(onehot.transpose(1, 0, 2).reshape(-1, e), axis=0).reshape(K, tokens, e).transpose(1, 0, 2)
    slot = jnp.sum((order - 1) * onehot, axis=-1)  # [N, k]
    at = jax.nn.one_hot(slot, capacity)  # [N, k, C]: zeros past the capacity, the dropped assignments
    dispatch = jnp.einsum("nke,nkc->nec", onehot, at)
    combine = jnp.einsum("nk,nke,nkc->nec", r.weights, onehot, at)
    split = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, jax.P("expert")))
    out = split(experts(split(jnp.einsum("nec,nd->ecd", dispatch, x))))
    balance = e * jnp.sum(onehot.sum((0, 1)) / (tokens * K) * r.probs.mean(0))
    return jnp.einsum("nec,ecd->nd", combine, out).astype(x.dtype), balance


def variants(args, mesh):
    mlp = Mlp(args.width, args.hidden)
    tok = jax.P("expert")
    specs = {"router": jax.P(), "experts": jax.P("expert")}

    def ours(capacity_factor):
        layer = sc.MoE(mlp, experts=args.experts, k=K, capacity_factor=capacity_factor, axis_name="expert")
        apply = lambda p, x: layer.apply({"params": p}, x)
        return jax.shard_map(apply, mesh=mesh, in_specs=(specs, tok), out_specs=tok)

    def gshard(p, x):
        up, down = p["experts"]["up"], p["experts"]["down"]
        experts = lambda a: nn.gelu(a @ up["kernel"] + up["bias"][:, None]) @ down["kernel"] + down["bias"][:, None]
        return gshard_moe(x, x @ p["router"], experts, args.experts, mesh)[0]

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


class GShardMoE(nn.Module):
    """``sc.MoE``'s parameters and call (as examples/lm builds it), computed by :func:`gshard_moe` in the global
    view; it sows the load-balancing loss into ``"moe"`` as ``sc.MoE`` does."""

    expert: nn.Module
    experts: int
    k: int = K
    mesh: object = None

    @nn.compact
    def __call__(self, x, mask=None):
        assert mask is None, "unpacked windows only: every token routed"
        h = x.reshape(-1, x.shape[-1])
        router = self.param("router", nn.initializers.normal(0.02), (h.shape[-1], self.experts), jnp.float32)
        expert = self.expert.clone(parent=None)
        params = self.param("experts", lambda key: None)  # the parameters come from sc.MoE's init
        run = lambda buf: jax.vmap(lambda p, rows: expert.apply({"params": p}, rows))(params, buf)
        y, balance = gshard_moe(h, h.astype(jnp.float32) @ router, run, self.experts, self.mesh)
        self.sow("moe", "load_balancing_loss", balance)
        return y.reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def moe_layer(layer):
    """examples/lm's blocks build ``layer`` where they name ``sc.MoE`` (while a model is built and traced)."""
    with mock.patch.object(sc, "MoE", layer):
        yield


def lm_step(args, mesh):
    """The LM step's rows: ours against the jit + NamedSharding GShard step (module docstring)."""
    sys.path.insert(0, LM)
    import models  # examples/lm/models.py

    rows, length = 8 * args.lm_windows, args.lm_length
    model = models.Transformer(
        width=args.lm_width, layers=args.lm_layers, heads=4, max_len=length, experts=args.experts
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (rows, length + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    tx = optax.adamw(1e-3)
    ours_moe = functools.partial(sc.MoE, capacity_factor=FACTOR)
    with moe_layer(ours_moe):
        params = _init(model, batch["inputs"][:1])
        state = sc.TrainState.create(
            params=params,
            tx=tx,
            apply_fn=model.apply,
            mesh=mesh,
            logical_axis_rules=models.logical_axis_rules(mesh.axis_names),
        )
        step = sc.make_train_step(models.make_loss_fn(), donate=False)
        report = sc.explain(step, state, batch)
        _, ours_metrics = step(state, batch)

    def objective(apply_fn, p, batch):
        loss, _, real, balance = models.token_sums(apply_fn, p, batch, jnp.ones(rows, bool))
        return loss / real + models.BALANCE * balance

    plain = nn.unbox(params)
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    is_expert = lambda path: any(getattr(k, "key", None) == "experts" for k in path)
    placed = jax.tree_util.tree_map_with_path(lambda q, v: put(v, jax.P("expert") if is_expert(q) else jax.P()), plain)
    with moe_layer(functools.partial(GShardMoE, mesh=mesh)):

        @jax.jit
        def gshard_step(p, opt, batch):
            loss, grads = jax.value_and_grad(lambda p: objective(model.apply, p, batch))(p)
            updates, opt = tx.update(grads, opt, p)
            return optax.apply_updates(p, updates), opt, loss

        opt = jax.jit(tx.init)(placed)
        data = jax.tree.map(lambda a: put(a, jax.P("expert")), batch)
        compiled = gshard_step.lower(placed, opt, data).compile()
        gshard_loss = float(compiled(placed, opt, data)[2])
    theirs = sc.explain(compiled, mesh=mesh)
    calls = {"ours": lambda: step(state, batch), "jit+NamedSharding gshard": lambda: compiled(placed, opt, data)}
    times = _interleaved(calls, args.rounds, args.steps)
    out = []
    for name, rep, temp, loss in [
        ("ours", report, report.memory.temp_bytes, float(ours_metrics["loss"])),
        ("jit+NamedSharding gshard", theirs, compiled.memory_analysis().temp_size_in_bytes, gshard_loss),
    ]:
        out.append(
            {
                "variant": name,
                "tokens_per_s": rows * length * args.steps / float(np.median(times[name])),
                "temp_bytes": temp,
                "collective_bytes": _by_kind(rep),
                "loss": loss,
            }
        )
    for row in out:
        row["speed_vs_ours"] = row["tokens_per_s"] / out[0]["tokens_per_s"]
    return out


def _init(module, x):
    """``module``'s parameters for an input like ``x``, in one program (``jit_once``): only the parameters are kept
    (``mutable``), so XLA drops the forward pass that ``init`` traces (and the MoE layers' sown losses). On the host:
    placing one device's arrays on a sharded layout compiles a slicing program per leaf; host arrays need none."""
    return jax.device_get(jit_once(functools.partial(module.init, mutable=["params"]))(jax.random.key(0), x)["params"])


def _output_and_loss(fn, cotangent):
    """``(p, x) -> (sum(fn(p, x) * cotangent), fn(p, x))``: the objective and, as auxiliary output, the layer's."""

    def loss(p, x):
        y = fn(p, x)
        return jnp.sum(y * cotangent), y

    return loss


def _by_kind(report):
    by_kind: dict[str, int] = {}
    for c in report.collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.total_bytes
    return by_kind


def _interleaved(calls, rounds, steps):
    """Seconds of ``steps`` calls of each, the variants interleaved over ``rounds`` (order reversed every other)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls) if r % 2 == 0 else list(reversed(calls)):
            calls[name]()
            times[name].append(time_calls(calls[name], steps))
    return times


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
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that everything runs")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.width, args.hidden, args.rounds, args.steps = 16, 16, 32, 1, 1
        args.lm_windows, args.lm_length, args.lm_width, args.lm_layers = 1, 16, 32, 1
    mesh = sc.make_mesh({"expert": args.devices}, devices=jax.devices()[: args.devices])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.devices * args.tokens, args.width)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    layer = sc.MoE(Mlp(args.width, args.hidden), experts=args.experts, k=K)
    params = nn.unbox(_init(layer, x[:1]))  # the arrays, without the logical names
    placed = {
        "router": jax.device_put(params["router"], NamedSharding(mesh, jax.P())),
        "experts": jax.device_put(params["experts"], NamedSharding(mesh, jax.P("expert"))),
    }
    xs, cots = (jax.device_put(a, NamedSharding(mesh, jax.P("expert"))) for a in (x, cot))
    # The one-device layer, dropless and with the capacity rule, in one program.
    factors = (None, FACTOR)
    outputs = jax.jit(
        lambda p, x: [
            sc.MoE(Mlp(args.width, args.hidden), experts=args.experts, k=K, capacity_factor=cf).apply({"params": p}, x)
            for cf in factors
        ]
    )(params, x)
    reference = dict(zip(factors, outputs, strict=True))
    programs, rows = {}, []
    for name, fn in variants(args, mesh).items():
        # The step returns the layer's output beside the gradients: the comparison below needs no second program.
        step = jax.jit(lambda p, x, c, fn=fn: jax.value_and_grad(_output_and_loss(fn, c), (0, 1), has_aux=True)(p, x))
        compiled = step.lower(placed, xs, cots).compile()
        by_kind = _by_kind(sc.explain(compiled, mesh=mesh))
        y = compiled(placed, xs, cots)[0][1]
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
    calls = {name: lambda name=name: programs[name](placed, xs, cots) for name in programs}
    times = _interleaved(calls, args.rounds, args.steps)
    tokens = args.devices * args.tokens
    for row in rows:
        row["tokens_per_s"] = tokens * args.steps / float(np.median(times[row["variant"]]))
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_ours_dropless"] = row["tokens_per_s"] / base
    lm = [] if args.skip_lm else lm_step(args, mesh)
    args_kept = {k: v for k, v in vars(args).items() if k != "json"}  # the output's path is this machine's
    result = {**run_facts(), "args": args_kept, "expert_param_bytes": expert_bytes, "rows": rows, "lm": lm}
    print(f"expert parameters: {expert_bytes['per_device']} bytes per device of {expert_bytes['all']}")
    print(f"{'variant':30} {'tokens/s':>10} {'vs dropless':>11} {'temp MB':>8} {'max diff':>9}  collectives (bytes)")
    for row in rows:
        print(
            f"{row['variant']:30} {row['tokens_per_s']:10.0f} {row['speed_vs_ours_dropless']:11.2f} "
            f"{row['temp_bytes'] / 2**20:8.2f} {row['max_abs_diff_to_one_device']:9.1e}  {row['collective_bytes']}"
        )
    if lm:
        print(
            f"LM step (experts over {args.devices} devices): {'tokens/s':>10} {'vs ours':>8} {'temp MB':>8} {'loss':>9}"
        )
        for row in lm:
            print(
                f"  {row['variant']:27} {row['tokens_per_s']:10.0f} {row['speed_vs_ours']:8.2f} "
                f"{row['temp_bytes'] / 2**20:8.2f} {row['loss']:9.6f}  {row['collective_bytes']}"
            )
    write_json(args.json, result)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
