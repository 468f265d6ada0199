"""sc.scan (MPI_Scan / MPI_Exscan over devices) against NumPy's cumulative reductions.

Every op and dtype runs on the shard_map backend over 1, 2, 4 and 8 devices and on the pmap backend over 4
(tests/conftest.py's ``BACKEND_MESHES``: since JAX 0.10 jax.pmap is jit(shard_map), the same scan program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm import P

OPS = ["sum", "max", "min", "prod"]


def numpy_scan(op: str, blocks: np.ndarray, inclusive: bool) -> np.ndarray:
    """blocks: (n, ...) with device i's block at i; returns what each device must hold."""
    if op == "sum" and blocks.dtype == np.bool_:
        blocks = blocks.astype(np.int32)
    if blocks.dtype == np.bool_:
        ufunc = {"max": np.logical_or, "min": np.logical_and, "prod": np.logical_and}[op]
    else:
        ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    cum = ufunc.accumulate(blocks, axis=0, dtype=blocks.dtype)
    if inclusive:
        return cum
    ident = np.asarray(sc.collectives.p2p._identity(op, blocks.dtype))
    return np.concatenate([np.broadcast_to(ident, (1,) + blocks.shape[1:]), cum[:-1]], axis=0)


def blocks_of(dtype, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random((n, 2, 3)) > 0.4
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-3, 4, size=(n, 2, 3)).astype(dtype)
    return (rng.uniform(0.5, 1.5, size=(n, 2, 3)) * rng.choice([-1, 1], size=(n, 2, 3))).astype(dtype)


@pytest.mark.parametrize("inclusive", [True, False], ids=["inclusive", "exclusive"])
def test_scan_matches_numpy(inclusive, backend_mesh):
    backend, mesh = backend_mesh
    n = mesh.size
    trees = {
        f"{op}_{np.dtype(dt).name}": (op, blocks_of(dt, n, seed))
        for seed, (op, dt) in enumerate((op, dt) for op in OPS for dt in (np.float32, np.int32, np.bool_))
    }
    f = sc.spmd(
        lambda t: {k: sc.scan(v, "data", op=k.split("_")[0], inclusive=inclusive) for k, v in t.items()},
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        backend=backend,
    )
    out = f({k: b.reshape((n * 2, 3)) for k, (_, b) in trees.items()})
    for key, (op, blocks) in trees.items():
        want = numpy_scan(op, blocks, inclusive)
        got = np.asarray(out[key]).reshape(want.shape)
        assert got.dtype == want.dtype, key
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)  # tree order of float adds


def test_exclusive_identities():
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    x = {
        "f": np.ones((2, 1), np.float32),
        "i": np.ones((2, 1), np.int8),
        "u": np.ones((2, 1), np.uint8),
        "b": np.ones((2, 1), np.bool_),
    }
    got = {
        op: sc.spmd(
            lambda t, op=op: sc.scan(t, "data", op=op, inclusive=False),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )(x)
        for op in OPS
    }
    assert [got[op]["f"][0, 0].item() for op in OPS] == [0.0, -np.inf, np.inf, 1.0]
    assert [got[op]["i"][0, 0].item() for op in OPS] == [0, -128, 127, 1]
    assert [got[op]["u"][0, 0].item() for op in OPS] == [0, 0, 255, 1]
    assert [got[op]["b"][0, 0].item() for op in OPS] == [0, False, True, True]


@pytest.mark.parametrize("axes", [("a", "b"), "b", "a"], ids=["ab", "b", "a"])
@pytest.mark.skipif(jax.device_count() < 8, reason="needs a 4 x 2 mesh")
def test_scan_on_a_2d_mesh(axes):
    mesh = sc.make_mesh({"a": 4, "b": 2})
    blocks = np.arange(1, 9, dtype=np.int32).reshape(4, 2, 1)  # block of device (a, b)
    out = sc.spmd(lambda x: sc.scan(x, axes), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))(
        blocks.reshape(4, 2)
    )
    got = np.asarray(out).reshape(4, 2)
    flat = blocks.reshape(4, 2)
    if axes == ("a", "b"):
        want = np.cumsum(flat.reshape(-1)).reshape(4, 2)
    elif axes == "b":
        want = np.cumsum(flat, axis=1)
    else:
        want = np.cumsum(flat, axis=0)
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
def test_scan_of_a_python_scalar_and_a_pytree():
    mesh = sc.data_mesh(devices=jax.devices()[:4])

    def f(x):
        out = sc.scan({"two": 2, "x": (x,)}, "data", op="prod")
        return {"two": out["two"][None], "x": out["x"]}

    out = sc.spmd(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(np.arange(1.0, 5.0))
    assert np.asarray(out["x"][0]).tolist() == [1.0, 2.0, 6.0, 24.0]
    assert np.asarray(out["two"]).tolist() == [2, 4, 8, 16]


def test_scan_gradient_is_the_reverse_cumulative_sum():
    n = jax.device_count()
    mesh = sc.data_mesh()
    m = jax.shard_map(lambda b: sc.scan(b, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    w = np.arange(1.0, n + 1.0, dtype=np.float32)
    grad = jax.jit(jax.grad(lambda v: (m(v) * w).sum()))(np.ones(n, np.float32))
    np.testing.assert_allclose(grad, np.cumsum(w[::-1])[::-1])
    assert jnp.asarray(grad).dtype == jnp.float32
