"""Single-process behaviour of the runtime, sync and debug modules (the multi-process runs are in
test_multiprocess.py): fast paths, argument checks and error messages."""

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.runtime import debug, transport
from spmdcomm.runtime import process as runtime

ENV = (
    "SPMDCOMM_COORDINATOR",
    "SPMDCOMM_NUM_PROCESSES",
    "SPMDCOMM_PROCESS_ID",
    "SPMDCOMM_LOCAL_RANK",
    "SLURM_JOB_ID",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
    "JAX_COORDINATOR_ADDRESS",
)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_initialize_single_process_is_a_no_op(clean_env):
    sc.initialize()
    sc.initialize(num_processes=1)
    clean_env.setenv("SPMDCOMM_NUM_PROCESSES", "1")
    sc.initialize()
    assert not sc.is_initialized()
    assert sc.process_count() == 1


def test_initialize_errors(clean_env):
    clean_env.setenv("SPMDCOMM_NUM_PROCESSES", "two")
    with pytest.raises(sc.DistributedError, match="SPMDCOMM_NUM_PROCESSES='two' is not an integer"):
        sc.initialize()
    clean_env.setenv("SPMDCOMM_NUM_PROCESSES", "2")
    with pytest.raises(sc.DistributedError, match="needs a coordinator address and this"):
        sc.initialize()
    with pytest.raises(sc.DistributedError, match="is not HOST:PORT"):
        sc.initialize("localhost", process_id=1)
    # This test process already runs JAX's backend, so it can no longer join a job.
    with pytest.raises(sc.DistributedError, match="before any other JAX call"):
        sc.initialize("127.0.0.1:1", process_id=1)


def test_topology_single_process(clean_env):
    assert sc.is_main_process() and sc.is_main_process(local=True)
    assert sc.local_rank() == 0
    assert sc.process_devices() == jax.local_devices()
    assert sc.process_devices(0) == sorted(jax.devices(), key=lambda d: d.id)
    with pytest.raises(sc.SpmdError, match=r"process=1 is out of range for a job of 1 process"):
        sc.process_devices(1)
    clean_env.setenv("SPMDCOMM_LOCAL_RANK", "3")
    assert sc.local_rank() == 3
    with pytest.raises(sc.DistributedError, match="has not joined a multi-process job"):
        runtime.coordination_client("barrier")


def test_barriers_and_main_process_first_single_process():
    x = jax.numpy.arange(4.0) * 2
    sc.barrier()
    sc.barrier("named", timeout=1)
    sc.sync_devices(timeout=1)
    assert x.is_ready()
    ran = []
    with sc.main_process_first(local=True):
        ran.append(1)
    assert ran == [1]
    with pytest.raises(KeyError), sc.main_process_first():
        raise KeyError("propagates unchanged")


@pytest.mark.parametrize("op", sc.collectives.REDUCE_OPS)
def test_host_all_reduce_single_process(op):
    tree = {"a": np.array([1, -2, 3], np.int32), "b": [np.float32(2.5)], "c": 4}
    got = sc.host_all_reduce(tree, op=op)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    ref = getattr(np, op)
    for g, leaf in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True):
        want = ref(np.asarray(leaf)[None], axis=0)
        assert isinstance(g, np.ndarray)
        np.testing.assert_array_equal(g, want)
        assert g.dtype == (want.dtype if op == "mean" else np.asarray(leaf).dtype)


def test_host_gather_broadcast_objects_single_process():
    got = sc.host_all_gather({"v": np.arange(3), "s": 1.5})
    np.testing.assert_array_equal(got["v"], np.arange(3)[None])
    np.testing.assert_array_equal(got["s"], [1.5])
    out = sc.host_broadcast({"w": jax.numpy.ones(2)})
    assert isinstance(out["w"], np.ndarray) and out["w"].tolist() == [1.0, 1.0]
    obj = {"config": [1, 2]}
    assert sc.broadcast_object(obj) is obj
    assert sc.all_gather_object(obj) == [obj]


def test_host_collective_argument_errors():
    with pytest.raises(sc.SpmdError, match=r"host_all_reduce: unknown op 'avg'"):
        sc.host_all_reduce(1.0, op="avg")
    with pytest.raises(sc.SpmdError, match=r"root=1 is out of range for a job of 1 process"):
        sc.broadcast_object("x", root=1)
    with pytest.raises(sc.SpmdError, match=r"host_broadcast: root=True is a bool, not a process index"):
        sc.host_broadcast(1.0, root=True)
    # op and root are keyword-only: a positional one is an error, not a silent default.
    with pytest.raises(TypeError, match="positional"):
        sc.host_all_reduce(1.0, "max")
    with pytest.raises(TypeError, match="positional"):
        sc.broadcast_object("x", 0)


