"""Expert parallelism: ``sc.ragged_all_to_all`` and the mixture-of-experts layers (``sc.MoE``, ``sc.nnx.MoE``).

The collective equals a NumPy reference on 2, 4 and 8 devices (uneven sizes, zero-row sends, a receive bound that
truncates), values and the vector-Jacobian product, under ``jax.jit``; the bookkeeping of the native collective (not
available on CPU) is checked against the semantics JAX documents for ``jax.lax.ragged_all_to_all``, and the native
program is lowered (forward and gradient). The layers with their experts split over an axis equal one device
running every expert on the global batch, forward and gradients, dropless and with a capacity, for routings that
leave experts empty or send every token to one expert, k = 1 and 2; their losses and metrics are the global batch's.
Every case compiles one small program.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import spmdcomm as sc
import spmdcomm.collectives.ragged as ragged
from spmdcomm.errors import AxisError, BackendError, ShapeError, SpmdError
from spmdcomm.explain.hlo import inventory, parse_module
from spmdcomm.parallel.expert.capacity import SequenceSplit, assignment_slots
from tests.ddp_models import jit_once, nnx_once

ROWS = 6  # rows each device holds in the collective's cases


def axis_mesh(n: int, name: str = "x") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,))


def numpy_ragged(xs: list[np.ndarray], sizes: np.ndarray, out_rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    """What each device receives, from the definition: device i's rows grouped by destination, device j's chunks
    packed in source order, cut at ``out_rows``."""
    n = len(xs)
    outs, recv = [], np.zeros((n, n), np.int64)
    for j in range(n):
        got = []
        for i in range(n):
            s = np.maximum(sizes[i], 0)
            start = min(int(s[:j].sum()), len(xs[i]))
            chunk = xs[i][start : min(start + int(s[j]), len(xs[i]))]
            room = out_rows - sum(len(c) for c in got)
            got.append(chunk[: max(room, 0)])
            recv[j, i] = len(got[-1])
        packed = np.concatenate(got) if got else np.zeros((0,) + xs[0].shape[1:])
        out = np.zeros((out_rows,) + xs[0].shape[1:], xs[0].dtype)
        out[: len(packed)] = packed
        outs.append(out)
    return outs, recv


# (devices, per-device send sizes, out_rows): uneven, zero-row sends, everything to one device, negative counts,
# counts past the rows held, and receive bounds that cut the last sources.
RAGGED_CASES = {
    "2-uneven": (2, [[1, 5], [0, 3]], None),
    "2-cut": (2, [[4, 2], [6, 0]], 7),
    "4-zero-rows": (4, [[0, 2, 0, 4], [1, 1, 1, 1], [0, 0, 0, 0], [6, 0, 0, 0]], None),
    "4-all-to-one": (4, [[0, 0, 6, 0], [0, 0, 6, 0], [0, 0, 6, 0], [0, 0, 6, 0]], 24),
    "4-past-rows-negative": (4, [[3, 9, 0, 0], [-2, 2, 2, 2], [2, 2, 2, 2], [0, 0, 0, 1]], 5),
    "8-uneven": (8, [[(i * 3 + j) % 3 - (j == 7) for j in range(8)] for i in range(8)], None),
    "8-cut": (8, [[(i + j) % 2 * 2 for j in range(8)] for i in range(8)], 3),
}


@pytest.mark.parametrize("case", sorted(RAGGED_CASES))
def test_ragged_all_to_all_equals_numpy_values_and_vjp(case):
    n, sizes, out_rows = RAGGED_CASES[case]
    sizes = np.array(sizes, np.int32)
    bound = out_rows or n * ROWS
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n * ROWS, 3)).astype(np.float32)
    tag = np.arange(n * ROWS, dtype=np.int32)  # a second leaf: ints move with the same sizes
    cot = rng.standard_normal((n * bound, 3)).astype(np.float32)

    def body(x, tag, s, cot):
        (out, moved), recv = sc.ragged_all_to_all((x, tag), s, "x", out_rows=out_rows, implementation="padded")
        _, vjp = jax.vjp(lambda x: sc.ragged_all_to_all(x, s, "x", out_rows=out_rows)[0], x)
        return out, moved, recv, vjp(cot)[0]

    f = jax.jit(jax.shard_map(body, mesh=axis_mesh(n), in_specs=jax.P("x"), out_specs=jax.P("x")))
    out, moved, recv, grad = (np.asarray(a) for a in f(x, tag, sizes.reshape(-1), cot))
    xs, tags = np.split(x, n), np.split(tag, n)
    want, want_recv = numpy_ragged(xs, sizes, bound)
    want_tags, _ = numpy_ragged(tags, sizes, bound)
    np.testing.assert_array_equal(out, np.concatenate(want))
    np.testing.assert_array_equal(moved, np.concatenate(want_tags))
    np.testing.assert_array_equal(recv, want_recv.reshape(-1))
    # The transpose: each received row's cotangent goes back to the row it came from (found by its tag).
    want_grad = np.zeros_like(x)
    for j, (rows, got) in enumerate(zip(np.split(np.concatenate(want_tags), n), np.split(cot, n), strict=True)):
        for r in range(int(want_recv[j].sum())):
            want_grad[rows[r]] += got[r]
    np.testing.assert_array_equal(grad, want_grad)


def test_ragged_all_to_all_composes_with_vmap_as_one_call_per_item():
    """Under ``jax.vmap`` (over the rows and the send sizes alike, as a vmapped shard_map program batches them), each
    item moves as its own call does: values, receive sizes and the VJP."""
    n, items = 4, 3
    rng = np.random.default_rng(1)
    x = rng.standard_normal((items, n * ROWS, 3)).astype(np.float32)
    sizes = rng.integers(-1, ROWS // 2 + 1, (items, n * n)).astype(np.int32)
    cot = rng.standard_normal((items, n * n * ROWS, 3)).astype(np.float32)

    def one(x, s, c):
        out, recv = sc.ragged_all_to_all(x, s, "x", implementation="padded")
        _, vjp = jax.vjp(lambda x: sc.ragged_all_to_all(x, s, "x")[0], x)
        return out, recv, vjp(c)[0]

    def body(x, s, c):
        batched = jax.vmap(one)(x, s, c)
        looped = [one(x[i], s[i], c[i]) for i in range(items)]
        return batched, jax.tree.map(lambda *a: jnp.stack(a), *looped)

    spec = jax.P(None, "x")
    f = jax.jit(jax.shard_map(body, mesh=axis_mesh(n), in_specs=spec, out_specs=spec))
    batched, looped = f(x, sizes, cot)
    for b, want in zip(jax.tree.leaves(batched), jax.tree.leaves(looped), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(want))
    assert np.asarray(batched[0]).any() and np.asarray(batched[1]).sum() > 0  # rows did move


@pytest.mark.parametrize("case", ["4-zero-rows", "4-past-rows-negative", "8-cut"])
def test_the_native_bookkeeping_follows_jax_ragged_all_to_all_semantics(case):
    """The offsets and sizes passed to ``jax.lax.ragged_all_to_all``, run through the pseudocode of its
    docstring in NumPy, deliver what the padded implementation delivers."""
    n, sizes, out_rows = RAGGED_CASES[case]
    sizes = np.array(sizes, np.int32)
    bound = out_rows or n * ROWS

    def body(s):
        return tuple(a[None] for a in ragged._plan(s, "x", ROWS, bound))

    f = jax.jit(jax.shard_map(body, mesh=axis_mesh(n), in_specs=jax.P("x"), out_specs=jax.P("x")))
    send, recv, in_off, out_off = (np.asarray(a) for a in f(sizes.reshape(-1)))
    xs = [np.arange(ROWS) + 100 * i for i in range(n)]
    results = [np.zeros(bound, np.int64) for _ in range(n)]
    for j in range(n):  # receiver j, as the docstring's RECEIVE loop: output_offsets all-to-all'd
        for i in range(n):
            at = out_off[i, j]
            results[j][at : at + recv[j, i]] = xs[i][in_off[i, j] : in_off[i, j] + send[i, j]]
            assert send[i, j] == recv[j, i]
    want, _ = numpy_ragged(xs, sizes, bound)
    np.testing.assert_array_equal(np.stack(results), np.stack(want))


def test_the_native_program_lowers_forward_and_backward(monkeypatch):
    monkeypatch.setattr(ragged, "RAGGED_NATIVE_PLATFORMS", frozenset({"cpu"}))  # lowered only: XLA:CPU has no kernel

    def body(x, s):
        return sc.ragged_all_to_all(x, s, "x", out_rows=12, implementation="native")[0]

    mesh = axis_mesh(4)
    f = jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    x, s = jnp.ones((16, 3)), jnp.ones((16,), jnp.int32)
    lowered = jax.jit(f).lower(x, s)
    assert "ragged_all_to_all" in lowered.as_text()
    assert "ragged_all_to_all" in jax.jit(jax.grad(lambda x: (f(x, s) ** 2).sum())).lower(x).as_text()
    # explain's reading of the HLO counts it over the axis, sized by its buffers (4 rows in, 12 out, 3 floats each),
    # not by its six operands.
    (row,) = [c for c in inventory(parse_module(lowered.as_text(dialect="hlo")), mesh) if "ragged" in c.kind]
    assert (row.kind, row.count, row.bytes, row.buffers, row.axes) == ("ragged-all-to-all", 1, 12 * 3 * 4, 1, ("x",))


@pytest.mark.parametrize(
    ("kwargs", "error", "facts"),
    [
        ({"s": np.ones(3, np.int32)}, ShapeError, ["send_sizes has shape (3,)", "shape (4,)"]),
        ({"s": np.ones(4, np.float32)}, ShapeError, ["dtype float32", "one integer per device"]),
        ({"out_rows": 0}, SpmdError, ["out_rows=0 is not a positive integer"]),
        ({"implementation": "fast"}, SpmdError, ["implementation='fast'", "'padded'"]),
        ({"implementation": "native"}, BackendError, ["platform 'cpu'", "implementation='auto' or 'padded'"]),
        ({"axis": "y"}, AxisError, ["unknown axis name 'y'"]),
        ({"x": (np.ones((4, 2)), np.ones(3))}, ShapeError, ["different numbers of rows", "[0]': 4", "[1]': 3"]),
        ({"x": np.float32(1)}, ShapeError, ["0-d"]),
    ],
)
def test_ragged_all_to_all_rejects_bad_input_before_tracing_lax(kwargs, error, facts):
    args = {"x": np.ones((4, 2)), "s": np.ones(4, np.int32), "axis": "x"} | kwargs
    x, s, axis = args.pop("x"), args.pop("s"), args.pop("axis")

    def body(_):
        return sc.ragged_all_to_all(x, s, axis, **args)[1]

    with pytest.raises(error) as caught:
        jax.shard_map(body, mesh=axis_mesh(4), in_specs=jax.P("x"), out_specs=jax.P("x"))(np.zeros(4))
    assert "spmdcomm.ragged_all_to_all" in str(caught.value)
    for fact in facts:
        assert fact in str(caught.value)


# ---- the MoE layers ----------------------------------------------------------------------------------------------

E, D, HIDDEN, TOKENS = 8, 8, 16, 8  # experts, features, expert hidden units, tokens per device


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.gelu(nn.Dense(HIDDEN, name="up")(x))
        return nn.Dense(D, name="down")(hidden)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(D, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, D, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


# name: (mesh axes {name: size}, token axes, k, routing, capacity factor, router bias: None, "one" (every token's
# first choice is expert 0) or "two" (every token chooses among experts 0 and 1, six experts get nothing)).
MOE_CASES = {
    "dropless-k2": ({"expert": 4}, ("expert",), 2, "softmax_topk", None, None),
    "dropless-k1-topk-softmax": ({"expert": 4}, ("expert",), 1, "topk_softmax", None, None),
    "dropless-all-to-one-expert": ({"expert": 4}, ("expert",), 1, "softmax_topk", None, "one"),
    "dropless-empty-experts-k2": ({"expert": 2}, ("expert",), 2, "topk_softmax", None, "two"),
    "capacity-k2": ({"expert": 4}, ("expert",), 2, "softmax_topk", 1.0, None),
    "capacity-all-to-one-expert": ({"expert": 4}, ("expert",), 2, "softmax_topk", 1.25, "one"),
    "capacity-data-and-expert-axes": ({"data": 2, "expert": 2}, ("data", "expert"), 1, "softmax_topk", 0.5, None),
    "dropless-8-devices": ({"expert": 8}, ("expert",), 2, "softmax_topk", None, None),
}


@functools.cache
def initial_params():
    """The layer's parameters, the same in every case (they depend on shapes only): one init program, compiled
    for a single run, not one program per operation of an eager init."""
    return jit_once(sc.MoE(Mlp(), experts=E, k=1).init)(jax.random.key(0), np.zeros((1, D), np.float32))["params"]


def moe_inputs(devices: int, bias: str | None):
    rng = np.random.default_rng(devices)
    x = rng.standard_normal((devices * TOKENS, D)).astype(np.float32)
    params = jax.tree.map(np.asarray, initial_params())  # a new tree: its router is replaced below
    params["router"] = rng.standard_normal((D, E)).astype(np.float32)
    if bias is not None:  # feature 0 is a constant 1 that votes for expert 0 (and 1)
        x[:, 0] = 1.0
        params["router"][0] = -40.0 if bias == "two" else 0.0
        params["router"][0, : 2 if bias == "two" else 1] = 20.0
    return x, params


def numpy_kept(experts: np.ndarray, capacity: int | None) -> np.ndarray:
    """The capacity rule, literally: first choices of all tokens in order, then second choices."""
    kept = np.ones(experts.shape, bool)
    if capacity is None:
        return kept
    filled = np.zeros(E, int)
    for r in range(experts.shape[1]):
        for t in range(experts.shape[0]):
            j = experts[t, r]
            kept[t, r] = filled[j] < capacity
            filled[j] += kept[t, r]
    return kept


def routed(logits, *, k, routing):
    probs = jax.nn.softmax(logits)
    if routing == "softmax_topk":
        weights, experts = jax.lax.top_k(probs, k)
    else:
        top, experts = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top)
    return probs, weights, experts


def dense_reference(params, x, kept, *, k, routing):
    """One device running every expert on every token of the global batch, then the top-k combine; its losses."""
    n = x.shape[0]
    logits = x @ params["router"]
    probs, weights, experts = routed(logits, k=k, routing=routing)
    every = jax.vmap(lambda p: Mlp().apply({"params": p}, x))(params["experts"])  # [E, N, D]
    picked = every[experts, jnp.arange(n)[:, None]]  # [N, k, D]
    y = jnp.einsum("tk,tkd->td", weights * kept, picked)
    counts = jnp.sum(jax.nn.one_hot(experts, E), axis=(0, 1))
    balance = E * jnp.sum(counts / (n * k) * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y, balance, z


def sharded_moe(axes, token_axes, **options):
    mesh = sc.make_mesh(axes, devices=jax.devices()[: int(np.prod(list(axes.values())))])
    layer = sc.MoE(Mlp(), experts=E, axis_name="expert", token_axes=token_axes, **options)

    def body(params, x):
        y, state = layer.apply({"params": params}, x, mutable=["moe"])
        return y, {name: value[0] for name, value in state["moe"].items()}

    specs = {"router": jax.P(), "experts": jax.P("expert")}
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, jax.P(token_axes)), out_specs=(jax.P(token_axes), jax.P()))
    return mesh, mapped


def numpy_slots(experts: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Each real assignment's slot at its expert in the capacity rule's order: every first choice before any second
    choice, then the tokens in the order of ``experts`` (``[tokens, k]``); -1 for the others."""
    slots, filled = np.full(experts.shape, -1), np.zeros(E, int)
    for r in range(experts.shape[1]):
        for t in np.flatnonzero(valid):
            slots[t, r] = filled[experts[t, r]]
            filled[experts[t, r]] += 1
    return slots


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_slots_with_every_sequence_over_a_context_axis_follow_one_devices_token_order(layout):
    """data 2 x expert 2 x context 2, 2 rows per (data, expert) block, 8 positions of 2 tokens each: every real
    assignment's global slot is its slot on one device holding the unsplit batch (rows, then each row's positions
    in sequence order); its group slot (over the expert axis) is its slot among the group's assignments in that
    order, so a kept assignment's group slot is at most its global slot."""
    rows, length, inner, k, c = 8, 8, 2, 2, 2
    rng = np.random.default_rng(3)
    experts = rng.integers(0, E, (rows, length, inner, k)).astype(np.int32)
    valid = rng.random((rows, length, inner)) < 0.8
    split = sc.ContextParallel(layout=layout)
    order = split.order(length, c)  # the global position each stored position holds
    mesh = sc.make_mesh({"data": 2, "expert": 2, "context": c})
    axes = ("data", "expert", "context")
    sequence = SequenceSplit("context", layout, rows // 4, length // c)

    def body(experts, valid):
        slots = assignment_slots(
            experts.reshape(-1, k), E, token_axes=axes, axis_name="expert", valid=valid.reshape(-1), sequence=sequence
        )
        shape = experts.shape
        return slots.global_slot.reshape(shape), slots.group_slot.reshape(shape), slots.counts

    spec = jax.P(("data", "expert"), "context")
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec, jax.P())))
    stored = lambda a: jax.device_put(a[:, order], jax.NamedSharding(mesh, spec))
    global_slot, group_slot, counts = (np.asarray(a) for a in mapped(stored(experts), stored(valid)))
    back = np.argsort(order)
    global_slot, group_slot = global_slot[:, back], group_slot[:, back]
    real = np.broadcast_to(valid[..., None], experts.shape)
    want = numpy_slots(experts.reshape(-1, k), valid.reshape(-1)).reshape(experts.shape)
    np.testing.assert_array_equal(np.where(real, global_slot, -1), want)
    np.testing.assert_array_equal(counts, np.bincount(experts[valid].reshape(-1), minlength=E))
    # A group: the (data, context) devices' tokens, the two expert devices' rows in turn, each device's positions.
    for data in range(2):
        for context in range(c):
            held = np.sort(order[context * (length // c) : (context + 1) * (length // c)])
            group_rows = np.arange(data * 4, data * 4 + 4)  # rows of (data, expert 0) then (data, expert 1)
            pick = np.ix_(group_rows, held)
            mine = numpy_slots(experts[pick].reshape(-1, k), valid[pick].reshape(-1)).reshape(experts[pick].shape)
            np.testing.assert_array_equal(np.where(real[pick], group_slot[pick], -1), mine)


# The fast tier keeps one case of each kind (k = 1 and 2, both routings, capacity); tests/
# test_expert_parallel.py meets the data and expert axes together in its fast tier.
SLOW_CASES = {
    "dropless-8-devices",
    "capacity-all-to-one-expert",
    "dropless-all-to-one-expert",
    "capacity-data-and-expert-axes",
    "dropless-empty-experts-k2",
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in MOE_CASES])
def test_moe_with_split_experts_equals_one_device_running_every_expert(case):
    axes, token_axes, k, routing, capacity_factor, bias = MOE_CASES[case]
    x, params = moe_inputs(int(np.prod(list(axes.values()))), bias)
    options = {"k": k, "routing": routing, "capacity_factor": capacity_factor}
    mesh, mapped = sharded_moe(axes, token_axes, **options)
    placed = jax.device_put(x, jax.NamedSharding(mesh, jax.P(token_axes)))
    cot = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def loss(params, forward):
        """The loss, and ``((y, balance, z), stats)`` as its aux: one trace gives the outputs and the gradients."""
        (y, balance, z), stats = forward(params)
        return jnp.sum(y * cot) + 0.3 * balance + 0.1 * z, ((y, balance, z), stats)

    def sharded(params):
        y, stats = mapped(params, placed)
        return (y, stats["load_balancing_loss"], stats["router_z_loss"]), stats

    @jax.jit
    def run(params):
        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, sharded)
        return aux, grads

    ((y, balance, z), stats), grads = run(params)
    experts = np.asarray(jax.jit(lambda p: routed(x @ p["router"], k=k, routing=routing)[2])(params))
    n = x.shape[0]
    capacity = None if capacity_factor is None else max(1, min(n, int(np.ceil(capacity_factor * n * k / E))))
    kept = numpy_kept(experts, capacity)
    counts, dropped = np.bincount(experts.reshape(-1), minlength=E), 1.0 - kept.mean()

    @jax.jit
    def reference(params):
        forward = lambda p: (dense_reference(p, x, kept, k=k, routing=routing), None)
        (_, (outs, _)), grads = jax.value_and_grad(loss, has_aux=True)(params, forward)
        return outs, grads

    (want_y, want_balance, want_z), want_grads = reference(params)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([balance, z], [want_balance, want_z], rtol=1e-5)
    np.testing.assert_array_equal(stats["expert_counts"], counts)
    np.testing.assert_allclose(stats["dropped_fraction"], dropped, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads, want_grads)
    if capacity_factor is not None:
        assert dropped > 0  # the case exercises the rule
    if bias == "two":
        assert (counts[2:] == 0).all()


@pytest.mark.slow
def test_nnx_moe_with_split_experts_equals_the_linen_layer_on_one_device():
    """The NNX layer, its experts split over 4 devices, equals the Linen layer with the same parameters on one
    device (forward, gradients of every parameter, the sown stats), with a capacity."""
    x, _ = moe_inputs(4, None)
    model = nnx_once(
        lambda: sc.nnx.MoE(
            NnxMlp, experts=E, features=D, k=2, capacity_factor=1.0, axis_name="expert", rngs=nnx.Rngs(0)
        )
    )
    graphdef, state = nnx.split(model)
    mesh = sc.make_mesh({"expert": 4}, devices=jax.devices()[:4])
    stacked = lambda v: jax.P("expert") if (v.get_metadata().get("out_sharding") or (None,))[0] == "expert" else jax.P()
    specs = jax.tree.map(stacked, state, is_leaf=lambda v: isinstance(v, nnx.Variable))

    def body(state, x):
        y, found = nnx.capture(lambda layer, x: layer(x), nnx.Intermediate)(nnx.merge(graphdef, state), x)
        return y, {name: v.get_value()[0] for name, v in found.items()}

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, jax.P("expert")), out_specs=(jax.P("expert"), jax.P()))
    cot = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    y, stats, grads = jax.jit(lambda s: (*mapped(s, x), jax.grad(lambda s: jnp.sum(mapped(s, x)[0] * cot))(s)))(state)

    # The same parameters in the Linen layer's tree, run on one device.
    experts = {
        name: {"kernel": state["experts"][name]["kernel"][...], "bias": state["experts"][name]["bias"][...]}
        for name in ("up", "down")
    }
    params = {"router": state["router"][...], "experts": experts}
    linen = sc.MoE(Mlp(), experts=E, k=2, capacity_factor=1.0)

    @jax.jit
    def reference(params):
        want, sown = linen.apply({"params": params}, x, mutable=["moe"])
        return want, sown, jax.grad(lambda p: jnp.sum(linen.apply({"params": p}, x) * cot))(params)

    want, sown, want_grads = reference(params)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    for name, value in sown["moe"].items():
        np.testing.assert_allclose(stats[name], value[0], rtol=1e-5)
    assert stats["dropped_fraction"] > 0
    np.testing.assert_allclose(grads["router"][...], want_grads["router"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        grads["experts"]["up"]["kernel"][...], want_grads["experts"]["up"]["kernel"], rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        grads["experts"]["down"]["bias"][...], want_grads["experts"]["down"]["bias"], rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    ("options", "error", "facts"),
    [
        ({"k": 9}, SpmdError, ["k=9 experts per token with experts=8", "[1, 8]"]),
        ({"k": 0}, SpmdError, ["k=0"]),
        ({"capacity_factor": 0.0}, SpmdError, ["capacity_factor=0.0 is not positive", "None for the dropless"]),
        ({"capacity_factor": -1.0}, SpmdError, ["capacity_factor=-1.0"]),
        ({"routing": "sigmoid"}, SpmdError, ["routing='sigmoid'", "softmax_topk"]),
    ],
)
def test_bad_router_options_raise_at_setup_in_both_layers(options, error, facts):
    with pytest.raises(error) as linen:
        sc.MoE(Mlp(), experts=E, **options).init(jax.random.key(0), np.ones((2, D), np.float32))
    with pytest.raises(error) as nnx_error:
        sc.nnx.MoE(NnxMlp, experts=E, features=D, **options, rngs=nnx.Rngs(0))
    for caught, fn in ((linen, "spmdcomm.MoE"), (nnx_error, "spmdcomm.nnx.MoE")):
        assert str(caught.value).startswith(fn + ":")
        for fact in facts:
            assert fact in str(caught.value)


@pytest.mark.parametrize(
    ("split", "token_axes", "error", "facts"),
    [
        (jax.P(), None, ShapeError, ["hold 8 experts on each of the 4 devices of expert axis 'expert' (32 in all)"]),
        (jax.P("expert"), ("data",), SpmdError, ["token_axes=('data',) leaves out the expert axis 'expert'"]),
    ],
)
def test_experts_that_are_not_split_over_the_axis_raise_while_tracing(split, token_axes, error, facts):
    layer = sc.MoE(Mlp(), experts=E, k=1, axis_name="expert", token_axes=token_axes)
    params = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((2, D)))["params"]
    mapped = jax.shard_map(
        lambda params, x: layer.apply({"params": params}, x),
        mesh=axis_mesh(4, "expert"),
        in_specs=({"router": jax.P(), "experts": split}, jax.P("expert")),
        out_specs=jax.P("expert"),
    )
    with pytest.raises(error) as caught:
        jax.eval_shape(mapped, params, jax.ShapeDtypeStruct((8, D), jnp.float32))
    for fact in facts:
        assert fact in str(caught.value)


