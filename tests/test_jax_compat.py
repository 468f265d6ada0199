"""The JAX compatibility layer: the supported range, each accessor on the installed JAX, each clear error.

Every fallback test removes one JAX internal with monkeypatch and checks that the accessor (and, for the
hot path, the collective that calls it) raises spmdcomm's error naming the installed JAX version and the
supported range instead of an AttributeError.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import spmdcomm as sc
from spmdcomm import P
from spmdcomm import _jax_compat as compat
from spmdcomm.runtime.transport import coordination_client

ROOT = pathlib.Path(__file__).resolve().parent.parent
RANGE = "spmdcomm supports jax>=0.10,<0.12"


def _explicit_mesh(n: int = 2):
    return jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:n])


def _shard_map(fn, n: int = 2, **kwargs):
    """Runs ``fn(sharded, replicated)`` under a raw jax.shard_map over ``n`` devices."""
    mesh = _explicit_mesh(n)
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
    x, y = put(np.arange(2.0 * n, dtype=np.float32), P("i")), put(np.ones(3, np.float32), P())
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"), **kwargs))(x, y)


def _missing(version_of: str) -> str:
    return f"jax {jax.__version__} has no {version_of}"


# ---------------------------------------------------------------------------------------------------------
# The supported range


def test_installed_jax_is_in_the_supported_range():
    assert compat.SUPPORTED_JAX == "jax>=0.10,<0.12"
    assert compat.jax_version()[:2] == tuple(int(p) for p in jax.__version__.split(".")[:2])
    assert compat.jax_version_supported(), (jax.__version__, compat.SUPPORTED_JAX)


@pytest.mark.parametrize(
    "version, ok", [((0, 9, 2), False), ((0, 10, 0), True), ((0, 11, 2), True), ((0, 12, 0), False), ((1, 0), False)]
)
def test_range_bounds(version, ok):
    assert compat.jax_version_supported(version) is ok


def test_pyproject_bounds_match_the_compat_constants():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lo, hi = (".".join(map(str, v)) for v in (compat.JAX_MIN_VERSION, compat.JAX_MAX_VERSION))
    for name in ("jax", "jaxlib"):
        spec = [d for d in deps if re.match(rf"{name}\s*[<>=!~]", d)]
        assert spec == [f"{name}>={lo},<{hi}"], (name, deps)


def test_no_jax_internals_outside_the_compat_module():
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted((ROOT / "spmdcomm").rglob("*.py"))
        if path.name != "_jax_compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"jax\._src|from jax import _src|\.mat\.varying", line)
    ]
    assert offenders == []


# ---------------------------------------------------------------------------------------------------------
# Each accessor on the installed JAX


@pytest.mark.parametrize("check_vma", [True, False])
def test_check_vma_enabled_follows_the_shard_map_flag(check_vma):
    seen = []
    _shard_map(lambda x, y: (seen.append(compat.check_vma_enabled()), x)[1], check_vma=check_vma)
    assert seen == [check_vma]


def test_check_vma_enabled_is_false_outside_shard_map_and_under_pmap():
    assert compat.check_vma_enabled() is False
    seen = []
    jax.pmap(lambda v: (seen.append(compat.check_vma_enabled()), v)[1], axis_name="i")(np.zeros((2, 1)))
    assert seen == [False]


def test_varying_axes_of_sharded_and_replicated_values():
    seen = {}

    def fn(x, y):
        seen["sharded"], seen["replicated"] = compat.varying_axes(x), compat.varying_axes(y)
        seen["cast"] = compat.varying_axes(lax.pcast(y, "i", to="varying"))
        seen["reduced"] = compat.varying_axes(lax.psum(x, "i"))
        return x

    _shard_map(fn)
    assert seen["sharded"] == frozenset({"i"}) and seen["cast"] == frozenset({"i"})
    assert "i" not in seen["replicated"] and "i" not in seen["reduced"]
    assert isinstance(seen["replicated"], frozenset)
    assert compat.varying_axes(jnp.ones(3)) == frozenset()
    assert compat.varying_axes(1.0) == frozenset()


def test_collective_axes_in_traceback_names_the_axes_a_lax_collective_asked_for():
    # A raw lax.psum over an axis the shard_map does not bind fails inside JAX without naming the call's axes. Read
    # inside the trace, as the step does: JAX drops its own frames from a traceback that leaves jax.jit.
    seen = []

    def body(x, y):
        try:
            lax.psum(y, ("i", "batch"))
        except (AssertionError, NameError) as e:
            seen.append(compat.collective_axes_in_traceback(e.__traceback__))
        return x

    _shard_map(body)
    assert seen == [["i", "batch"]]


def test_collective_axes_in_traceback_is_empty_without_jax_collective_frames():
    with pytest.raises(NameError) as info:
        raise NameError("unbound axis name: batch")
    assert compat.collective_axes_in_traceback(info.value.__traceback__) == []
    assert compat.collective_axes_in_traceback(None) == []


def test_backends_initialized_after_devices():
    jax.devices()
    assert compat.backends_initialized() is True


def test_coordination_client_is_none_outside_a_job():
    assert (compat.coordination_client() is None) == (not jax.distributed.is_initialized())
    if not jax.distributed.is_initialized():
        with pytest.raises(sc.DistributedError, match="has not joined a multi-process job"):
            coordination_client("barrier")


def test_auto_detect_cluster_keeps_given_settings():
    got = compat.auto_detect_cluster("127.0.0.1:1234", 2, 1, [0], timeout=1)
    assert tuple(got) == ("127.0.0.1:1234", 2, 1, [0])


# ---------------------------------------------------------------------------------------------------------
# Each fallback: a clear error when the installed JAX lacks the internal


@pytest.fixture
def jax_internal():
    """Imports a ``jax._src`` module by its dotted name below ``jax._src``."""
    return lambda name: importlib.import_module(f"jax._src.{name}")


def test_check_vma_missing_raises_clear_error(monkeypatch, jax_internal):
    # Only the accessor is checked: JAX's own shard_map reads the same flag, so a JAX without it fails
    # inside shard_map before any spmdcomm collective runs.
    monkeypatch.setattr(compat, "_check_vma_flag", None)  # drop the cached flag so the lookup runs again
    monkeypatch.delattr(jax_internal("config"), "_check_vma")
    with pytest.raises(sc.SpmdError) as info:
        compat.check_vma_enabled()
    assert RANGE in str(info.value) and _missing("jax._src.config._check_vma") in str(info.value)
    assert "pip install 'jax>=0.10,<0.12' 'jaxlib>=0.10,<0.12'" in str(info.value)


def test_varying_axes_missing_raises_clear_error(monkeypatch):
    class ArrayTypeWithoutVaryingAxes(jax.core.ShapedArray):
        mat = None  # no manual-axis record, and no `vma` either

    aval = object.__new__(ArrayTypeWithoutVaryingAxes)
    monkeypatch.setattr(jax, "typeof", lambda x: aval)
    with pytest.raises(sc.SpmdError) as info:
        compat.varying_axes(np.ones(2))
    assert RANGE in str(info.value) and _missing("jax.typeof(x).mat.varying") in str(info.value)


def test_varying_axes_falls_back_to_vma_attribute(monkeypatch):
    class ArrayTypeWithVma(jax.core.ShapedArray):
        mat = None
        vma = ("i",)

    monkeypatch.setattr(jax, "typeof", lambda x: object.__new__(ArrayTypeWithVma))
    assert compat.varying_axes(np.ones(2)) == frozenset({"i"})


def test_linear_call_composes_with_vmap_and_second_derivatives():
    """``sin`` with a custom JVP whose tangent ``cos(x) t`` is a ``linear_call`` (transpose ``cos(x) ct``): forward,
    reverse, ``vmap`` of both, and second derivatives in the residual ``x`` (JAX 0.10 lacks the vmap rule and
    asserts on a tangent of a residual)."""

    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)

    @sin.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return sin(x), compat.linear_call(lambda r, t: jnp.cos(r) * t, lambda r, ct: jnp.cos(r) * ct, x, t)

    x = jnp.linspace(-1.0, 2.0, 4)
    grad = jax.grad(lambda x: sin(x).sum())
    cases = {
        "jvp": (jax.jvp(sin, (x,), (x,))[1], jnp.cos(x) * x),
        "grad": (grad(x), jnp.cos(x)),
        "vmap grad": (jax.vmap(grad)(jnp.stack([x, 2 * x])), jnp.cos(jnp.stack([x, 2 * x]))),
        "vmap jvp": (jax.vmap(lambda t: jax.jvp(sin, (x,), (t,))[1])(jnp.stack([x, x])), jnp.cos(x) * x),
        "grad of grad": (jax.grad(lambda x: grad(x).sum())(x), -jnp.sin(x)),
        "jacfwd of grad": (jax.jacfwd(grad)(x), jnp.diag(-jnp.sin(x))),
    }
    for name, (got, want) in cases.items():
        np.testing.assert_allclose(got, np.broadcast_to(want, np.shape(got)), rtol=1e-6, atol=1e-7, err_msg=name)


def test_linear_call_rules_missing_raise_clear_error(monkeypatch, jax_internal):
    monkeypatch.setattr(compat, "_LINEAR_CALL_RULES", [])  # the rules are added on first use: look them up again
    monkeypatch.delattr(jax_internal("custom_derivatives"), "linear_call_p")
    with pytest.raises(sc.SpmdError) as info:
        compat.linear_call(lambda r, x: x, lambda r, t: t, (), jnp.ones(2))
    assert RANGE in str(info.value) and _missing("jax._src.custom_derivatives.linear_call_p") in str(info.value)


def test_coordination_client_missing_raises_clear_error(monkeypatch, jax_internal):
    monkeypatch.setattr(jax_internal("distributed"), "global_state", object())
    with pytest.raises(sc.DistributedError) as info:
        compat.coordination_client()
    assert RANGE in str(info.value) and _missing("jax._src.distributed.global_state.client") in str(info.value)
    with pytest.raises(sc.DistributedError, match=re.escape(RANGE)):
        coordination_client("barrier")  # what every barrier and key-value exchange starts with


def test_backends_initialized_missing_raises_clear_error(monkeypatch, jax_internal):
    monkeypatch.delattr(jax_internal("xla_bridge"), "backends_are_initialized")
    with pytest.raises(sc.DistributedError) as info:
        compat.backends_initialized()
    assert RANGE in str(info.value)
    assert _missing("jax._src.xla_bridge.backends_are_initialized") in str(info.value)


def test_auto_detect_missing_raises_clear_error(monkeypatch, jax_internal):
    monkeypatch.delattr(jax_internal("clusters").ClusterEnv, "auto_detect_unset_distributed_params")
    with pytest.raises(sc.DistributedError) as info:
        compat.auto_detect_cluster(None, None, None, None, timeout=1)
    text = str(info.value)
    assert RANGE in text and _missing("jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params") in text
    assert "pass coordinator_address, num_processes and process_id to spmdcomm.initialize()" in text


def test_auto_detect_changed_signature_raises_clear_error(monkeypatch, jax_internal):
    def renamed(cls, address, count, pid, device_ids, method, timeout):  # the old arguments, new names
        raise AssertionError("must not be called")

    monkeypatch.setattr(
        jax_internal("clusters").ClusterEnv, "auto_detect_unset_distributed_params", classmethod(renamed)
    )
    with pytest.raises(sc.DistributedError, match=re.escape(RANGE)):
        compat.auto_detect_cluster(None, None, None, None, timeout=1)
