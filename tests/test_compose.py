"""spmd functions compose like the raw shard_map / pmap program: jit, grad, value_and_grad, vmap, checkpoint.

Each case runs the same per-device body through ``sc.spmd`` and through the raw JAX wrapper it stands for
(``jax.jit`` of ``jax.shard_map`` on the same mesh, or ``jax.pmap`` over the leading device axis), under the same
transformation, and compares values and the collectives in the compiled HLO.

Every transformation runs on the shard_map backend over 1, 2, 4 and 8 devices and on the pmap backend over 4
(tests/conftest.py's ``BACKEND_MESHES``: since JAX 0.10 jax.pmap is jit(shard_map), so one device count covers the
pmap backend's own plumbing). The raw shard_map is jitted as users run it: applied eagerly, JAX compiles each of its
primitives on its own, which made this file ten times slower and changes no value.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm import P
from spmdcomm.errors import DeletedArrayError


def _body(w, x):
    # A replicated weight, a split batch: a data-parallel loss with one collective.
    return sc.pmean(jnp.sum(jnp.tanh(x * w) ** 2), "data")


def _raw_body(w, x):
    return jax.lax.pmean(jnp.sum(jnp.tanh(x * w) ** 2), "data")


def _pair(mesh, backend):
    ours = sc.spmd(_body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), backend=backend)
    if backend == "shard_map":
        raw = jax.jit(jax.shard_map(_raw_body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    else:
        n = mesh.size
        pm = jax.pmap(_raw_body, axis_name="data", in_axes=(None, 0), out_axes=None, devices=list(mesh.devices.flat))

        def raw(w, x):
            return pm(w, x.reshape((n, x.shape[0] // n) + x.shape[1:]))

    return ours, raw


_TRANSFORMS = {
    "jit": lambda f: jax.jit(lambda w, x: 3.0 * f(w, x)),
    "grad": lambda f: jax.grad(f, argnums=(0, 1)),
    "jit_grad": lambda f: jax.jit(jax.grad(f)),
    "value_and_grad": lambda f: jax.value_and_grad(f),
    "checkpoint_grad": lambda f: jax.grad(jax.checkpoint(f)),
    "vmap": lambda f: jax.vmap(f, in_axes=(0, None)),
    "vmap_grad": lambda f: jax.vmap(jax.grad(f), in_axes=(0, None)),
    "jacfwd_grad": lambda f: jax.jacfwd(jax.grad(f)),
}


@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
def test_spmd_function_composes_like_the_raw_program(backend_mesh, transform):
    backend, mesh = backend_mesh
    ours, raw = _pair(mesh, backend)
    x = np.linspace(-1.0, 1.0, 2 * mesh.size, dtype=np.float32)
    w = np.float32(0.7) if not transform.startswith("vmap") else np.linspace(0.1, 0.9, 3, dtype=np.float32)
    got = _TRANSFORMS[transform](ours)(w, x)
    want = _TRANSFORMS[transform](raw)(w, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7), got, want)


def _collectives(hlo: str) -> list[str]:
    return sorted(
        re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo)
    )


@pytest.mark.parametrize("transform", ["jit", "grad", "value_and_grad"])
def test_compiled_collectives_match_the_raw_shard_map(transform):
    mesh = sc.data_mesh()
    ours, raw = _pair(mesh, "shard_map")
    x = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    w = np.float32(0.7)

    def hlo(f):
        return jax.jit(_TRANSFORMS[transform](f)).lower(w, x).compile().as_text()

    ours_ops, raw_ops = _collectives(hlo(ours)), _collectives(hlo(raw))
    assert ours_ops == raw_ops
    assert ours_ops  # the program does communicate


@pytest.mark.skipif(jax.device_count() < 2, reason="every size divides over one device")
def test_traced_call_keeps_input_checks():
    n = jax.device_count()
    f = sc.spmd(lambda x: x, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(sc.ShapeError, match=rf"dimension 0 of size {n + 1} .* mesh axis 'data' of size {n}"):
        jax.jit(f)(np.zeros(n + 1, np.float32))


def test_traced_call_mixes_host_and_traced_arguments():
    n = jax.device_count()
    f = sc.spmd(lambda w, x: sc.psum(w * x, "data"), in_specs=(P(), P("data")), out_specs=P())
    out = jax.jit(lambda x: f(np.float32(2.0), x))(np.arange(float(n), dtype=np.float32))
    np.testing.assert_allclose(np.asarray(out), [n * (n - 1.0)])


def test_spmd_inside_user_jit_training_loop():
    """The README pattern: a per-device loss wrapped by spmd, differentiated and updated inside the user's jit."""
    mesh = sc.data_mesh()
    loss = sc.spmd(
        lambda w, x, y: sc.pmean(jnp.mean((x @ w - y) ** 2), "data"),
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
    )

    @jax.jit
    def update(w, x, y):
        value, g = jax.value_and_grad(loss)(w, x, y)
        return w - 0.1 * g, value

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    w = np.zeros(3, np.float32)
    w_ref = w.copy()
    for _ in range(3):
        w, _ = update(w, x, y)
        w_ref = w_ref - 0.1 * (2.0 / len(x)) * x.T @ (x @ w_ref - y)
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5)


def test_reusing_a_donated_argument_raises_instead_of_crashing():
    f = sc.spmd(lambda x: x + 1, in_specs=P("data"), out_specs=P("data"), donate_argnums=0)
    x = jax.device_put(np.zeros(8, np.float32), sc.data_sharding())
    y = f(x)
    np.testing.assert_array_equal(np.asarray(f(y)), np.full(8, 2.0))
    with pytest.raises(DeletedArrayError, match=r"args\[0\].*donate_argnums"):
        f(x)
