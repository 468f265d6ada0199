"""The attention kernels of context parallelism (spmdcomm.train.attention): all-to-all (Ulysses) and ring attention
inside a hand-written ``shard_map`` equal the one-device reference, forward and backward, for causal and full
attention, padding, packed segments, grouped-query heads, the contiguous and the zig-zag split, and a batch split
over a data axis too; the ring's backward pass keeps no block's probabilities; wrong head counts are named.

Each case compiles one program: both algorithms and the reference, outputs and gradients (float32). Tolerances,
elementwise: all-to-all ``rtol=atol=1e-5``; ring ``rtol=1e-5, atol=2e-5`` (it sums the softmax blockwise; the
largest errors measured were about 5e-7 of the largest entry, for the all-to-all about 2e-7).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdcomm.errors import ShapeError, SpmdError
from spmdcomm.train import _attention_blocks as blocks
from spmdcomm.train import attention

TOL = {"ulysses": {"rtol": 1e-5, "atol": 1e-5}, "ring": {"rtol": 1e-5, "atol": 2e-5}}
KERNELS = {"ulysses": attention.ulysses_attention, "ring": attention.ring_attention}


def mesh_of(data, c):
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, c), ("data", "context"), axis_types=auto, devices=jax.devices()[: data * c])


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
    """One compiled program: ``{name: (out, (dq, dk, dv))}`` for the kernels and the reference. Its inputs are in
    storage order (the split's), ``pos`` ``[b, T]`` the place of each stored token in the sequence. ``per_row``
    passes positions, segments and validity as ``[b, t_local]`` arrays; else positions come from
    ``local_positions`` and segments and validity are ``[t_local]`` (the first row's, which all rows share)."""
    mesh = mesh_of(data, c)
    spec = P("data" if data > 1 else None, "context")
    names = ["ulysses"] if kernel is not None else list(KERNELS)

    def local(fn, q, k, v, pos, seg, valid):
        if not per_row:
            pos = attention.local_positions(q.shape[1], "context", layout)
            seg, valid = seg[0], valid[0]
        extra = {"kernel": kernel} if kernel is not None else {}
        return fn(
            q, k, v, axis="context", q_pos=pos, k_pos=pos, causal=causal,
            q_segments=seg if segments else None, k_segments=seg if segments else None,
            k_valid=valid if padding else None, **extra,
        )  # fmt: skip

    def value_and_grads(fn, q, k, v, ct):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(ct)

    def run(q, k, v, ct, pos, seg, valid):
        results = {}
        for name in names:
            mapped = jax.shard_map(
                functools.partial(local, KERNELS[name]), mesh=mesh, in_specs=(spec,) * 6, out_specs=spec
            )
            results[name] = value_and_grads(lambda q, k, v, f=mapped: f(q, k, v, pos, seg, valid), q, k, v, ct)
        # The reference on the tokens in sequence order (positions 0..T-1), its results put back in storage order.
        back = jnp.argsort(pos[0])
        seq = lambda x: x[:, back]
        reference = functools.partial(
            attention.attention_reference, q_pos=jnp.arange(q.shape[1]), k_pos=jnp.arange(q.shape[1]),
            causal=causal, q_segments=seq(seg) if segments else None, k_segments=seq(seg) if segments else None,
            k_valid=seq(valid) if padding else None,
        )  # fmt: skip
        out, grads = value_and_grads(reference, seq(q), seq(k), seq(v), seq(ct))
        results["reference"] = (out[:, pos[0]], tuple(g[:, pos[0]] for g in grads))
        return results

    return jax.jit(run)


def run_case(data, c, causal, layout, segments, padding, per_row, h, hk, kernel=None, b=2, d=8):
    T = 8 * c
    q, k, v, ct = inputs(b, T, h, hk, d)
    seg, valid = token_info(b, T, segments=segments, padding=padding, per_row=per_row)
    order = attention.zigzag_order(T, c) if layout == "zigzag" else np.arange(T)
    stored = lambda x: np.ascontiguousarray(x[:, order])
    pos = np.broadcast_to(order, (b, T)).astype(np.int32)
    run = program(data, c, causal, layout, segments, padding, per_row, kernel)
    results = run(*map(stored, (q, k, v, ct)), pos, stored(seg), stored(valid))
    return jax.tree.map(np.asarray, results), stored(seg), stored(valid)


# (data, c, causal, layout, segments, padding, per_row, heads, kv heads)
CASES = [
    (1, 2, True, "contiguous", False, False, False, 4, 4),
    (1, 2, False, "zigzag", False, True, False, 4, 2),
    (1, 4, True, "zigzag", True, True, False, 8, 4),
    (1, 4, True, "contiguous", False, True, True, 4, 4),
    (1, 8, True, "zigzag", True, True, False, 8, 8),
    (1, 8, False, "contiguous", True, False, False, 16, 8),
    (2, 4, True, "zigzag", True, True, True, 8, 4),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_both_algorithms_equal_the_reference_forward_and_backward(case):
    results, seg, valid = run_case(*case)
    out_ref, grads_ref = results.pop("reference")
    for name, (out, grads) in results.items():
        np.testing.assert_allclose(out, out_ref, **TOL[name], err_msg=f"{name} output")
        for x, g, g_ref in zip("qkv", grads, grads_ref):
            np.testing.assert_allclose(g, g_ref, **TOL[name], err_msg=f"{name} d{x}")
        # A padding query (segment 0) sees only padding keys: zeros, in the output and its gradient, never NaN.
        empty = ~valid & (seg == 0) if case[4] else np.zeros_like(valid)
        assert np.all(out[empty] == 0) and np.all(grads[0][empty] == 0)
        assert all(np.isfinite(x).all() for x in (out, *grads))


def test_ulysses_runs_jax_dot_product_attention_with_the_mask():
    results, seg, valid = run_case(1, 4, True, "zigzag", True, True, False, 8, 4, kernel=jax.nn.dot_product_attention)
    out_ref, grads_ref = results["reference"]
    out, grads = results["ulysses"]
    np.testing.assert_allclose(out, out_ref, **TOL["ulysses"])
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, **TOL["ulysses"])


def test_the_ring_backward_keeps_no_block_probabilities():
    """Autodiff through the forward ring keeps every step's probabilities (``c - 1`` blocks of ``t_local^2``);
    the custom VJP keeps q, k, v, the output and the log-sum-exp and recomputes them, one block at a time."""
    c, T = 8, 2048
    mesh = mesh_of(1, c)
    spec = P(None, "context")

    def temp_bytes(custom):
        def local(q, k, v):
            pos = attention.local_positions(q.shape[1], "context", "zigzag")
            if custom:
                return attention.ring_attention(q, k, v, axis="context", q_pos=pos, k_pos=pos, causal=True)
            side = (pos[None], None, None)
            return blocks.ring_forward("context", True, q, k, v, side, side)[0]

        mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(mapped(q, k, v)), (0, 1, 2)))
        x = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)
        return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    block = (T // c) ** 2 * 4  # one block's float32 scores
    custom, autodiff = temp_bytes(True), temp_bytes(False)
    assert custom < 6 * block and autodiff > (c - 1) * block and 2 * custom < autodiff, (custom, autodiff, block)


def test_zigzag_order_and_local_positions_agree():
    order = attention.zigzag_order(16, 4)
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert np.array_equal(order[attention.zigzag_inverse(16, 4)], np.arange(16))
    mesh = mesh_of(1, 4)
    for layout, expected in (("zigzag", order), ("contiguous", np.arange(16))):
        f = lambda layout=layout: attention.local_positions(4, "context", layout)
        got = jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=P("context"))()
        assert got.dtype == jnp.int32 and np.array_equal(got, expected)