def test_experts_that_do_not_divide_by_the_axis_size_raise_while_tracing():
    def body(x):
        return sc.parallel.expert.moe(x, x[:, :6], lambda buf: buf, experts=6, k=1, axis_name="expert")[0]

    mapped = jax.shard_map(body, mesh=axis_mesh(4, "expert"), in_specs=jax.P("expert"), out_specs=jax.P("expert"))
    with pytest.raises(ShapeError, match="experts=6 do not divide by the 4 devices of expert axis 'expert'"):
        jax.eval_shape(mapped, jax.ShapeDtypeStruct((8, D), jnp.float32))


# name: (mesh axes, token axes, k, capacity factor). The mask leaves a device without real tokens and the others
# uneven; with a capacity, the real tokens' capacity is below the padded batch's, and the rule drops.
MASKED_CASES = {
    "capacity-data-and-expert-axes": ({"data": 2, "expert": 2}, ("data", "expert"), 2, 1.0),
    "dropless-k2": ({"expert": 4}, ("expert",), 2, None),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if "dropless" in c else c for c in MASKED_CASES]
)
def test_a_masked_moe_equals_one_device_on_the_real_tokens_alone(case):
    """Padding tokens are not routed, take no capacity slot and count in no loss or statistic: the split layer on a
    masked batch equals one device given only the real tokens (outputs, losses, counts, dropped fraction,
    gradients), and gives zeros at the padding."""
    axes, token_axes, k, capacity_factor = MASKED_CASES[case]
    devices = int(np.prod(list(axes.values())))
    x, params = moe_inputs(devices, None)
    real = np.random.default_rng(3).random(x.shape[0]) < 0.7
    real[:TOKENS] = False  # the first device holds padding only
    cot = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    options = {"k": k, "capacity_factor": capacity_factor}
    mesh = sc.make_mesh(axes, devices=jax.devices()[:devices])
    layer = sc.MoE(Mlp(), experts=E, axis_name="expert", token_axes=token_axes, **options)

    def body(params, x, mask):
        y, state = layer.apply({"params": params}, x, mask.astype(jnp.int32), mutable=["moe"])  # 0/1 numbers
        return y, {name: value[0] for name, value in state["moe"].items()}

    specs = {"router": jax.P(), "experts": jax.P("expert")}
    in_specs = (specs, jax.P(token_axes), jax.P(token_axes))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(jax.P(token_axes), jax.P()))
    one = sc.MoE(Mlp(), experts=E, **options)

    def forward(params, apply, cot):
        y, stats = apply(params)
        return jnp.sum(y * cot) + 0.3 * stats["load_balancing_loss"] + 0.1 * stats["router_z_loss"], (y, stats)

    @jax.jit
    def both(params):
        sharded = lambda p: mapped(p, x, real)
        alone = lambda p: (lambda y, s: (y, {n: v[0] for n, v in s["moe"].items()}))(
            *one.apply({"params": p}, x[real], mutable=["moe"])
        )
        grad = lambda apply, c: jax.grad(forward, has_aux=True)(params, apply, c)
        return grad(sharded, cot), grad(alone, cot[real])

    (grads, (y, stats)), (want_grads, (want_y, want_stats)) = both(params)
    np.testing.assert_allclose(np.asarray(y)[real], want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[~real], 0.0)
    for name in ("load_balancing_loss", "router_z_loss", "dropped_fraction"):
        np.testing.assert_allclose(stats[name], want_stats[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(stats["expert_counts"], want_stats["expert_counts"])
    assert int(np.sum(stats["expert_counts"])) == k * int(real.sum())
    if capacity_factor is not None:  # the real tokens' capacity drops; the padded batch's would drop less
        assert float(stats["dropped_fraction"]) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads, want_grads)


def test_a_token_mask_of_any_leading_shape_leaves_the_padding_out_and_a_bad_one_raises():
    """On one device: a [rows, tokens] mask of 0/1 numbers and a [rows] mask broadcast over the tokens; the layer
    equals itself on the real tokens alone. Applying the whole init output counts nothing twice (init sows none)."""
    layer = sc.MoE(Mlp(), experts=E, k=2, capacity_factor=1.0)
    _, params = moe_inputs(2, None)
    x = np.random.default_rng(5).standard_normal((4, 4, D)).astype(np.float32)
    tokens = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    rows = np.array([True, False, True, True])

    @jax.jit
    def run(params):
        out = []
        for mask in (tokens, rows):
            real = np.broadcast_to(mask.reshape(4, -1) != 0, (4, 4))
            y, sown = layer.apply({"params": params}, x, mask, mutable=["moe"])
            want, want_sown = layer.apply({"params": params}, x[real], mutable=["moe"])
            out.append((y, sown["moe"], want, want_sown["moe"], real))
        return out

    for y, sown, want, want_sown, real in run(params):
        np.testing.assert_allclose(np.asarray(y)[np.asarray(real)], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(y)[~np.asarray(real)], 0.0)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), sown, want_sown)
    assert "moe" not in jax.eval_shape(layer.init, jax.random.key(0), x)
    with pytest.raises(ShapeError) as caught:
        jax.eval_shape(lambda: layer.apply({"params": params}, x, np.ones((4, 3), bool)))
    for fact in ["mask has shape (4, 3)", "x has shape (4, 4, 8)", "(4,) (rows) or (4, 4) (tokens)"]:
        assert fact in str(caught.value)