def test_debug_switch(monkeypatch):
    monkeypatch.delenv("SPMDCOMM_DEBUG", raising=False)
    assert not sc.runtime.debug_enabled()
    monkeypatch.setenv("SPMDCOMM_DEBUG", "1")
    assert sc.runtime.debug_enabled()
    sc.set_debug(False)
    try:
        assert not sc.runtime.debug_enabled()
        sc.set_debug(True)
        f = sc.spmd(lambda b: sc.psum(b, "data"), in_specs=sc.P("data"), out_specs=sc.P())
        assert f(np.arange(8.0)).tolist() == [28.0]  # one process: the check is skipped
    finally:
        sc.set_debug(None)
    monkeypatch.setenv("SPMDCOMM_DEBUG", "0")
    assert not sc.runtime.debug_enabled()


class _TwoProcesses:
    """The main channel of a two-process job seen from process 0: the first call fixes process 0's payload,
    later calls pair it with this process's payload as process 1's."""

    def __init__(self):
        self.sent = []

    def exchange(self, fn, label, payload, *, timeout):
        self.sent.append((label, payload))
        return [self.sent[0][1], payload]


_PLACED = "P('data',) over mesh {'data': 2}"  # the sharding of x on process 0


@pytest.mark.parametrize(
    ("name", "tree", "in_specs", "expected"),
    [
        (
            "step",
            {"x": np.zeros((4, 2), np.float16), "y": np.zeros(3, np.int32)},
            sc.P("data"),
            "args[0]['x'] is shape (4, 2), dtype float16, sharding None "
            f"(process 0: shape (4, 2), dtype float32, sharding {_PLACED})",
        ),
        (
            "step",
            {"x": np.zeros((6, 2), np.float32), "y": np.zeros(3, np.int32)},
            sc.P("data"),
            "args[0]['x'] is shape (6, 2), dtype float32, sharding None "
            f"(process 0: shape (4, 2), dtype float32, sharding {_PLACED})",
        ),
        (
            "step",
            {"x": "placed", "y": np.zeros(5, np.int32)},
            sc.P("data"),
            "args[0]['y'] is shape (5,), dtype int32, sharding None "
            "(process 0: shape (3,), dtype int32, sharding None)",
        ),
        ("step", {"x": "placed"}, sc.P("data"), "args[0]['y'] missing"),
        ("step", {"x": "placed", "y": np.zeros(3, np.int32), "z": 1}, sc.P("data"), "args[0]['z'] only on process 1"),
        ("step", {"x": "placed", "y": np.zeros(3, np.int32)}, sc.P(), "in_specs is P() (process 0: P('data',))"),
        ("eval", {"x": "placed", "y": np.zeros(3, np.int32)}, sc.P("data"), "function is eval (process 0: step)"),
    ],
)
def test_debug_check_names_the_differing_leaf_with_both_processes_values(monkeypatch, name, tree, in_specs, expected):
    mesh = sc.data_mesh(devices=jax.devices()[:2])
    placed = jax.device_put(np.zeros((4, 2), np.float32), sc.data_sharding(mesh=mesh))
    ref = {"x": placed, "y": np.zeros(3, np.int32)}
    assert debug.fingerprint("step", (ref,))["leaves"]["[0]['x']"] == ((4, 2), "float32", _PLACED)
    channel = _TwoProcesses()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(transport, "_MAIN", channel)
    debug.check_call("step", (ref,), in_specs=sc.P("data"), mesh=mesh)  # process 0's call; the same on both
    mine = {k: placed if isinstance(v, str) else v for k, v in tree.items()}
    with pytest.raises(sc.ProcessMismatchError) as e:
        debug.check_call(name, (mine,), in_specs=in_specs, mesh=mesh)
    assert str(e.value) == (
        f"spmdcomm.{name}: process(es) [1] passed inputs to the spmd debug check that differ from process 0's "
        f"(seen on process 0): process 1: {expected}. Fix: give every process inputs of the same global shape, "
        "dtype and sharding (pad the last batch, e.g. with spmdcomm.pad_batch), and call the same functions in the "
        "same order."
    )
    assert [label for label, _ in channel.sent] == ["spmd debug check"] * 2