def trace(fn, q_shape, kv_shape, c, **kwargs):
    """Traces ``fn`` over a ``context`` axis of size ``c`` (errors are raised while tracing: nothing compiles)."""
    spec = P(None, "context")

    def local(q, k, v):
        pos = attention.local_positions(q.shape[1], "context")
        return fn(q, k, v, axis="context", q_pos=pos, k_pos=pos, causal=True, **kwargs)

    mapped = jax.shard_map(local, mesh=mesh_of(1, c), in_specs=(spec,) * 3, out_specs=spec)
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (q_shape, kv_shape, kv_shape)]
    return jax.eval_shape(mapped, *shapes)


@pytest.mark.parametrize(
    "heads, kv_heads, named",
    [(6, 6, "6 heads"), (8, 2, "2 KV heads"), (12, 6, "6 KV heads")],
)
def test_ulysses_names_heads_that_do_not_split_over_the_context_axis(heads, kv_heads, named):
    with pytest.raises(ShapeError) as error:
        trace(attention.ulysses_attention, (1, 16, heads, 8), (1, 16, kv_heads, 8), 4)
    message = str(error.value)
    for part in (named, f"q {heads} heads", f"k/v {kv_heads} KV heads", "'context' of size 4", "Fix:", "ring"):
        assert part in message, message
    # The ring takes any head count.
    assert trace(attention.ring_attention, (1, 16, heads, 8), (1, 16, kv_heads, 8), 4).shape == (1, 16, heads, 8)


@pytest.mark.parametrize(
    "q_shape, kv_shape, kwargs, error, text",
    [
        ((1, 16, 4, 8), (1, 16, 3, 8), {}, ShapeError, "kv_heads dividing heads"),
        ((1, 16, 4, 8), (1, 16, 4, 4), {}, ShapeError, "head_dim"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"q_segments": np.zeros(4, np.int32)}, SpmdError, "go together"),
        ((1, 16, 4, 8), (1, 16, 4, 8), {"k_valid": np.ones(3, bool)}, ShapeError, "k_valid has shape (3,)"),
    ],
)
def test_shapes_that_do_not_fit_are_named(q_shape, kv_shape, kwargs, error, text):
    for fn in KERNELS.values():
        with pytest.raises(error, match=re.escape(text)):
            trace(fn, q_shape, kv_shape, 4, **kwargs)


def test_layout_errors_are_named():
    with pytest.raises(ShapeError, match="does not cut into 2 c = 8 equal chunks"):
        attention.zigzag_order(12, 4)
    with pytest.raises(ShapeError, match="t_local=3 is odd"):
        jax.eval_shape(
            jax.shard_map(
                lambda: attention.local_positions(3, "context", "zigzag"),
                mesh=mesh_of(1, 2), in_specs=(), out_specs=P("context"),
            )
        )  # fmt: skip
    with pytest.raises(SpmdError, match="layout='striped'"):
        jax.eval_shape(
            jax.shard_map(
                lambda: attention.local_positions(4, "context", "striped"),
                mesh=mesh_of(1, 2), in_specs=(), out_specs=P("context"),
            )
        )  # fmt: skip
