"""The attention collectives (spmdcomm.collectives.attention): ``sc.ring_attention`` and ``sc.all_to_all_attention``
inside ``sc.spmd`` over an axis of any name equal plain one-device softmax attention (NumPy), forward and backward,
for causal and full attention, padding, packed segments, grouped-query heads, the contiguous and the zig-zag layout,
and a batch split over a data axis too; the train step's ``sc.context_attention`` is the same function; the ring's
memory falls with the axis size at every size; every argument is checked, in a mapping or not.

Each case compiles one program: both algorithms, outputs and gradients (float32), checked against NumPy.
Tolerances, elementwise: all-to-all ``rtol=atol=1e-5``; ring ``rtol=1e-5, atol=2e-5`` (it sums the softmax
blockwise; the largest errors measured were about 5e-7 of the largest entry, for the all-to-all about 2e-7).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.collectives import _attention_blocks as blocks
from spmdcomm.errors import AxisError, ShapeError, SpmdError
from spmdcomm.parallel.context import ContextParallel, context_split

TOL = {"all_to_all": {"rtol": 1e-5, "atol": 1e-5}, "ring": {"rtol": 1e-5, "atol": 2e-5}}
KERNELS = {"all_to_all": sc.all_to_all_attention, "ring": sc.ring_attention}


def mesh_of(data, c, axis="seq"):
    return sc.make_mesh({"data": data, axis: c}, devices=jax.devices()[: data * c])


def numpy_attention(q, k, v, *, causal, seg, valid):
    """Plain softmax attention of whole sequences in order, float64: the reference."""
    b, T, h, d = q.shape
    kk, vv = (np.repeat(x.astype(np.float64), h // k.shape[2], axis=2) for x in (k, v))  # head j reads j // g
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / np.sqrt(d)
    see = np.ones((b, T, T), bool)
    if causal:
        see &= np.tril(np.ones((T, T), bool))
    see &= seg[:, :, None] == seg[:, None, :]
    see &= valid[:, None, :]
    s = np.where(see[:, None], s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(top), top, 0))
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", p, vv)


def inputs(b, T, h, hk, d, *, seed=0):
    rng = np.random.default_rng(seed)
    q, ct = (rng.standard_normal((b, T, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, T, hk, d)).astype(np.float32) for _ in range(2))
    return q, k, v, ct


def token_info(b, T, *, segments, padding, per_row):
    """Per row: segment ids (packed sequences, of different lengths in each row with ``per_row``; padding is segment
    0) and validity. A padding query sees only padding keys, which are invalid: its row of the attention is empty."""
    pos = np.arange(T)
    pad = T // 8 if padding else 0
    valid = np.broadcast_to(pos < T - pad, (b, T))
    if segments:
        shifts = range(b) if per_row else [0] * b
        cuts = [np.searchsorted([T // 3 + 2 * r, 2 * T // 3 - r], pos, side="right") + 1 for r in shifts]
        seg = np.where(valid, np.stack(cuts), 0)
    else:
        seg = np.where(valid, 1, 0)
    return seg.astype(np.int32), valid


@functools.cache
def program(data, c, causal, layout, segments, padding, per_row, kernel=None):
    """One compiled program: ``{name: (out, (dq, dk, dv))}`` of the collectives in ``sc.spmd`` over an axis
    ``"seq"``, inputs in storage order (the layout's). Segments and validity are ``[b, t]`` with ``per_row``, else
    ``[t]`` (the first row's, which all rows share)."""
    spec = sc.P("data" if data > 1 else None, "seq")
    names = ["all_to_all"] if kernel is not None else list(KERNELS)

    def local(fn, q, k, v, seg, valid):
        if not per_row:
            seg, valid = seg[0], valid[0]
        extra = {"kernel": kernel} if kernel is not None else {}
        return fn(
            q, k, v, "seq", causal=causal, layout=layout, segment_ids=seg if segments else None,
            kv_mask=valid if padding else None, **extra,
        )  # fmt: skip

    def run(q, k, v, ct, seg, valid):
        results = {}
        for name in names:
            mapped = sc.spmd(
                lambda *args, f=KERNELS[name]: local(f, *args), mesh=mesh_of(data, c), in_specs=spec, out_specs=spec
            )
            out, pullback = jax.vjp(lambda q, k, v, f=mapped: f(q, k, v, seg, valid), q, k, v)
            results[name] = (out, pullback(ct))
        return results

    return jax.jit(run)


def run_case(data, c, causal, layout, segments, padding, per_row, h, hk, kernel=None, b=2, d=8):
    """The collectives' results in sequence order, and the NumPy reference's output and gradients (by the vjp of
    float64 attention, taken with jax on the CPU in float64-free form: central differences are too slow, so the
    reference gradients come from ``blocks.attend``'s autodiff, itself checked against NumPy's output)."""
    T = 8 * c
    q, k, v, ct = inputs(b, T, h, hk, d)
    seg, valid = token_info(b, T, segments=segments, padding=padding, per_row=per_row)
    order = sc.zigzag_order(T, c) if layout == "zigzag" else np.arange(T)
    stored = lambda x: np.ascontiguousarray(x[:, order])
    results = program(data, c, causal, layout, segments, padding, per_row, kernel)(
        *map(stored, (q, k, v, ct, seg, valid))
    )
    back = np.argsort(order)
    results = {n: (np.asarray(o)[:, back], tuple(np.asarray(g)[:, back] for g in gs)) for n, (o, gs) in results.items()}
    return results, (q, k, v, ct), seg, valid


def reference(q, k, v, ct, *, causal, seg, valid):
    """NumPy's output, and the gradients of the one-device kernel (``attention_reference``), whose output equals
    NumPy's (checked here)."""
    out = numpy_attention(q, k, v, causal=causal, seg=seg, valid=valid)
    one, grads = _one_device(q, k, v, ct, seg, valid, causal=causal)
    np.testing.assert_allclose(one, out, rtol=1e-5, atol=1e-5)
    return out, grads


@functools.partial(jax.jit, static_argnames="causal")
def _one_device(q, k, v, ct, seg, valid, *, causal):
    """The one-device kernel's output and vjp, as one program (run eagerly, it compiled one per op)."""
    plain = functools.partial(
        sc.collectives.attention.attention_reference, causal=causal, segment_ids=seg, kv_mask=valid
    )
    one, pullback = jax.vjp(plain, q, k, v)
    return one, pullback(ct)


# (data, c, causal, layout, segments, padding, per_row, heads, kv heads); the first three are the fast tier.
CASES = [
    (1, 2, True, "contiguous", False, False, False, 4, 4),
    (1, 4, True, "zigzag", True, True, False, 8, 4),
    (2, 4, True, "zigzag", True, True, True, 8, 4),
    pytest.param((1, 2, False, "zigzag", False, True, False, 4, 2), marks=pytest.mark.slow),
    pytest.param((1, 4, True, "contiguous", False, True, True, 4, 4), marks=pytest.mark.slow),
    pytest.param((1, 8, True, "zigzag", True, True, False, 8, 8), marks=pytest.mark.slow),
    pytest.param((1, 8, False, "contiguous", True, False, False, 16, 8), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_both_algorithms_equal_plain_attention_forward_and_backward(case):
    results, (q, k, v, ct), seg, valid = run_case(*case)
    segments, padding = case[4:6]
    out_ref, grads_ref = reference(
        q, k, v, ct, causal=case[2], seg=seg if segments else np.ones_like(seg), valid=valid | (not padding)
    )
    for name, (out, grads) in results.items():
        np.testing.assert_allclose(out, out_ref, **TOL[name], err_msg=f"{name} output")
        for x, g, g_ref in zip("qkv", grads, grads_ref):
            np.testing.assert_allclose(g, g_ref, **TOL[name], err_msg=f"{name} d{x}")
        # A padding query (segment 0) sees only padding keys: zeros, in the output and its gradient, never NaN.
        empty = ~valid & (seg == 0) if segments else np.zeros_like(valid)
        assert np.all(out[empty] == 0) and np.all(grads[0][empty] == 0)
        assert all(np.isfinite(x).all() for x in (out, *grads))


@pytest.mark.slow
def test_all_to_all_runs_jax_dot_product_attention_with_the_mask():
    case = (1, 4, True, "zigzag", True, True, False, 8, 4)
    results, (q, k, v, ct), seg, valid = run_case(*case, kernel=jax.nn.dot_product_attention)
    out_ref, grads_ref = reference(q, k, v, ct, causal=True, seg=seg, valid=valid)
    out, grads = results["all_to_all"]
    np.testing.assert_allclose(out, out_ref, **TOL["all_to_all"])
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, **TOL["all_to_all"])


@pytest.mark.parametrize("algorithm", ["ring", "all_to_all"])
def test_the_step_attention_is_the_collective_under_jit_and_vmap(algorithm):
    """Inside a step's context split, ``sc.context_attention`` is the collective over the split's axis and layout,
    bit for bit; and both compose with ``jax.vmap`` (over a leading axis) and raw ``jax.shard_map``."""
    q, k, v, _ = inputs(3, 16, 8, 4, 8)
    spec = sc.P(None, None, "ctx")
    split = ContextParallel(axis="ctx", layout="zigzag")

    def both(q, k, v):
        with context_split(split):
            step = sc.context_attention(q, k, v, causal=True, algorithm=algorithm)
        return step, KERNELS[algorithm](q, k, v, "ctx", causal=True, layout="zigzag")

    mesh = sc.make_mesh({"ctx": 4}, devices=jax.devices()[:4])
    mapped = jax.jit(jax.shard_map(jax.vmap(both), mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    zigzag = sc.zigzag_order(16, 4)
    stack = lambda x: np.stack([x, x[::-1]])[:, :, zigzag]  # two different batches for vmap, stored in zig-zag
    step, collective = mapped(stack(q), stack(k), stack(v))
    assert np.array_equal(step, collective)
    ones = np.ones((3, 16), bool)
    for i, rows in enumerate((slice(None), slice(None, None, -1))):
        want = numpy_attention(q[rows], k[rows], v[rows], causal=True, seg=ones, valid=ones)
        np.testing.assert_allclose(np.asarray(collective[i])[:, np.argsort(zigzag)], want, **TOL[algorithm])


def test_the_ring_memory_falls_with_the_axis_size_at_every_size():
    """The compiled temporaries of one causal ring attention layer's gradient fall about 4x per doubling of the
    axis (one ``t x t`` block of scores live at a time): at ``c = 2`` too, where a loop of one hop used to be unrolled
    by XLA and both steps' blocks computed at once (0.50x of ``c = 1`` instead of 0.26x); and autodiff through the
    forward ring would keep every step's probabilities."""
    T = 256

    def temp_bytes(c, custom=True):
        def local(q, k, v):
            if custom:
                return sc.ring_attention(q, k, v, "seq", causal=True, layout="zigzag")
            side = (sc.sequence_positions(q.shape[1], "seq", layout="zigzag")[None], None, None)
            return blocks.ring_forward("seq", True, q, k, v, side, side)[0]

        mesh = sc.make_mesh({"seq": c}, devices=jax.devices()[:c])
        mapped = sc.spmd(local, mesh=mesh, in_specs=sc.P(None, "seq"), out_specs=sc.P(None, "seq"))
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(mapped(q, k, v)), (0, 1, 2)))
        x = jax.ShapeDtypeStruct((1, T, 1, 8), jnp.float32)
        return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    temps = {c: temp_bytes(c) for c in (1, 2, 4, 8)}
    for small, large in ((1, 2), (2, 4), (4, 8)):
        assert temps[large] < 0.4 * temps[small], temps
    block = (T // 8) ** 2 * 4  # one block's float32 scores at c = 8
    autodiff = temp_bytes(8, custom=False)
    assert autodiff > 7 * block and 2 * temps[8] < autodiff, (temps, autodiff, block)


def test_zigzag_order_and_sequence_positions_agree():
    order = sc.zigzag_order(16, 4)
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    mesh = sc.make_mesh({"any_name": 4}, devices=jax.devices()[:4])
    for layout, expected in (("zigzag", order), ("contiguous", np.arange(16))):
        f = lambda layout=layout: sc.sequence_positions(4, "any_name", layout=layout)
        got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=sc.P("any_name")))()
        assert got.dtype == jnp.int32 and np.array_equal(got, expected)


def trace(fn, q_shape, kv_shape, c, **kwargs):
    """Traces ``fn`` over an axis ``"seq"`` of size ``c`` (errors are raised while tracing: nothing compiles)."""
    mapped = sc.spmd(
        lambda q, k, v: fn(q, k, v, "seq", causal=True, **kwargs),
        mesh=sc.make_mesh({"seq": c}, devices=jax.devices()[:c]), in_specs=sc.P(None, "seq"),
        out_specs=sc.P(None, "seq"),
    )  # fmt: skip
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (q_shape, kv_shape, kv_shape)]
    return jax.eval_shape(mapped, *shapes)


@pytest.mark.parametrize("heads, kv_heads", [(6, 6), (6, 2), (2, 1)])
def test_all_to_all_names_query_heads_that_do_not_split_over_the_axis(heads, kv_heads):
    """Query heads that the axis size does not divide cannot be split (KV heads are repeated until they split)."""
    with pytest.raises(ShapeError) as error:
        trace(sc.all_to_all_attention, (1, 16, heads, 8), (1, 16, kv_heads, 8), 4)
    message = str(error.value)
    for part in (f"q has {heads} heads", f"k/v {kv_heads} KV heads", "'seq' of size 4", "Fix:", "ring_attention"):
        assert part in message, message
    # The ring takes any head count.
    assert trace(sc.ring_attention, (1, 16, heads, 8), (1, 16, kv_heads, 8), 4).shape == (1, 16, heads, 8)


@pytest.mark.parametrize(
    "q_shape, kv_shape, kwargs, error, text",
    [
        ((1, 16, 4, 8), (1, 16, 3, 8), {}, ShapeError, "3 KV heads do not divide 4 query heads"),
        ((1, 16, 4, 8), (1, 16, 4, 4), {}, ShapeError, "k (1, 4, 4, 4)"),
        ((1, 16, 4, 8), (1, 8, 4, 8), {}, ShapeError, "the same batch, tokens"),
        ((1, 16, 4), (1, 16, 4), {}, ShapeError, "[batch, tokens, heads, head_dim]"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"kv_mask": np.ones(3, bool)}, ShapeError, "kv_mask is bool (3,)"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"kv_mask": np.ones(4)}, ShapeError, "kv_mask is float32 (4,)"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"segment_ids": np.ones((2, 4), np.int32)}, ShapeError, "[1, 4]"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"layout": "striped"}, SpmdError, "layout='striped'"),
        ((1, 12, 4, 8), (1, 12, 4, 8), {"layout": "zigzag"}, ShapeError, "holds 3 tokens (odd)"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"causal": jnp.array(True)}, SpmdError, "is not a bool"),
    ],
)
def test_arguments_that_do_not_fit_are_named(q_shape, kv_shape, kwargs, error, text):
    kwargs = dict(kwargs)
    causal = kwargs.pop("causal", True)
    for fn in KERNELS.values():
        call = functools.partial(fn, causal=causal, **kwargs)
        with pytest.raises(error, match=re.escape(text)) as raised:
            trace(lambda q, k, v, axis, causal, f=call: f(q, k, v, axis), q_shape, kv_shape, 4)
        assert "Fix:" in str(raised.value)


