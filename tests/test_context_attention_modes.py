"""The attention collectives beyond reverse mode on matching heads: ``sc.ring_attention`` and
``sc.all_to_all_attention`` in forward mode (``jax.jvp``, ``jax.linearize``, under ``jax.vmap``) and in second
derivatives equal the one-device reference; the all-to-all repeats KV heads that the axis size does not divide; an
integer 0/1 ``kv_mask`` (a tokenizer's ``attention_mask``) is a bool one; and the layout comes from the traced step's
context split, an explicit other layout raising instead of masking the wrong tokens.

Few compiled programs (all kernels, derivatives and cases of a test in one, with the reference), without XLA's
backend optimisation on CPU; tolerances as in tests/test_context_attention.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.collectives.attention import attention_reference
from spmdcomm.errors import ShapeError, SpmdError
from spmdcomm.parallel.context import ContextParallel, context_split

TOL = {"all_to_all": {"rtol": 1e-5, "atol": 1e-5}, "ring": {"rtol": 1e-5, "atol": 2e-5}}
KERNELS = {"all_to_all": sc.all_to_all_attention, "ring": sc.ring_attention}
# Test-only XLA:CPU options: the programs run once, and the optimisations do not change what is checked.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit_once(fn):
    return jax.jit(fn, compiler_options=FAST if jax.default_backend() == "cpu" else None)


def arrays(b, T, h, h_kv, d=8, *, seed=0):
    """``q, k, v`` and a tangent (or cotangent) of each, and a padding mask as a tokenizer gives it: int64 0/1, the
    last 3 tokens of row 1 padding."""
    rng = np.random.default_rng(seed)
    shapes = [(b, T, h, d), (b, T, h_kv, d), (b, T, h_kv, d)]
    primals, tangents = (tuple(rng.standard_normal(s).astype(np.float32) for s in shapes) for _ in range(2))
    attention_mask = np.ones((b, T), np.int64)
    attention_mask[-1, T - 3 :] = 0
    return primals, tangents, attention_mask


def split(fn, c, **kwargs):
    """``fn(q, k, v, kv_mask)`` over an axis ``"seq"`` of ``c`` devices, the tokens split contiguously."""
    spec = sc.P(None, "seq")
    return sc.spmd(
        lambda q, k, v, m: fn(q, k, v, "seq", causal=True, kv_mask=m, **kwargs),
        mesh=sc.make_mesh({"seq": c}, devices=jax.devices()[:c]),
        in_specs=(spec, spec, spec, spec),
        out_specs=spec,
    )


def close(got, want, tol, what):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol, err_msg=f"{what} [{i}]")


# ---------------------------------------------------------------------------------------------------------
# Forward mode and second derivatives


@functools.cache
def derivatives_program(c):
    """``{name: results}`` for both kernels and the reference: ``jax.jvp`` in all of ``q, k, v`` and in ``q`` alone,
    ``jax.linearize``, ``jax.jvp`` under ``jax.vmap`` over two tangents, ``jax.grad`` in ``k`` alone, and a
    Hessian-vector product (``jax.jvp`` of ``jax.grad``)."""

    def results(f, primals, tangents):
        q, k, v = primals
        loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
        return {
            "jvp": jax.jvp(f, primals, tangents),
            "jvp in q": jax.jvp(lambda q: f(q, k, v), (q,), (tangents[0],))[1],
            "linearize": jax.linearize(f, *primals)[1](*tangents),
            "vmap jvp": jax.vmap(lambda t: jax.jvp(f, primals, (t, *tangents[1:]))[1])(jnp.stack([q, tangents[0]])),
            "grad in k": jax.grad(loss, 1)(q, k, v),
            "hvp": jax.jvp(jax.grad(loss), primals, tangents)[1],
        }

    def run(primals, tangents, mask):
        masked = lambda g: lambda *x: g(*x, mask)
        out = {name: results(masked(split(f, c)), primals, tangents) for name, f in KERNELS.items()}
        one = functools.partial(attention_reference, causal=True, kv_mask=mask != 0)
        out["reference"] = results(one, primals, tangents)
        return out

    return jit_once(run)


def test_forward_mode_and_second_derivatives_equal_one_device():
    """Before, ``jax.jvp`` and ``jax.linearize`` of the ring raised (a custom VJP refuses forward mode)."""
    primals, tangents, attention_mask = arrays(2, 16, 8, 4)
    got = derivatives_program(4)(primals, tangents, attention_mask)
    reference = got.pop("reference")
    for name, results in got.items():
        for what, value in results.items():
            close(value, reference[what], TOL[name], f"{name}: {what}")


# ---------------------------------------------------------------------------------------------------------
# Grouped-query attention in the all-to-all


# (heads, KV heads, axis size, the repeat that makes the KV heads split)
GROUPED = [(8, 2, 4, 2), (12, 3, 4, 4), (4, 1, 4, 4)]


def grouped_case(heads, kv_heads, c):
    return arrays(1, 4 * c, heads, kv_heads)


@functools.cache
def grouped_results():
    """``{case: (all-to-all, reference)}``, each the output and the vjp in ``q, k, v``: one program for every case."""

    def one(case, primals, cotangent, mask):
        f = split(sc.all_to_all_attention, case[2])
        out, pullback = jax.vjp(lambda *x: f(*x, mask), *primals)
        one, one_pullback = jax.vjp(lambda *x: attention_reference(*x, causal=True, kv_mask=mask != 0), *primals)
        return (out, pullback(cotangent)), (one, one_pullback(cotangent))

    def run(inputs):
        return [one(case, *args) for case, args in zip(GROUPED, inputs)]

    inputs = []
    for case in GROUPED:
        primals, (cotangent, _, _), attention_mask = grouped_case(*case[:3])
        inputs.append((primals, cotangent, attention_mask))
    return dict(zip(GROUPED, jit_once(run)(inputs)))


@pytest.mark.parametrize("heads, kv_heads, c, repeat", GROUPED, ids=lambda x: str(x))
def test_all_to_all_repeats_kv_heads_that_the_axis_does_not_divide(heads, kv_heads, c, repeat):
    """The fewest copies of each KV head whose count the axis divides; outputs and the gradients (the copies' summed
    into each KV head) equal one device's. Before, these raised a ShapeError."""
    seen = []

    def kernel(q, k, v, *, mask):
        seen.append((q.shape[2], k.shape[2]))
        return jax.nn.dot_product_attention(q, k, v, mask=mask)

    (q, k, v), _, attention_mask = grouped_case(heads, kv_heads, c)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, attention_mask)]
    jax.eval_shape(split(sc.all_to_all_attention, c, kernel=kernel), *structs)
    assert seen == [(heads // c, kv_heads * repeat // c)]

    got, want = grouped_results()[heads, kv_heads, c, repeat]
    close(got, want, TOL["all_to_all"], f"{heads} heads, {kv_heads} KV heads, {c} devices")


# ---------------------------------------------------------------------------------------------------------
# Integer masks


@pytest.mark.parametrize("fn", [sc.ring_attention, sc.all_to_all_attention, None], ids=["ring", "all_to_all", "one"])
def test_kv_mask_takes_ints_and_names_its_contract(fn):
    """Any int dtype is a mask, nonzero attends (inside jit the values cannot be checked); a float one is refused with
    the contract in the fix."""
    x = jax.ShapeDtypeStruct((2, 8, 4, 8), jnp.float32)
    call = functools.partial(attention_reference, causal=True) if fn is None else split(fn, 2)
    mask = lambda dtype: jax.ShapeDtypeStruct((2, 8), dtype)
    one = lambda *args: call(*args) if fn is not None else call(*args[:3], kv_mask=args[3])
    for dtype in (jnp.int32, jnp.uint8, jnp.int8, jnp.bool_):
        assert jax.eval_shape(one, x, x, x, mask(dtype)).shape == x.shape
    with pytest.raises(ShapeError) as error:
        jax.eval_shape(one, x, x, x, mask(jnp.float32))
    message = str(error.value)
    for part in ("kv_mask is float32 (", "bool or int", "Fix:", "nonzero", "attention_mask"):
        assert part in message, message


# ---------------------------------------------------------------------------------------------------------
# The layout of the step


ZIGZAG_STEP = ContextParallel(axis="seq", layout="zigzag")


def in_step(fn, *, layout=None, axis="seq", step=ZIGZAG_STEP):
    """``fn(q, k, v, axis, causal=True[, layout=])`` and ``sc.sequence_positions`` traced inside ``step``'s context
    split (None: none), over 4 devices."""
    extra = {} if layout is None else {"layout": layout}

    def local(q, k, v):
        with context_split(step):
            return fn(q, k, v, axis, causal=True, **extra), sc.sequence_positions(q.shape[1], axis, **extra)

    spec = sc.P(None, axis)
    mesh = sc.make_mesh({axis: 4}, devices=jax.devices()[:4])
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, sc.P(axis)))