def test_moe_metrics_are_float_scalars_per_layer_with_one_per_expert_count():
    """From a Linen stack's sown [L, m, ...] values and an NNX capture; a tree without statistics raises."""
    stack = sc.PipelineStack(sc.MoE(Mlp(), experts=4, k=2), layers=2)
    x = np.random.default_rng(6).standard_normal((6, D)).astype(np.float32)

    @jit_once  # statistics of one run: the program compiles without XLA:CPU's backend optimisation
    def sown(x):
        variables = stack.init(jax.random.key(0), x)
        return stack.apply(variables, x, mutable=["moe"])[1]["moe"]

    found = sown(x)
    metrics = sc.moe_metrics(found)
    stats = found["layers"]  # the block is the layer: its statistics sit at the stack's "layers"
    counts = np.asarray(stats["expert_counts"][0]).reshape(-1, 4).sum(0)  # [L, m, E] summed over layers
    assert sorted(metrics) == sorted(
        [f"moe/layers/{f}" for f in ("load_balancing_loss", "router_z_loss", "dropped_fraction")]
        + [f"moe/layers/expert_counts/{j}" for j in range(4)]
    )
    assert all(v.shape == () and v.dtype == jnp.float32 for v in metrics.values())
    np.testing.assert_array_equal([metrics[f"moe/layers/expert_counts/{j}"] for j in range(4)], counts)
    assert counts.sum() == 2 * 2 * 6  # 2 layers, k = 2, 6 tokens
    np.testing.assert_allclose(
        metrics["moe/layers/load_balancing_loss"], np.mean(stats["load_balancing_loss"][0]), rtol=1e-6
    )
    layer = nnx_once(lambda: sc.nnx.MoE(NnxMlp, experts=4, features=D, rngs=nnx.Rngs(0)))
    _, captured = nnx.jit(lambda m, x: nnx.capture(lambda m, x: m(x), nnx.Intermediate)(m, x))(layer, x)
    assert sum(v for n, v in sc.moe_metrics(captured, prefix="").items() if n.startswith("expert_counts")) == 12
    with pytest.raises(SpmdError, match="no MoE statistics in the tree given"):
        sc.moe_metrics({"loss": jnp.ones(())})


