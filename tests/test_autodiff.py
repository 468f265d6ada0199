"""Derivatives of every collective equal those of the same program written with raw jax.lax.

Each case pairs a spmdcomm call with a reference built only from differentiable ``jax.lax`` primitives
(``psum``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``axis_index``) inside raw ``jax.shard_map``. Both
run on device ``i``'s block; one compiled function per (case, backend, device count) computes, for ours and
for the reference:

- the forward value;
- ``jvp`` and ``vjp`` (and ``linear_transpose`` for linear collectives) of the whole mapped function;
- ``grad`` taken inside the mapped function, of a loss weighted per device, and of the plain sum of the
  output (where JAX's backends differ: under ``shard_map`` with ``check_vma=True`` the cotangent of an
  identical-on-every-device output is not summed over devices, under ``pmap`` it is).

The pmap backend is compared with the reference under ``shard_map(check_vma=False)``, which is what
``jax.pmap`` runs in JAX 0.10.

Which cases run: every case on the shard_map backend over 1, 2 and 8 devices, and on the pmap backend over 4. One
device is the degenerate axis; two, where a device's left and right neighbours are the same device and the root's
other device is the only one; eight, the general case (4 added nothing that 2 and 8 do not show).
Since JAX 0.10 jax.pmap is jit(shard_map), so the pmap backend differentiates the same collective programs; what
differs between the backends is the cotangent convention of ``grad_inside_sum`` above, and that does not depend
on the device count. The fast tier (``-m "not slow"``) runs the table on shard_map over 2 devices; the other
tables and the compositions (one XLA compile of every case each) and the half floats are slow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import spmdcomm as sc
from spmdcomm import P
from spmdcomm.collectives.rooted import _broadcast_leaf

AX = "data"
BACKENDS = ["shard_map", "pmap"]


def idx() -> jax.Array:
    return lax.axis_index(AX)


def nax() -> int:
    return lax.axis_size(AX)


# ---------------------------------------------------------------------------------------------------------
# References: the same programs from raw lax primitives (sums and selects, no spmdcomm).


def stack(v: jax.Array) -> jax.Array:
    """Every device's block, stacked on a new leading axis, identical on every device: a psum of one-hots."""
    n = nax()
    onehot = (jnp.arange(n) == idx()).reshape((n,) + (1,) * v.ndim)
    return lax.psum(jnp.where(onehot, v[None], jnp.zeros_like(v[None])), AX)


def bcast_ref(v: jax.Array, root: int) -> jax.Array:
    return lax.psum(jnp.where(idx() == root, v, jnp.zeros_like(v)), AX)


def my_chunk(v: jax.Array, dim: int = 0) -> jax.Array:
    c = v.shape[dim] // nax()
    return lax.dynamic_slice_in_dim(v, idx() * c, c, axis=dim)


def reduce_ref(op: str, v: jax.Array) -> jax.Array:
    if op == "sum":
        return lax.psum(v, AX)
    if op == "mean":
        return lax.pmean(v, AX)
    return {"max": jnp.max, "min": jnp.min, "prod": jnp.prod}[op](stack(v), axis=0)


def scan_ref(op: str, inclusive: bool, v: jax.Array) -> jax.Array:
    # A masked reduction over the stacked blocks rather than jnp.cumprod / lax.cummax: the derivatives of those
    # crash XLA:CPU's compiler in jax 0.11.2 (segfault), while the masked form is the same function.
    s = stack(v)
    devices = jnp.arange(s.shape[0]).reshape((-1,) + (1,) * (s.ndim - 1))
    upto = devices <= idx() if inclusive else devices < idx()
    ident = {"sum": 0.0, "prod": 1.0, "max": -jnp.inf, "min": jnp.inf}[op]
    reduce = {"sum": jnp.sum, "prod": jnp.prod, "max": jnp.max, "min": jnp.min}[op]
    return reduce(jnp.where(upto, s, ident), axis=0)


def ring(offset: int) -> list[tuple[int, int]]:
    n = nax()
    return [(i, (i + offset) % n) for i in range(n)]


class Case(NamedTuple):
    name: str
    ours: Callable[[jax.Array], jax.Array]
    ref: Callable[[jax.Array], jax.Array]
    linear: bool


