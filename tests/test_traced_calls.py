"""Host-side synchronisation called inside traced code raises instead of silently vanishing from the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm import P


def _main_process_first(x):
    with sc.main_process_first():
        return x


_HOST_CALLS = {
    "barrier": lambda x: (sc.barrier("b"), x)[1],
    "sync_devices": lambda x: (sc.sync_devices(), x)[1],
    "main_process_first": _main_process_first,
    "host_all_reduce": lambda x: sc.host_all_reduce(x, op="sum"),
    "host_all_gather": lambda x: sc.host_all_gather(x)[0],
    "host_broadcast": lambda x: sc.host_broadcast(x),
    "broadcast_object": lambda x: (sc.broadcast_object({"a": 1}), x)[1],
    "all_gather_object": lambda x: (sc.all_gather_object("ok"), x)[1],
    "check_replicas_in_sync": lambda x: (sc.check_replicas_in_sync({"x": x}), x)[1],
}

_TRACES = {
    "jit": lambda f, x: jax.jit(f)(x),
    "spmd": lambda f, x: sc.spmd(f, in_specs=P("data"), out_specs=P("data"))(x),
    "scan": lambda f, x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0],
    "checkpoint": lambda f, x: jax.checkpoint(f)(x),
    "eval_shape": lambda f, x: jax.eval_shape(f, x),
}


@pytest.mark.parametrize("trace", sorted(_TRACES))
@pytest.mark.parametrize("name", sorted(_HOST_CALLS))
def test_host_calls_inside_a_staged_trace_raise(name, trace):
    x = np.arange(8.0, dtype=np.float32)
    with pytest.raises(
        sc.TracedCallError,
        match=rf"spmdcomm\.{name}: was called inside a traced function"
        r".*absent from the compiled program.*Fix: call it outside the traced function",
    ):
        _TRACES[trace](_HOST_CALLS[name], x)


@pytest.mark.parametrize("name", ["barrier", "sync_devices", "main_process_first", "broadcast_object"])
def test_eager_transformations_may_call_host_synchronisation(name):
    # Under jax.grad and jax.vmap Python runs eagerly, once per call: the sync really happens.
    f = _HOST_CALLS[name]
    assert float(jax.grad(lambda x: jnp.sum(f(x) ** 2))(jnp.float32(3.0))) == 6.0
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(jnp.arange(3.0))), [0.0, 1.0, 2.0])


@pytest.mark.parametrize("name", sorted(_HOST_CALLS))
def test_host_calls_outside_traces_return_their_single_process_result(name):
    x = np.arange(8.0, dtype=np.float32)
    got = _HOST_CALLS[name](x)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32, type(got)
    np.testing.assert_array_equal(got, x)


@pytest.mark.parametrize("sync", [sc.barrier, sc.sync_devices], ids=["barrier", "sync_devices"])
def test_barrier_and_sync_devices_wait_for_queued_device_work(sync):
    x = jnp.ones((512, 512), jnp.float32)
    queued = [x := jnp.tanh(x @ x) for _ in range(4)]
    sync()
    assert all(y.is_ready() for y in queued)