@pytest.mark.parametrize(
    "call, error, text",
    [
        # The case: a typo outside a step raised nothing and gave plain attention.
        (lambda x: sc.context_attention(x, x, x, algorithm="ulysses"), SpmdError, "algorithm='ulysses'"),
        (lambda x: sc.context_attention(x, x[:, :, :1, :3], x[:, :, :1, :3]), ShapeError, "do not fit"),
        (lambda x: sc.context_attention(x, x, x, kv_mask=np.ones(5, bool)), ShapeError, "kv_mask is bool (5,)"),
        (lambda x: sc.ring_attention(x, x, x, "seq"), AxisError, "axis='seq' is not a bound axis"),
        (lambda x: sc.all_to_all_attention(x, x, x, ("seq",)), SpmdError, "is not a mesh axis name"),
        (lambda x: sc.all_to_all_attention(x, x, x, "seq", kernel=3), SpmdError, "kernel=3 is not callable"),
    ],
)
def test_arguments_are_checked_outside_any_mapping(call, error, text):
    with pytest.raises(error, match=re.escape(text)):
        call(jnp.ones((1, 8, 2, 4)))


def test_a_wrong_algorithm_is_named_inside_a_step_split_too():
    with context_split(ContextParallel(axis="ctx")), pytest.raises(SpmdError, match="algorithm='ulysses'"):
        sc.context_attention(*(jnp.ones((1, 8, 2, 4)),) * 3, algorithm="ulysses")
