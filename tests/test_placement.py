"""The host-input rule (spmdcomm.data.placement): one process, where "local" and "global" must agree; the cross-process
agreement on shapes, driven by a stand-in channel; and a real 2 x 2 run through the launcher (a slow-tier test)."""

import json
import re

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.data import placement
from spmdcomm.errors import ProcessMismatchError, ShapeError, SpmdError

P = sc.P


def rows(n, cols=3, offset=0.0):
    return np.arange(n * cols, dtype=np.float32).reshape(n, cols) + offset


# ---- one process: both rules are the same -----------------------------------------------------------------


def same_global_array(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
    for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
        assert sa.device == sb.device and sa.index == sb.index
        np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))


def test_local_and_global_agree_for_shard_batch_spmd_and_prefetch():
    n = jax.device_count()
    batch = sc.pad_batch({"x": rows(2 * n - 1), "y": np.arange(2 * n - 1)}, n)
    local, glob = (sc.shard_batch(batch, host_input=h) for h in ("local", "global"))
    for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(glob), strict=True):
        same_global_array(a, b)
    np.testing.assert_array_equal(np.asarray(local.data["x"]), batch.data["x"])

    fn = lambda x, w: x @ w  # noqa: E731
    w = np.ones((3, 2), np.float32)
    outs = [
        sc.spmd(fn, in_specs=(P("data"), P()), out_specs=P("data"), host_input=h)(rows(2 * n), w)
        for h in ("local", "global")
    ]
    same_global_array(*outs)
    np.testing.assert_array_equal(np.asarray(outs[0]), rows(2 * n) @ w)

    got = []
    for h in ("local", "global"):
        with sc.prefetch_to_device(iter([{"x": rows(n, offset=k)} for k in range(3)]), host_input=h) as it:
            got.append(list(it))
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1]), strict=True):
        same_global_array(a, b)


def test_loader_places_under_either_rule_as_prefetch_does():
    n = jax.device_count()
    data = {"x": rows(3 * n)}
    got = {}
    for h in ("local", "global"):
        sampler = sc.ShardedSampler(3 * n, shard_index=0, num_shards=1, shuffle=False)
        got[h] = list(sc.Loader(data, sampler, batch_size=n, host_input=h))
    for a, b in zip(jax.tree.leaves(got["local"]), jax.tree.leaves(got["global"]), strict=True):
        same_global_array(a, b)
    assert [np.asarray(b.data["x"]).tolist() for b in got["global"]] == [
        data["x"][i * n : (i + 1) * n].tolist() for i in range(3)
    ]
    assert got["global"][0].data["x"].sharding == sc.data_sharding()


def test_loader_refuses_global_host_input_it_would_not_place():
    sampler = sc.ShardedSampler(8, shard_index=0, num_shards=1)
    with pytest.raises(
        SpmdError, match=r"^spmdcomm\.Loader: host_input='global' with prefetch=0: .* Fix: pass prefetch=2"
    ):
        sc.Loader({"x": np.zeros(8)}, sampler, batch_size=8, prefetch=0, host_input="global")
    assert sc.Loader({"x": np.zeros(8)}, sampler, batch_size=8, prefetch=0).host_input == "local"


def test_place_puts_every_host_leaf_in_one_batched_call(monkeypatch):
    n = jax.device_count()
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **kw: calls.append(len(x)) or real(x, s, **kw))
    tree = {"a": rows(n), "b": np.arange(n), "c": np.float32(2.0)}
    shardings = {"a": sc.data_sharding(), "b": sc.data_sharding(), "c": sc.replicated_sharding()}
    placed = placement.place("test", tree, shardings)
    assert calls == [3]
    assert placed["c"].sharding == sc.replicated_sharding() and placed["a"].sharding == sc.data_sharding()
    for key in tree:
        np.testing.assert_array_equal(np.asarray(placed[key]), tree[key])