def _cases() -> list[Case]:
    cases = [
        Case("psum", lambda v: sc.psum(v, AX), lambda v: lax.psum(v, AX), True),
        Case("psum_rs_ag", lambda v: sc.psum(v, AX, algorithm="rs_ag"), lambda v: lax.psum(v, AX), True),
        Case("pmean", lambda v: sc.pmean(v, AX), lambda v: lax.pmean(v, AX), True),
        Case("pmean_rs_ag", lambda v: sc.pmean(v, AX, algorithm="rs_ag"), lambda v: lax.pmean(v, AX), True),
        Case("pmax", lambda v: sc.pmax(v, AX), functools.partial(reduce_ref, "max"), False),
        Case("pmin", lambda v: sc.pmin(v, AX), functools.partial(reduce_ref, "min"), False),
        Case("all_gather", lambda v: sc.all_gather(v, AX), lambda v: stack(v).reshape((-1,) + v.shape[1:]), True),
        Case(
            "all_gather_untiled_dim1",
            lambda v: sc.all_gather(v, AX, dim=1, tiled=False),
            lambda v: jnp.moveaxis(stack(v), 0, 1),
            True,
        ),
        Case(
            "all_to_all",
            lambda v: sc.all_to_all(v, AX, split_dim=0, concat_dim=1),
            lambda v: lax.all_to_all(v, AX, 0, 1, tiled=True),
            True,
        ),
        Case("broadcast", lambda v: sc.broadcast(v, AX, root=nax() - 1), lambda v: bcast_ref(v, nax() - 1), True),
        Case(
            "broadcast_split",
            lambda v: _broadcast_leaf(v, AX, nax() - 1, nax(), split=True),
            lambda v: bcast_ref(v, nax() - 1),
            True,
        ),
        Case(
            "gather",
            lambda v: sc.gather(v, AX, root=nax() // 2),
            lambda v: jnp.where(idx() == nax() // 2, stack(v).reshape((-1,) + v.shape[1:]), 0.0),
            True,
        ),
        Case("scatter", lambda v: sc.scatter(v, AX, root=nax() - 1), lambda v: my_chunk(bcast_ref(v, nax() - 1)), True),
        Case(
            "permute",
            lambda v: sc.permute(v, AX, perm=[(0, nax() - 1)]),
            lambda v: lax.ppermute(v, AX, [(0, nax() - 1)]),
            True,
        ),
        Case("shift", lambda v: sc.shift(v, AX, offset=-1), lambda v: lax.ppermute(v, AX, ring(-1)), True),
    ]
    for op in ("sum", "mean", "max", "min", "prod"):
        linear = op in ("sum", "mean")
        cases.append(
            Case(
                f"all_reduce_{op}",
                lambda v, op=op: sc.all_reduce(v, AX, op=op),
                functools.partial(reduce_ref, op),
                linear,
            )
        )
        cases.append(
            Case(
                f"reduce_scatter_{op}",
                lambda v, op=op: sc.reduce_scatter(v, AX, op=op),
                lambda v, op=op: my_chunk(reduce_ref(op, v)),
                linear,
            )
        )
        cases.append(
            Case(
                f"reduce_{op}",
                lambda v, op=op: sc.reduce(v, AX, root=nax() // 2, op=op),
                lambda v, op=op: jnp.where(idx() == nax() // 2, reduce_ref(op, v), v),
                linear,
            )
        )
    for op in ("sum", "max", "min", "prod"):
        for inclusive in (True, False):
            cases.append(
                Case(
                    f"scan_{op}_{'in' if inclusive else 'ex'}clusive",
                    lambda v, op=op, inc=inclusive: sc.scan(v, AX, op=op, inclusive=inc),
                    functools.partial(scan_ref, op, inclusive),
                    op == "sum",
                )
            )
    return cases


CASES = _cases()


# ---------------------------------------------------------------------------------------------------------
# Running one case


def mapped(f: Callable[..., Any], *, mesh, backend: str, nargs: int = 1, check_vma: bool = True) -> Callable:
    """``f`` on each device's block; arguments and results carry a leading device axis of size n."""
    if backend == "pmap":
        return jax.pmap(f, axis_name=AX, devices=list(mesh.devices.flat))

    def per_device(*blocks):
        return jax.tree.map(lambda y: y[None], f(*[b[0] for b in blocks]))

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(AX),) * nargs, out_specs=P(AX), check_vma=check_vma)


def derivatives(f: Callable, mesh, backend: str, check_vma: bool, linear: bool, x, t, w) -> dict[str, Any]:
    """Everything compared for one implementation (traced inside the caller's jit)."""
    on = functools.partial(mapped, mesh=mesh, backend=backend, check_vma=check_vma)
    m = on(f)
    out, jvp = jax.jvp(m, (x,), (t,))
    res = {"out": out, "jvp": jvp, "vjp": jax.vjp(m, x)[1](w)[0]}
    if linear:
        res["linear_transpose"] = jax.linear_transpose(m, x)(w)[0]
    res["grad_inside_weighted"] = on(lambda xb, wb: jax.grad(lambda v: (f(v) * wb).sum())(xb), nargs=2)(x, w)
    res["grad_inside_sum"] = on(lambda xb: jax.grad(lambda v: f(v).sum())(xb))(x)
    return res


def block_input(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-device blocks of shape (2n, 2): distinct magnitudes in [0.5, 2) with mixed signs, no ties."""
    rng = np.random.default_rng(seed)
    size = n * 2 * n * 2
    mags = 0.5 + 1.5 * rng.permutation(size) / size
    x = (mags * rng.choice([-1.0, 1.0], size)).astype(np.float32).reshape(n, 2 * n, 2)
    t = rng.standard_normal(x.shape).astype(np.float32)
    return x, t


def out_weights(case: Case, mesh, x: np.ndarray, seed: int) -> np.ndarray:
    shape = jax.eval_shape(mapped(case.ours, mesh=mesh, backend="shard_map"), x).shape
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def table_results(backend: str, n: int) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every case for one backend and device count, compiled as ONE function (one XLA compile instead of 38:
    about 6x faster on 2 cores); the reference always runs in raw shard_map, as jax.pmap does."""
    mesh = sc.data_mesh(devices=jax.devices()[:n])
    x, t = block_input(n)
    ws = [out_weights(case, mesh, x, seed) for seed, case in enumerate(CASES)]

    def every_case(x, t, ws):
        return {
            case.name: (
                derivatives(case.ours, mesh, backend, True, case.linear, x, t, w),
                derivatives(case.ref, mesh, "shard_map", backend == "shard_map", case.linear, x, t, w),
            )
            for case, w in zip(CASES, ws)
        }

    # Test-only compile options: the module is large and the optimisations do not change values here.
    compiled = jax.jit(every_case).lower(x, t, ws).compile(compiler_options=FAST_COMPILE)
    return jax.device_get(compiled(x, t, ws))


# XLA:CPU options; other backends compile with their defaults.
FAST_COMPILE = (
    {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    if jax.default_backend() == "cpu"
    else {}
)


def compare(ours: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert ours.keys() == ref.keys()
    for key in ours:
        np.testing.assert_allclose(
            np.asarray(ours[key]), np.asarray(ref[key]), rtol=2e-5, atol=2e-5, err_msg=f"{what}: {key}"
        )


@pytest.mark.parametrize(
    "backend, n",
    [
        pytest.param("shard_map", 1, marks=pytest.mark.slow),
        ("shard_map", 2),
        pytest.param("shard_map", 8, marks=pytest.mark.slow),
        pytest.param("pmap", 4, marks=pytest.mark.slow),
    ],
    ids=lambda p: p if isinstance(p, str) else f"{p}dev",
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_derivatives_match_lax_reference(case, backend, n):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    ours, ref = table_results(backend, n)[case.name]
    compare(ours, ref, f"{case.name} {backend} n={n}")
    assert np.all(np.isfinite(ours["vjp"]))
    if not (case.name.endswith("_exclusive") and n == 1):  # device 0 gets a constant: zero is right
        assert np.any(ours["vjp"] != 0), "derivative is silently zero"


# ---------------------------------------------------------------------------------------------------------
# Composition: vmap outside and inside, jit inside, checkpoint, jacfwd of grad


COMPOSED = [
    "pmax",
    "pmin",
    "broadcast",
    "broadcast_split",
    "all_gather",
    "gather",
    "scatter",
    "reduce_min",
    "all_reduce_prod",
    "scan_max_inclusive",
    "scan_sum_exclusive",
    "reduce_scatter_max",
]


def squares(f: Callable) -> Callable:
    return lambda v: (f(v) ** 2).sum()


def composed(f: Callable, mesh, backend: str, check_vma: bool, x, xb, w) -> dict[str, Any]:
    on = functools.partial(mapped, mesh=mesh, backend=backend, check_vma=check_vma)
    m = on(f)
    return {
        "vmap_outside_vjp": jax.vmap(lambda xx, ww: jax.vjp(m, xx)[1](ww)[0])(jnp.stack([x, -x]), jnp.stack([w, w])),
        "vmap_outside_jvp": jax.vmap(lambda tt: jax.jvp(m, (x,), (tt,))[1])(jnp.stack([x, 2 * x])),
        "vmap_inside": on(lambda b: jax.vmap(f)(b))(xb),
        "vmap_inside_grad": on(lambda b: jax.grad(squares(jax.vmap(f)))(b))(xb),
        "jit_inside_grad": on(lambda b: jax.grad(squares(jax.jit(f)))(b))(x),
        "checkpoint_grad": on(lambda b: jax.grad(squares(jax.checkpoint(f)))(b))(x),
        "jacfwd_of_grad": on(lambda b: jax.jacfwd(jax.grad(squares(f)))(b))(x),
    }


@functools.cache
def composed_results(backend: str, n: int) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    mesh = sc.data_mesh(devices=jax.devices()[:n])
    x, _ = block_input(n)
    xb = np.stack([block_input(n, seed)[0] for seed in range(3)], axis=1)  # per-device blocks (3, 2n, 2)
    cases = [c for c in CASES if c.name in COMPOSED]
    ws = [out_weights(case, mesh, x, seed) for seed, case in enumerate(cases)]

    def every_case(x, xb, ws):
        return {
            case.name: (
                composed(case.ours, mesh, backend, True, x, xb, w),
                composed(case.ref, mesh, "shard_map", backend == "shard_map", x, xb, w),
            )
            for case, w in zip(cases, ws)
        }

    return jax.device_get(jax.jit(every_case).lower(x, xb, ws).compile(compiler_options=FAST_COMPILE)(x, xb, ws))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", COMPOSED)
def test_composes_with_vmap_jit_checkpoint_and_higher_order(name, backend):
    n = min(4, jax.device_count())
    ours, ref = composed_results(backend, n)[name]
    compare(ours, ref, f"{name} {backend} composed")
    if not (name.endswith("_exclusive") and n == 1):  # device 0 gets a constant: zero is right
        assert np.any(ours["jacfwd_of_grad"] != 0)


def test_vmap_with_the_collective_axis():
    """jax.vmap(axis_name=...) as the mapped context: derivatives still follow the lax reference."""
    x = np.random.default_rng(3).permutation(4 * 8).astype(np.float32).reshape(4, 8) / 10 + 0.5
    for case in [c for c in CASES if c.name in ("pmax", "broadcast", "gather", "scatter", "scan_prod_inclusive")]:
        got = jax.jit(jax.grad(lambda v, f=case.ours: (jax.vmap(f, axis_name=AX)(v) ** 2).sum()))(x)
        want = jax.jit(jax.grad(lambda v, f=case.ref: (jax.vmap(f, axis_name=AX)(v) ** 2).sum()))(x)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=case.name)


# ---------------------------------------------------------------------------------------------------------
# pmax/pmin: jnp.max's convention


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
@pytest.mark.parametrize("backend", BACKENDS)
def test_pmax_ties_split_evenly_like_jnp_max(backend):
    mesh = sc.data_mesh(devices=jax.devices()[:4])
    x = np.array([[1.0, 5.0], [3.0, 5.0], [3.0, 2.0], [0.0, 5.0]], np.float32)  # ties: 2 devices, 3 devices
    got = jax.grad(lambda v: mapped(lambda b: sc.pmax(b, AX)[None], mesh=mesh, backend=backend)(v).sum())(x)
    want = jax.grad(lambda v: 4 * jnp.max(v, axis=0).sum())(x)  # 4 devices each output the max
    np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(got[:, 0], [0.0, 2.0, 2.0, 0.0])


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
@pytest.mark.parametrize("backend", BACKENDS)
def test_pmin_jvp_of_integers_has_no_tangent(backend):
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    m = mapped(lambda b: sc.pmin(b, AX), mesh=mesh, backend=backend)
    x = np.array([[3], [1]], np.int32)
    out, tangent = jax.jvp(m, (x,), (np.zeros(x.shape, jax.dtypes.float0),))
    assert np.asarray(out).tolist() == [[1], [1]]
    assert tangent.dtype == jax.dtypes.float0


# ---------------------------------------------------------------------------------------------------------
# 2-byte floats on CPU move as bit patterns with a custom_jvp: grad and jvp still follow the reference


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_float_rooted_collectives_differentiate(dtype):
    mesh = sc.data_mesh(devices=jax.devices()[:4])
    x, t = (a.astype(dtype) for a in block_input(4))
    for case in [c for c in CASES if c.name in ("broadcast", "broadcast_split", "gather", "scatter", "reduce_sum")]:
        m_ours = mapped(case.ours, mesh=mesh, backend="shard_map")
        m_ref = mapped(case.ref, mesh=mesh, backend="shard_map")
        got = jax.jit(lambda v, u, m=m_ours: jax.jvp(m, (v,), (u,)))(x, t)
        want = jax.jit(lambda v, u, m=m_ref: jax.jvp(m, (v,), (u,)))(x, t)
        for g, w in zip(got, want):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2, err_msg=case.name
            )
        grad = jax.jit(jax.grad(lambda v, m=m_ours: (m(v).astype(jnp.float32) ** 2).sum()))(x)
        grad_ref = jax.jit(jax.grad(lambda v, m=m_ref: (m(v).astype(jnp.float32) ** 2).sum()))(x)
        np.testing.assert_allclose(
            np.asarray(grad, np.float32), np.asarray(grad_ref, np.float32), rtol=2e-2, atol=2e-2, err_msg=case.name
        )