def test_the_kernels_take_the_layout_of_the_steps_context_split():
    """Inside a step whose split is zig-zag, a kernel given no layout is the zig-zag one (the same program), and
    ``sequence_positions`` the zig-zag positions, where before both were contiguous: a causal mask over the wrong
    positions. Outside a step, or in a step that splits another axis, no layout is contiguous."""
    x = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.float32)
    for name, fn in KERNELS.items():
        inherited = jax.make_jaxpr(in_step(fn))(x, x, x)
        explicit = jax.make_jaxpr(in_step(fn, layout="zigzag", step=None))(x, x, x)
        contiguous = jax.make_jaxpr(in_step(fn, layout="contiguous", step=None))(x, x, x)
        assert str(inherited) == str(explicit) != str(contiguous), name

    mesh = sc.make_mesh({"seq": 4}, devices=jax.devices()[:4])

    def positions(step):
        with context_split(step):
            return sc.sequence_positions(4, "seq")

    steps = (ZIGZAG_STEP, ContextParallel(axis="context", layout="zigzag"), None)
    run = jax.shard_map(lambda: [positions(step) for step in steps], mesh=mesh, in_specs=(), out_specs=sc.P("seq"))
    got = jit_once(run)()
    assert [np.asarray(p).tolist() for p in got] == [sc.zigzag_order(16, 4).tolist()] + [list(range(16))] * 2


@pytest.mark.parametrize("fn", [sc.ring_attention, sc.all_to_all_attention], ids=["ring", "all_to_all"])
def test_a_layout_other_than_the_steps_is_named(fn):
    x = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.float32)
    with pytest.raises(SpmdError) as error:
        jax.eval_shape(in_step(fn, layout="contiguous"), x, x, x)
    message = str(error.value)
    for part in ("layout='contiguous'", "'zigzag' layout", "axis 'seq'", "Fix:", "leave layout out"):
        assert part in message, message
    # The step's own layout, explicitly; over another axis than the step's, any layout.
    assert jax.eval_shape(in_step(fn, layout="zigzag"), x, x, x)[0].shape == x.shape
    other = ContextParallel(axis="context", layout="zigzag")
    assert jax.eval_shape(in_step(fn, layout="contiguous", step=other), x, x, x)[0].shape == x.shape


def test_the_layout_error_is_raised_for_sequence_positions_too():
    f = lambda: sc.sequence_positions(4, "seq", layout="contiguous")
    mesh = sc.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    with context_split(ContextParallel(axis="seq")), pytest.raises(SpmdError, match=re.escape("layout='contiguous'")):
        jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=sc.P("seq")))