def test_jax_arrays_are_moved_only_if_their_sharding_differs(monkeypatch):
    n = jax.device_count()
    there = jax.device_put(rows(n), sc.data_sharding())
    elsewhere = jax.device_put(rows(n, offset=1.0), sc.replicated_sharding())
    placed = placement.place("test", [there, elsewhere], sc.data_sharding(), host_input="global")
    assert placed[0] is there  # never re-interpreted, not even copied
    assert placed[1].sharding == sc.data_sharding()
    np.testing.assert_array_equal(np.asarray(placed[1]), rows(n, offset=1.0))


def test_place_batch_returns_data_and_mask_and_checks_them():
    mesh = sc.data_mesh(devices=jax.devices()[:4]) if jax.device_count() >= 4 else None
    if mesh is None:
        pytest.skip("needs 4 devices")
    batch = sc.pad_batch({"x": rows(7)}, 8)
    data, mask = placement.place_batch("test", batch, mesh=mesh, axis="data", multiple_of=2)
    assert mask.sharding == sc.data_sharding(mesh=mesh) and mask.dtype == bool
    np.testing.assert_array_equal(np.asarray(mask), batch.mask)
    np.testing.assert_array_equal(np.asarray(data["x"]), batch.data["x"])
    data, mask = placement.place_batch("test", {"x": rows(4)}, mesh=mesh, axis="data")
    assert mask is None and data["x"].shape == (4, 3)
    with pytest.raises(ShapeError, match=r"12 examples, .* over 4 devices on axis 'data' x accum_steps=2 "):
        placement.place_batch(
            "test", {"x": rows(12)}, mesh=mesh, axis="data", multiple_of=2, multiple_name="accum_steps"
        )
    with pytest.raises(ShapeError, match=r"multiple of 8\)\. Fix: pad it with spmdcomm\.pad_batch\(batch, 8\)"):
        placement.place_batch("test", {"x": rows(12)}, mesh=mesh, axis="data", multiple_of=2)
    with pytest.raises(ShapeError, match=r"leaf mask: the mask has shape \(3,\) but the batch has 4 rows"):
        placement.place_batch("test", sc.MaskedBatch({"x": rows(4)}, np.ones(3, bool)), mesh=mesh, axis="data")


