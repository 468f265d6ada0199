"""The spmd wrapper: placement, caching, both backends, meshes."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm import P


def test_decorator_and_call_forms_agree():
    @sc.spmd(in_specs=P("data"), out_specs=P())
    def total(x):
        return sc.psum(x.sum(), "data")

    plain = sc.spmd(lambda x: sc.psum(x.sum(), "data"), in_specs=P("data"), out_specs=P())
    x = np.arange(16.0, dtype=np.float32)
    assert float(total(x)) == float(plain(x)) == 120.0
    assert total.__name__ == "total"


@pytest.mark.parametrize(
    "fn,name",
    [
        (functools.partial(lambda x, c: sc.psum(x * c, "data"), c=2.0), "partial(<lambda>)"),
        (type("Doubler", (), {"__call__": lambda self, x: sc.psum(2.0 * x, "data")})(), "Doubler"),
    ],
)
def test_a_partial_or_callable_object_runs_and_names_itself_in_errors(fn, name):
    f = sc.spmd(fn, in_specs=sc.P("data"), out_specs=sc.P())
    assert np.asarray(f(np.ones(8, np.float32))).tolist() == [16.0]
    with pytest.raises(sc.ShapeError, match=rf"^spmdcomm\.{re.escape(name)}: "):
        f(np.ones(7, np.float32))  # 7 rows do not split over 8 devices


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_same_shaped_calls_do_not_retrace(backend):
    traces = []

    def body(x):
        traces.append(1)
        return sc.pmean(x, "data")

    f = sc.spmd(body, in_specs=P("data"), out_specs=P("data"), backend=backend)
    for i in range(5):
        f(np.full(8, i, np.float32))
    assert len(traces) == 1
    # Rebuilding the wrapper for the same function, mesh and specs reuses the compiled function too.
    sc.spmd(body, in_specs=P("data"), out_specs=P("data"), backend=backend)(np.zeros(8, np.float32))
    assert len(traces) == 1
    f(np.zeros(16, np.float32))  # a new shape traces once more
    assert len(traces) == 2


def test_places_unplaced_and_explicitly_sharded_inputs():
    """Inputs from an Explicit mesh, a single device, or the host are all resharded for the user."""
    mesh = sc.data_mesh()
    explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = sc.spmd(lambda x: x * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    inputs = [
        np.arange(8.0, dtype=np.float32),
        jnp.arange(8.0),
        jax.device_put(np.arange(8.0, dtype=np.float32), jax.sharding.NamedSharding(explicit, P())),
        jax.device_put(np.arange(8.0, dtype=np.float32), jax.sharding.NamedSharding(explicit, P("data"))),
    ]
    for x in inputs:
        out = f(x)
        np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 2)
        assert out.sharding.is_equivalent_to(sc.data_sharding(mesh=mesh), 1)


def test_already_placed_inputs_are_not_copied():
    mesh = sc.data_mesh()
    f = sc.spmd(lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    x = jax.device_put(np.arange(8.0, dtype=np.float32), sc.data_sharding(mesh=mesh))
    (placed,) = f.place((x,))
    assert placed is x


def test_place_puts_all_host_arguments_in_one_call_and_keeps_placed_ones(monkeypatch):
    mesh = sc.data_mesh()
    n = mesh.size
    f = sc.spmd(lambda x, w, y: x, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data"))
    y = jax.device_put(np.arange(n, dtype=np.float32), sc.data_sharding(mesh=mesh))
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **kw: calls.append(len(x)) or real(x, s, **kw))
    x, w, same_y = f.place((np.arange(2 * n, dtype=np.float32), {"a": np.ones(2), "b": np.zeros(3)}, y))
    assert calls == [3] and same_y is y  # one batched device_put for the three host leaves
    assert x.sharding == sc.data_sharding(mesh=mesh) and w["a"].sharding == sc.replicated_sharding(mesh=mesh)
    np.testing.assert_array_equal(np.asarray(x), np.arange(2 * n))


def test_host_input_rule_is_an_option_of_the_function():
    n = jax.device_count()
    f = sc.spmd(lambda x: sc.psum(x.sum(), "data"), in_specs=P("data"), out_specs=P(), host_input="global")
    assert f.host_input == "global" and sc.spmd(lambda x: x, in_specs=P(), out_specs=P()).host_input == "local"
    assert float(f(np.arange(2.0 * n))) == float(np.arange(2.0 * n).sum())  # one process: the same as "local"


def test_in_specs_prefix_per_argument_and_pytree():
    f = sc.spmd(
        lambda a, b: {"s": sc.psum(a["x"], "data") + b, "y": a["y"] * b},
        in_specs=({"x": P("data"), "y": P("data")}, P()),
        out_specs={"s": P(), "y": P("data")},
    )
    out = f({"x": np.ones(8, np.float32), "y": np.arange(8.0, dtype=np.float32)}, np.float32(2.0))
    np.testing.assert_array_equal(out["s"], [10.0])
    np.testing.assert_array_equal(out["y"], np.arange(8.0) * 2)


def test_donation_reuses_the_input_buffer():
    f = sc.spmd(lambda x: x + 1, in_specs=P("data"), out_specs=P("data"), donate_argnums=0)
    x = jax.device_put(np.zeros(8, np.float32), sc.data_sharding())
    f(x)
    assert x.is_deleted()


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_backends_agree_on_a_training_like_function(backend):
    """Replicated weights, sharded data, a pmean'd gradient: the two backends give identical arrays."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    x = rng.standard_normal((16, 3)).astype(np.float32)

    def grad_step(w, x):
        g = jax.grad(lambda w_, x_: jnp.mean((x_ @ w_) ** 2))(w, x)
        return w - 0.1 * sc.pmean(g, "data")

    ref = sc.spmd(grad_step, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)(w, x)
    got = sc.spmd(grad_step, in_specs=(P(), P("data")), out_specs=P(), backend=backend, check_vma=False)(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)
    # and both equal one device on the global batch
    want = w - 0.1 * jax.grad(lambda w_: jnp.mean((x @ w_) ** 2))(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_multi_axis_mesh_spmd_and_make_mesh_inference():
    mesh = sc.make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    f = sc.spmd(lambda x: sc.psum(x, "model"), mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", None))
    x = np.arange(4 * 4, dtype=np.float32).reshape(4, 4)
    np.testing.assert_array_equal(np.asarray(f(x)), x[:, :2] + x[:, 2:])


def test_data_mesh_keeps_given_device_order():
    devs = jax.devices()[::-1][:4]
    assert list(sc.data_mesh(devices=devs).devices.flat) == devs
    assert sc.data_mesh() is sc.data_mesh()  # cached: caches keyed on the mesh hit


def test_topology_queries():
    assert sc.process_index() == 0 and sc.process_count() == 1
    assert sc.device_count() == sc.local_device_count() == 8
    assert sc.replicated_sharding().spec == P()
    assert sc.data_sharding(axis="data").spec == P("data")


def test_replicated_psum_warns_once_and_counting_does_not():
    def f(x, w):
        n = sc.psum(1, "data")  # counting devices: no warning
        return sc.psum(w, "data") / n + x  # w is replicated: warns

    g = sc.spmd(f, in_specs=(P("data"), P()), out_specs=P("data"))
    with pytest.warns(sc.ReplicatedReductionWarning, match=r"already identical on every device of axis 'data'") as rec:
        out = g(np.zeros(8, np.float32), np.float32(3.0))
    assert [type(w.message) for w in rec] == [sc.ReplicatedReductionWarning]  # the psum of w, not the count
    np.testing.assert_array_equal(np.asarray(out), np.full(8, 3.0))  # 8 * 3 / 8


def test_counting_devices_raises_no_warning():
    count = sc.spmd(lambda x: x + sc.psum(1, "data"), in_specs=P("data"), out_specs=P("data"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning, of any class, fails the call
        out = count(np.zeros(8, np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.full(8, float(jax.device_count())))


def test_grad_of_replicated_params_pmean_warns_about_the_trap():
    def f(w, x):
        g = jax.grad(lambda w_: jnp.sum(w_ * x))(w)  # summed over 'data' already under check_vma
        return sc.pmean(g, "data")

    g = sc.spmd(f, in_specs=(P(), P("data")), out_specs=P())
    with pytest.warns(sc.ReplicatedReductionWarning, match="already summed"):
        g(np.float32(1.0), np.ones(8, np.float32))
