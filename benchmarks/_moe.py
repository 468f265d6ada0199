"""benchmarks/moe.py's shared pieces and its LM section (:func:`lm_rows`, :func:`lm_gshard_rows`); the module
docstring of moe.py describes the variants. Import it after ``set_cpu_devices`` (it imports JAX)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import jit_once, time_calls
from jax.sharding import NamedSharding

import spmdcomm as sc
from spmdcomm.parallel.expert import expert_capacity, route

K, FACTOR = 2, 1.25
MLP_RATIO = 4  # examples/lm's MLP hidden units per width unit: each expert's hidden = 4 * width
LM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "lm")
EXPERT_SCOPES = ("grouped_experts", "buffered_experts")  # the named scopes of the layer's expert matmuls


class Mlp(nn.Module):
    width: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, name="down")(nn.gelu(nn.Dense(self.hidden, name="up")(x)))


def gshard_moe(x, logits, experts, e, mesh, groups=1):
    """The GShard layer a JAX user writes: one-hot dispatch and combine tensors ``[G, S, E, C]`` and einsums, the
    expert dimension split over ``expert`` by sharding constraints; ``experts`` maps ``[E, G * C, d]`` to
    ``[E, G * C, d]``. The ``N`` tokens form ``groups`` groups of ``S = N / G`` tokens, each with its own capacity
    ``C`` (first choices before second ones, then token order): ``groups=1`` is one global capacity (``sc.MoE``'s
    rule), ``groups`` = the device count the paper's form (each device's tokens a group, split over ``expert``).
    Returns the output ``[N, d]`` and the Switch/GShard load-balancing loss over the ``N`` tokens."""
    tokens, width = x.shape
    size = tokens // groups
    capacity = expert_capacity(size, e, K, FACTOR)

    def tables(logits):  # one group's [S, E, C] dispatch and combine tensors
        r = route(logits, K)
        onehot = jax.nn.one_hot(r.experts, e, dtype=jnp.int32)  # [S, k, E], first choices before second ones
        order = jnp.cumsum(onehot.transpose(1, 0, 2).reshape(-1, e), axis=0).reshape(K, size, e).transpose(1, 0, 2)
        slot = jnp.sum((order - 1) * onehot, axis=-1)  # [S, k]
        at = jax.nn.one_hot(slot, capacity)  # [S, k, C]: zeros past the capacity, the dropped assignments
        dispatch = jnp.einsum("ske,skc->sec", onehot, at)
        combine = jnp.einsum("sk,ske,skc->sec", r.weights, onehot, at)
        return dispatch, combine, onehot.sum((0, 1)), r.probs.sum(0)

    dispatch, combine, counts, probs = jax.vmap(tables)(logits.reshape(groups, size, e))
    split = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, jax.P("expert")))
    if groups > 1:  # the groups are the devices' tokens: dispatch from and combine into the group dimension
        dispatch, combine = split(dispatch), split(combine)
    sent = split(jnp.einsum("gsec,gsd->egcd", dispatch, x.reshape(groups, size, width)))
    out = split(experts(sent.reshape(e, groups * capacity, width)).reshape(e, groups, capacity, -1))
    y = jnp.einsum("gsec,egcd->gsd", combine, out)
    y = split(y) if groups > 1 else y
    balance = e * jnp.sum(counts.sum(0) / (tokens * K) * probs.sum(0) / tokens)
    return y.reshape(tokens, -1).astype(x.dtype), balance


class GShardMoE(nn.Module):
    """``sc.MoE``'s parameters and call (as examples/lm builds it), computed by :func:`gshard_moe` in the global
    view (one global capacity); it sows the load-balancing loss into ``"moe"`` as ``sc.MoE`` does."""

    expert: nn.Module
    experts: int
    k: int = K
    mesh: object = None

    @nn.compact
    def __call__(self, x, mask=None):
        assert mask is None, "unpacked windows only: every token is routed"
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


def init_params(module, x):
    """``module``'s parameters for an input like ``x``, in one program (``jit_once``): only the parameters are kept
    (``mutable``), so XLA drops the forward pass that ``init`` traces (and the MoE layers' sown losses). On the host:
    placing one device's arrays on a sharded layout compiles a slicing program per leaf; host arrays need none."""
    return jax.device_get(jit_once(functools.partial(module.init, mutable=["params"]))(jax.random.key(0), x)["params"])


def by_kind(report):
    out: dict[str, int] = {}
    for c in report.collectives:
        out[c.kind] = out.get(c.kind, 0) + c.total_bytes
    return out


def interleaved(calls, rounds, steps):
    """Seconds of ``steps`` calls of each, the variants interleaved over ``rounds`` (order reversed every other)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls) if r % 2 == 0 else list(reversed(calls)):
            calls[name]()
            times[name].append(time_calls(calls[name], steps))
    return times


def expert_flops(report) -> float:
    """The FLOPs of the expert matmuls summed over devices, counted at the compiled program's static bound (every
    tile of the grouped scan): the scopes that name ``grouped_experts`` or ``buffered_experts`` (the grouped scan's
    matmuls, which XLA leaves without metadata in a train step, count under the scan's scope)."""
    per_device = sum(v for scope, v in report.work.by_scope.items() if any(s in scope for s in EXPERT_SCOPES))
    return per_device * report.work.devices


def work(report) -> dict:
    """The counted matmul FLOPs of a report: the total over devices, whether exact or a bound, the experts' part."""
    return {"flops_total": report.flops_total, "flops_bound": report.work.bound, "expert_flops": expert_flops(report)}


def _load_models():
    sys.path.insert(0, LM)
    import models  # examples/lm/models.py

    return models


def _lm_batch(rows, length):
    tokens = np.random.default_rng(0).integers(0, 256, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _train_step(models, model, params, batch, mesh, tx):
    """An AdamW ``sc.make_train_step`` step of examples/lm's ``model`` on ``mesh``, its state, its report."""
    state = sc.TrainState.create(
        params=params,
        tx=tx,
        apply_fn=model.apply,
        mesh=mesh,
        logical_axis_rules=models.logical_axis_rules(mesh.axis_names),
    )
    step = sc.make_train_step(models.make_loss_fn(), donate=False)
    return step, state, sc.explain(step, state, batch)


def lm_models(args):
    """examples/lm's models module, the MoE LM's parameters (every MoE variant's) and a parameter cache."""
    models = _load_models()
    moe = models.Transformer(
        width=args.lm_width, layers=args.lm_layers, heads=4, max_len=args.lm_length, experts=args.experts, top_k=K
    )
    return models, moe, init_params(moe, np.zeros((1, args.lm_length), np.int32))


def lm_rows(args, devices, models, moe_model, moe_params):
    """The MoE LM (``E`` experts of ``4 * width`` hidden units, top-2, dropless, grouped) against the dense LM with
    the same active parameters (MLP hidden ``k * 4 * width``: the same matmul work per token, the router's
    ``width * E`` aside) and with the same total parameters (MLP hidden ``E * 4 * width``), each an AdamW
    ``sc.make_train_step`` step on ``devices * lm_windows`` windows, interleaved."""
    rows, length = devices * args.lm_windows, args.lm_length
    batch = _lm_batch(rows, length)
    tx = optax.adamw(1e-3)
    common = dict(width=args.lm_width, layers=args.lm_layers, heads=4, max_len=length)
    hidden = MLP_RATIO * args.lm_width
    data = {"data": devices}
    configs = [
        (f"moe dropless, data {devices}", "moe", dict(experts=args.experts, top_k=K), data),
    ]
    if not args.smoke:  # the smoke run's MoE on an expert axis is lm_gshard_rows' "ours"
        configs.append(
            (f"moe dropless, expert {devices}", "moe", dict(experts=args.experts, top_k=K), {"expert": devices})
        )
        if devices == 8:
            moe = dict(experts=args.experts, top_k=K)
            configs.append(("moe dropless, data 2 x expert 4", "moe", moe, {"data": 2, "expert": 4}))
    configs += [
        ("dense same active params", "dense active", dict(mlp_ratio=K * MLP_RATIO), data),
        ("dense same total params", "dense total", dict(mlp_ratio=args.experts * MLP_RATIO), data),
    ]
    out, calls = [], {}
    for name, kind, extra, axes in configs:
        if kind == "moe":
            model, params = moe_model, moe_params
        else:
            model = models.Transformer(**common, **extra)
            params = init_params(model, batch["inputs"][:1])
        step, state, report = _train_step(models, model, params, batch, sc.make_mesh(axes), tx)
        _, metrics = step(state, batch)
        calls[name] = functools.partial(step, state, batch)
        out.append(
            {
                "variant": name,
                "kind": kind,
                "mesh": axes,
                "mlp_hidden": hidden * (extra.get("mlp_ratio", MLP_RATIO) // MLP_RATIO),
                "params": sum(int(np.size(leaf)) for leaf in jax.tree.leaves(nn.unbox(params))),
                "temp_bytes": report.memory.temp_bytes,
                "collective_bytes": by_kind(report),
                "loss": float(metrics["loss"]),
                **work(report),
            }
        )
    times = interleaved(calls, args.rounds, args.steps)
    for row in out:
        row["tokens_per_s"] = rows * length * args.steps / float(np.median(times[row["variant"]]))
    dense = {row["kind"]: row for row in out if row["kind"] != "moe"}
    for row in out:
        for kind, ref in dense.items():
            key = kind.replace(" ", "_")
            row[f"time_vs_{key}"] = ref["tokens_per_s"] / row["tokens_per_s"]
            row[f"flops_vs_{key}"] = row["flops_total"] / ref["flops_total"]
    return out


def lm_gshard_rows(args, devices, models, model, params):
    """Ours (capacity 1.25, ``expert`` 8) against the jit + NamedSharding GShard step (global capacity 1.25): the
    same function, so the same loss."""
    rows, length = devices * args.lm_windows, args.lm_length
    batch = _lm_batch(rows, length)
    tx = optax.adamw(1e-3)
    with moe_layer(functools.partial(sc.MoE, capacity_factor=FACTOR)):
        mesh = sc.make_mesh({"expert": devices})
        step, state, report = _train_step(models, model, params, batch, mesh, tx)
        _, ours_metrics = step(state, batch)

    def objective(apply_fn, p, batch):
        loss, _, real, balance = models.token_sums(apply_fn, p, batch, jnp.ones(rows, bool))
        return loss / real + models.BALANCE * balance

    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    is_expert = lambda path: any(getattr(k, "key", None) == "experts" for k in path)
    # The blocks are one stack: each expert leaf is [layers, experts, ...], split over expert on dimension 1.
    placed = jax.tree_util.tree_map_with_path(
        lambda q, v: put(v, jax.P(None, "expert") if is_expert(q) else jax.P()), nn.unbox(params)
    )
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
    times = interleaved(calls, args.rounds, args.steps)
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
                "collective_bytes": by_kind(rep),
                "loss": loss,
                **work(rep),
            }
        )
    for row in out:
        row["speed_vs_ours"] = row["tokens_per_s"] / out[0]["tokens_per_s"]
    return out


class _Elementwise(nn.Module):
    """An expert without a matmul (one bias, a GELU): the grouped layer's routing, sorting and scan alone."""

    width: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(x + self.param("bias", nn.initializers.normal(), (self.width,)))


def breakdown_rows(args, devices):
    """Where the MoE layer's time goes: forward, and forward + backward, of the layer at two settings, interleaved.
    ``expert``: the layer section's (``tokens`` per device, the experts split over ``expert``), grouped and buffer.
    ``data``: one MoE MLP of the LM's ``{"data": 8}`` step (``lm_windows * lm_length`` tokens per device of
    ``lm_width`` features, every expert local), grouped, buffer, grouped with an expert that does no matmul, and the
    dense MLP with the same active parameters (hidden ``k * 4 * lm_width``)."""
    rng = np.random.default_rng(0)
    calls, out = {}, []
    lm_width, lm_tokens = args.lm_width, args.lm_windows * args.lm_length
    settings = [
        ("expert", args.tokens, args.width, args.hidden),
        ("data", lm_tokens, lm_width, MLP_RATIO * lm_width),
    ]
    for axis, tokens, width, hidden in settings:
        mesh = sc.make_mesh({axis: devices})
        x = rng.standard_normal((devices * tokens, width)).astype(np.float32)
        xs = jax.device_put(x, NamedSharding(mesh, jax.P(axis)))
        on = None if axis == "data" else axis
        layers = {
            "moe grouped": sc.MoE(Mlp(width, hidden), experts=args.experts, k=K, axis_name=on),
            "moe buffer": sc.MoE(Mlp(width, hidden), experts=args.experts, k=K, axis_name=on, grouped=False),
        }
        if axis == "data":
            layers["moe grouped, expert without matmul"] = sc.MoE(_Elementwise(width), experts=args.experts, k=K)
            layers["dense mlp, same active params"] = Mlp(width, K * hidden)
        for name, layer in layers.items():
            params = nn.unbox(init_params(layer, x[:1]))
            spec = {"router": jax.P(), "experts": jax.P(on)} if isinstance(layer, sc.MoE) else jax.P()
            fn = jax.shard_map(
                lambda p, x, layer=layer: layer.apply({"params": p}, x),
                mesh=mesh,
                in_specs=(spec, jax.P(axis)),
                out_specs=jax.P(axis),
            )
            grad = jax.grad(lambda p, x, fn=fn: jnp.sum(fn(p, x) ** 2), (0, 1))
            row = {"setting": f"{axis} {devices}", "variant": name, "tokens_per_device": tokens}
            for part, f in (("forward", fn), ("forward+backward", grad)):
                compiled = jax.jit(f).lower(params, xs).compile()
                calls[(axis, name, part)] = functools.partial(compiled, params, xs)
                row[f"{part}_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
            out.append(row)
    times = interleaved(calls, args.rounds, args.steps)
    for row in out:
        axis = row["setting"].split()[0]
        for part in ("forward", "forward+backward"):
            row[f"{part}_ms"] = 1e3 * float(np.median(times[(axis, row["variant"], part)])) / args.steps
    return out