def test_place_batch_on_a_2d_mesh_needs_one_block_per_data_position():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = sc.make_mesh({"data": 4, "model": 2})
    data, _ = placement.place_batch("test", {"x": rows(4)}, mesh=mesh, axis="data")  # 4 blocks, not 8 devices
    for shard in data["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), rows(4)[shard.index])


def test_split_dimension_errors_name_leaf_size_devices_and_fix():
    n = jax.device_count()
    if n < 2:
        pytest.skip("every size divides over one device")
    with pytest.raises(ShapeError) as err:
        placement.place("test", {"x": rows(n + 1)}, sc.data_sharding())
    msg = str(err.value)
    assert msg.startswith(f"spmdcomm.test: leaf ['x']: dimension 0 of size {n + 1} (shape ({n + 1}, 3))")
    assert f"mesh axis 'data' of size {n}" in msg and f"devices {list(range(n))}" in msg
    assert f"spmdcomm.pad_batch(batch, {n})" in msg and f"multiple_of={n}" in msg
    sharding = jax.sharding.NamedSharding(sc.default_mesh(), P(None, "data"))
    with pytest.raises(ShapeError, match=rf"dimension 1 of size 3 .* Fix: pad dimension 1 to a multiple of {n}, or"):
        placement.place("test", rows(n), sharding)
    with pytest.raises(ShapeError, match=r"leaf <root>: spec P\(None, 'data'\) has 2 entries .* shape \(4,\)"):
        placement.place("test", np.zeros(4), sharding)


def test_bad_host_input_is_refused_everywhere():
    for call in (
        lambda: sc.spmd(lambda x: x, in_specs=P(), out_specs=P(), host_input="mine"),
        lambda: sc.shard_batch({"x": np.zeros(8)}, host_input="mine"),
        lambda: sc.prefetch_to_device([], host_input="mine"),
        lambda: sc.Loader(
            {"x": np.zeros(8)}, sc.ShardedSampler(8, shard_index=0, num_shards=1), batch_size=8, host_input="mine"
        ),
        lambda: placement.place("test", np.zeros(8), sc.data_sharding(), host_input="mine"),
    ):
        with pytest.raises(SpmdError, match=r"host_input='mine' is not one of \('local', 'global'\)"):
            call()


def test_shard_batch_options_are_keyword_only():
    with pytest.raises(TypeError):
        sc.shard_batch({"x": np.zeros(8)}, sc.default_mesh())


# ---- the agreement between processes, with a stand-in channel -----------------------------------------------


class Peers:
    """A channel whose other process answers with ``edit(its own report)``; counts the exchanges."""

    def __init__(self, edit=lambda report: report):
        self.edit, self.calls = edit, []

    def exchange(self, fn, label, payload, *, timeout):
        self.calls.append(label)
        mine = json.loads(payload)
        return [payload, json.dumps(self.edit(json.loads(json.dumps(mine)))).encode()]


def agree(peers, hosts, host_input="local"):
    shardings = [sc.data_sharding()] * len(hosts)
    names = lambda: [f"['{k}']" for k in "xyz"[: len(hosts)]]  # noqa: E731
    return placement.Agreement(peers).global_shapes("test", hosts, shardings, names, host_input, 5.0)


def test_agreed_signatures_are_checked_once():
    peers = Peers()
    agreement = placement.Agreement(peers)
    hosts = [rows(8), np.arange(8)]
    shardings = [sc.data_sharding()] * 2
    names = lambda: ["['x']", "['y']"]  # noqa: E731
    for _ in range(3):
        assert agreement.global_shapes("test", hosts, shardings, names, "local", 5.0) == [(8, 3), (8,)]
    assert peers.calls == ["test: host input check"]
    agreement.global_shapes("test", [rows(16), np.arange(16)], shardings, names, "local", 5.0)
    assert len(peers.calls) == 2  # a new shape signature is checked again


def test_different_local_shapes_name_the_leaf_and_every_process():
    def bigger(report):
        report["leaves"][0][1][0] *= 2
        return report

    with pytest.raises(ProcessMismatchError) as err:
        agree(Peers(bigger), [rows(8)])
    msg = str(err.value)
    assert "leaf ['x']: processes passed different shapes or dtypes: process 0 (8, 3) float32, " in msg
    assert "process 1 (16, 3) float32; with host_input='local' each process passes its own rows" in msg
    assert "spmdcomm.pad_batch" in msg


def test_different_trees_and_dtypes_are_named():
    def renamed(report):
        report["leaves"][0][0] = "['w']"
        return report

    with pytest.raises(ProcessMismatchError, match=r"different leaves at position 0 \(process 0: \['x'\]; process 1"):
        agree(Peers(renamed), [rows(8)])

    def wider(report):
        report["leaves"][0][2] = "float64"
        return report

    with pytest.raises(ProcessMismatchError, match=r"process 0 \(8, 3\) float32, process 1 \(8, 3\) float64"):
        agree(Peers(wider), [rows(8)], host_input="global")


def test_a_peer_that_cannot_place_stops_this_process_too():
    def failing(report):
        return {"error": "spmdcomm.test: leaf ['x']: dimension 0 of size 3 ...", "leaves": []}

    with pytest.raises(ShapeError, match=r"process 1 cannot place its host input, so process 0 stops too\. "):
        agree(Peers(failing), [rows(8)])


def test_an_indivisible_leaf_is_reported_to_the_peers_before_raising():
    n = jax.device_count()
    if n < 2:
        pytest.skip("every size divides over one device")
    sent = []
    peers = Peers(lambda report: sent.append(report) or {"error": None, "leaves": []})
    with pytest.raises(ShapeError, match=rf"dimension 0 of size {n + 1} .* holds {n} of them"):
        agree(peers, [rows(n + 1)])
    assert sent[0]["error"].startswith("spmdcomm.test: leaf ['x']: dimension 0")


# ---- two processes with two devices each ------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_host_input_rules_across_two_processes(launch):
    out = launch("mp_placement.py").stdout
    ok = re.findall(r"^\[rank (\d)\] CHECKS OK (\d+)$", out, re.M)
    assert sorted(r for r, _ in ok) == ["0", "1"] and len({c for _, c in ok}) == 1, out
