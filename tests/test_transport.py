"""The agreement transport (spmdcomm.runtime.transport) and the cache idiom (spmdcomm._cache), in one process:
the single-process fast paths, and the messages of a disagreement, with the other processes' answers faked at
the channel (the real multi-process runs are in test_multiprocess.py)."""

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm._cache import Cache
from spmdcomm.runtime import host_collectives, transport


class Peers:
    """A channel of ``n`` processes: this one is process 0, process ``p`` passes ``signatures[p]``."""

    def __init__(self, signatures):
        self.signatures = signatures
        self.labels = []

    def exchange(self, fn, label, payload, *, timeout):
        self.labels.append(label)
        return [transport._pack(sig, f"payload {p}".encode()) for p, sig in enumerate(self.signatures)]


@pytest.fixture
def three_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 3)


def check(signatures, what="trees", **kw):
    peers = Peers(signatures)
    got = transport.check_same_across_processes("f", what, signatures[0], fix="build them alike.", channel=peers, **kw)
    return got, peers.labels


def test_single_process_fast_paths():
    assert transport.check_same_across_processes("f", "trees", "anything", fix="-", timeout=0.001) == [b""]
    assert transport.check_same_across_processes("f", "t", {"a": "1"}, fix="-", payload=b"x") == [b"x"]
    tree = {"w": jax.numpy.arange(3.0), "n": 2}
    assert host_collectives.broadcast_tree("TrainState.create", tree, timeout=0.001) is tree  # nothing to copy
    with pytest.raises(sc.SpmdError, match=r"spmdcomm.TrainState.create: root=1 is out of range for a job of 1"):
        host_collectives.broadcast_tree("TrainState.create", tree, root=1)


def test_agreement_returns_every_payload_under_its_label(three_processes):
    same = {"['w']": "shape (3,) dtype float32"}
    assert check([same] * 3) == ([b"payload 0", b"payload 1", b"payload 2"], ["check trees"])
    assert check([same] * 3, label="host_all_reduce")[1] == ["host_all_reduce"]


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        ({"['a']": "(3,)", "['b']": "(2, 5)"}, "process 2: ['b'] is (2, 5) (process 0: (2, 2))."),
        ({"['a']": "(3,)"}, "process 2: ['b'] missing."),
        ({"['a']": "(3,)", "['b']": "(2, 2)", "['c']": "()"}, "process 2: ['c'] only on process 2."),
        ({"['b']": "(2, 2)", "['a']": "(3,)"}, "process 2: the same leaves in another order."),
        (
            {f"[{i}]": "x" for i in range(5)},
            "process 2: ['a'] missing, ['b'] missing, [0] only on process 2 (and 4 more leaves).",
        ),
    ],
)
def test_a_differing_tree_names_the_call_the_process_and_the_leaves(three_processes, other, expected):
    ref = {"['a']": "(3,)", "['b']": "(2, 2)"}
    with pytest.raises(sc.ProcessMismatchError) as e:
        check([ref, ref, other], what="parameter trees")
    msg = str(e.value)
    assert msg.startswith("spmdcomm.f: process(es) [2] passed parameter trees that differ from process 0's (seen on ")
    assert msg.endswith(f"{expected} Fix: build them alike.")


def test_a_differing_text_is_quoted_around_its_first_difference(three_processes):
    ref, other = "x" * 500 + "A" + "y" * 500, "x" * 500 + "B" + "y" * 500
    with pytest.raises(sc.ProcessMismatchError) as e:
        check([ref, other, ref])
    quoted = "process 1 has ...'" + "x" * 60 + "B" + "y" * 99 + "'..., process 0 has ...'" + "x" * 60 + "A"
    assert "process(es) [1] passed trees" in str(e.value) and quoted in str(e.value)


def test_only_a_few_processes_are_named(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 5)
    with pytest.raises(sc.ProcessMismatchError, match=r"process\(es\) \[1, 2, 3, 4\] .*\(1 more not shown\)\."):
        check(["a", "b", "b", "b", "b"])


def test_host_tree_signature_names_shapes_dtypes_and_structure():
    flat, treedef = jax.tree_util.tree_flatten_with_path({"v": np.zeros(2), "n": np.int32(1)})
    assert host_collectives._signature(flat, treedef) == {
        "['n']": "shape () dtype int32",
        "['v']": "shape (2,) dtype float64",
        "structure": str(treedef),
    }


def test_broadcast_bytes_round_trips_every_dtype_bit_for_bit():
    # The device path of broadcast_tree on this process's one device: bytes packed into int32 words, summed
    # with nothing and unpacked. Values a float sum would change (-0.0, denormals, NaN payloads) survive.
    bf16 = jax.numpy.bfloat16
    leaves = [
        np.array([-0.0, 1e-310, np.nan, -np.inf], np.float64),
        np.frombuffer(np.array([0x7FC1, 0x8000, 0x0001], np.uint16).tobytes(), bf16),
        np.array([True, False, True]),
        np.arange(7, dtype=np.int8).reshape(7, 1),
        np.array(3 + 4j, np.complex64),
        np.zeros((0, 3), np.float32),
        np.array([2**63 - 1], np.int64),
    ]
    got = host_collectives._broadcast_bytes(leaves, 0)
    for g, want in zip(got, leaves, strict=True):
        assert g.dtype == want.dtype and g.shape == want.shape
        assert g.tobytes() == want.tobytes()
    assert host_collectives._broadcast_bytes([np.zeros(0)], 0)[0].shape == (0,)


@pytest.mark.parametrize(
    ("call", "expected"),
    [(lambda: 7, (7, None)), (lambda: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("gone\nmore")), None)],
)
def test_attempt_turns_a_refused_call_into_its_reason(call, expected):
    got = transport.attempt(call)
    assert got == (expected or (None, "failed: gone"))


def test_milliseconds_and_key_process():
    assert [transport.milliseconds(s) for s in (0, 0.0004, 1.5)] == [1, 1, 1500]
    assert transport.key_process("spmdcomm/x/12/3") == 3


def test_cache_is_bounded_and_builds_once():
    cache, built = Cache(limit=2), []

    def make(v):
        built.append(v)
        return v * 10

    assert [cache.get_or_make(k, lambda k=k: make(k)) for k in (1, 1, 2, 3, 3)] == [10, 10, 20, 30, 30]
    assert built == [1, 2, 3] and list(cache) == [2, 3]  # the oldest went
    cache.put(2, 0)
    assert cache == {2: 0, 3: 30}
    assert cache.get_or_make([1], lambda: "unhashable") == "unhashable" and len(cache) == 2


def test_platform_is_one_answer():
    assert sc.runtime.mesh.platform() == jax.default_backend()
    assert sc.runtime.mesh.platform(sc.data_sharding()) == jax.devices()[0].platform