@pytest.mark.slow  # the fast tier runs the grouped path in every other layer case
def test_grouped_experts_do_the_work_of_the_routed_rows_and_equal_the_buffer():
    """The default (grouped) layer's expert matmuls, forward and backward, count at most 1.1 x the work of the
    routed rows, 2 * 3 * k * T * (2 d h) (the static bound of the compiled program, for any routing), against E / k
    times that for the static buffer (grouped=False), with fewer temporaries; split over 4 devices the two give the
    same outputs and gradients (also under vmap and jax.checkpoint), and only the buffer takes forward-mode
    differentiation."""
    tokens, width, hidden, k = 256, 16, 32, 2

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(width)(nn.gelu(nn.Dense(hidden)(x)))

    x = np.random.default_rng(7).standard_normal((tokens, width)).astype(np.float32)
    reports = {}
    for grouped in (True, False):
        layer = sc.MoE(Wide(), experts=E, k=k, grouped=grouped)
        params = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
        grad = jax.grad(lambda p, x, layer=layer: jnp.sum(layer.apply({"params": p}, x) ** 2), argnums=(0, 1))
        reports[grouped] = sc.explain(jax.jit(grad), params, x)
    routed = 2 * 3 * k * tokens * (2 * width * hidden)
    expert_work = {g: sum(v for scope, v in r.work.by_scope.items() if "_experts" in scope) for g, r in reports.items()}
    assert routed <= expert_work[True] <= 1.1 * routed
    assert expert_work[False] == E // k * routed
    assert reports[True].memory.temp_bytes < reports[False].memory.temp_bytes

    inputs, params = moe_inputs(4, None)
    outs = {}
    for grouped in (True, False):
        _, mapped = sharded_moe({"expert": 4}, ("expert",), k=2, capacity_factor=1.0, grouped=grouped)
        outs[grouped] = jax.jit(jax.value_and_grad(lambda p, mapped=mapped: jnp.sum(mapped(p, inputs)[0] ** 2)))(params)
    np.testing.assert_allclose(outs[True][0], outs[False][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), outs[True][1], outs[False][1])
    one = {g: sc.MoE(Mlp(), experts=E, k=2, grouped=g) for g in (True, False)}
    tangent = jax.tree.map(np.ones_like, params)

    # Under vmap (a batch of token sets) and jax.checkpoint, inside grad and jit: the grouped path equals the buffer.
    def batched(g, p):
        out = jax.vmap(lambda rows: one[g].apply({"params": p}, rows))(inputs.reshape(4, -1, D))
        return jnp.sum(out**2)

    vmapped = {g: jax.jit(jax.value_and_grad(jax.checkpoint(functools.partial(batched, g))))(params) for g in one}
    np.testing.assert_allclose(vmapped[True][0], vmapped[False][0], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), vmapped[True][1], vmapped[False][1]
    )
    jvp = lambda g: jax.jit(lambda p, t: jax.jvp(lambda q: one[g].apply({"params": q}, inputs[:8]), (p,), (t,)))
    assert jvp(False).eval_shape(params, tangent)[1].shape == (8, D)
    with pytest.raises(TypeError, match="custom_vjp"):
        jvp(True).lower(params, tangent)
