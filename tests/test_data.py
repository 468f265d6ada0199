"""Batches on the mesh: padding with masks, shard_batch placement and errors, the sampler, join_batches."""

import itertools
import re
import warnings

import jax
import numpy as np
import pytest

import spmdcomm as sc
from spmdcomm.errors import AxisError, ShapeError, SpmdError


def batch_of(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32), "y": rng.integers(0, 10, size=n)}


# ---- padding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("multiple", [1, 2, 3, 4, 7, 8])
def test_masked_mean_of_padded_batch_equals_unpadded_mean(multiple):
    for n in range(1, 30):
        b = batch_of(n, seed=n)
        padded = sc.pad_batch(b, multiple)
        assert len(padded.mask) % multiple == 0 and padded.mask.sum() == n
        w = padded.mask.astype(np.float64)
        got = (padded.data["x"] * w[:, None]).sum(0) / w.sum()
        np.testing.assert_allclose(got, b["x"].astype(np.float64).mean(0), rtol=1e-12)
        np.testing.assert_array_equal(sc.unpad(padded)["y"], b["y"])


@pytest.mark.parametrize(
    "pad", [lambda b: sc.pad_batch(b, 4), lambda b: sc.pad_batch(b, multiple_of=4)], ids=["positional", "keyword"]
)
def test_pad_batch_takes_multiple_of_positionally_or_by_keyword_without_a_warning(pad):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        padded = pad(batch_of(5))
    assert padded.mask.tolist() == [True] * 5 + [False] * 3
    np.testing.assert_array_equal(padded.data["x"][:5], batch_of(5)["x"])
    assert not padded.data["x"][5:].any()


def test_pad_batch_old_keyword_still_works_with_a_deprecation_warning_naming_the_new_one():
    with pytest.warns(DeprecationWarning) as record:
        old = sc.pad_batch(batch_of(5), multiple=4)
    (warning,) = record
    assert str(warning.message) == (
        "spmdcomm.pad_batch: multiple= is deprecated and will be removed in the next release; pass multiple_of=4."
    )
    assert warning.filename == __file__  # points at the caller's line
    new = sc.pad_batch(batch_of(5), multiple_of=4)
    np.testing.assert_array_equal(old.mask, new.mask)
    np.testing.assert_array_equal(old.data["x"], new.data["x"])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"multiple_of": 4, "multiple": 4},
            "both multiple_of= and its old spelling multiple= were given. Fix: pass only multiple_of=",
        ),
        ({}, "no multiple_of given. Fix: pass the number of devices"),
        ({"multiple_of": 0}, "multiple_of=0 must be a positive int"),
        ({"multiple_of": True}, "multiple_of=True must be a positive int"),
        ({"multiple": 2.0}, "multiple_of=2.0 must be a positive int"),
    ],
)
def test_pad_batch_refuses_a_missing_bad_or_doubled_multiple(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(SpmdError, match=rf"^spmdcomm\.pad_batch: {re.escape(message)}"):
            sc.pad_batch(batch_of(5), **kwargs)


def test_masked_mean_on_device_over_sharded_padded_batch():
    step = sc.spmd(
        lambda x, m: sc.psum((x * m[:, None]).sum(0), "data") / sc.psum(m.sum(), "data"),
        in_specs=sc.P("data"),
        out_specs=sc.P(),
    )
    for n in (1, 5, 9, 15, 23):
        b = batch_of(n, seed=n)
        placed = sc.shard_batch(sc.pad_batch(b, 8))
        got = step(placed.data["x"], placed.mask.astype(np.float32))
        np.testing.assert_allclose(np.asarray(got), b["x"].astype(np.float64).mean(0), rtol=1e-5, atol=1e-6)


# ---- shard_batch ----------------------------------------------------------------------------------------


def test_shard_batch_places_each_block_on_its_device(mesh):
    n = mesh.shape["data"]
    b = batch_of(4 * n)
    placed = sc.shard_batch(b, mesh=mesh)
    for name, host in b.items():
        arr = placed[name]
        assert arr.shape == host.shape and arr.sharding == sc.data_sharding(mesh=mesh)
        index_map = arr.sharding.devices_indices_map(arr.shape)
        for i, device in enumerate(mesh.devices.flat):
            assert index_map[device][0].indices(4 * n)[:2] == (4 * i, 4 * (i + 1))
        by_device = {s.device: s for s in arr.addressable_shards}
        assert set(by_device) == set(mesh.devices.flat)
        for i, device in enumerate(mesh.devices.flat):
            np.testing.assert_array_equal(np.asarray(by_device[device].data), host[4 * i : 4 * (i + 1)])


def test_shard_batch_keeps_structure_and_shards_the_mask():
    b = sc.pad_batch((batch_of(13)["x"], np.arange(13)), 8)
    placed = sc.shard_batch(b)
    assert isinstance(placed, sc.MaskedBatch) and isinstance(placed.data, tuple)
    assert placed.mask.sharding == sc.data_sharding() and placed.mask.dtype == bool
    np.testing.assert_array_equal(np.asarray(placed.mask), b.mask)
    np.testing.assert_array_equal(np.asarray(placed.data[1]), b.data[1])


def test_shard_batch_on_2d_mesh_replicates_over_the_other_axis():
    mesh = sc.make_mesh({"data": 4, "model": 2})
    x = np.arange(32.0).reshape(8, 4)
    placed = sc.shard_batch({"x": x}, mesh=mesh)["x"]
    for shard in placed.addressable_shards:
        (i,) = [int(c) for c in np.argwhere(mesh.devices == shard.device)[0][:1]]
        np.testing.assert_array_equal(np.asarray(shard.data), x[2 * i : 2 * (i + 1)])


def test_shard_batch_errors_name_the_problem_and_the_fix():
    with pytest.raises(ShapeError, match=r"13 examples, .* over 8 devices on axis 'data'.*pad_batch\(batch, 8\)"):
        sc.shard_batch({"x": np.zeros((13, 2))})
    with pytest.raises(ShapeError, match=r"different leading sizes.*\['x'\]\": 8.*\['y'\]\": 16"):
        sc.shard_batch({"x": np.zeros(8), "y": np.zeros(16)})
    with pytest.raises(SpmdError, match=r"leaf \['name'\]: is a str, not an array"):
        sc.shard_batch({"x": np.zeros(8), "name": "batch-1"})
    with pytest.raises(ShapeError, match=r"leaf \['s'\]: is a scalar"):
        sc.shard_batch({"s": np.float32(1.0)})
    with pytest.raises(AxisError, match="axis 'batch' is not an axis of the mesh"):
        sc.shard_batch({"x": np.zeros(8)}, axis="batch")


# ---- ShardedSampler -------------------------------------------------------------------------------------


def epoch_batches(num_examples, num_shards, batch_size, *, epoch=0, **kw):
    return [
        list(
            sc.ShardedSampler(num_examples, shard_index=i, num_shards=num_shards, **kw).batches(batch_size, epoch=epoch)
        )
        for i in range(num_shards)
    ]


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_uses_every_example_exactly_once_per_epoch(shuffle):
    for n, shards, bs in itertools.product([0, 1, 2, 3, 5, 7, 10, 13, 31, 97, 100], [1, 2, 3, 4, 7], [1, 2, 3, 5, 8]):
        per_shard = epoch_batches(n, shards, bs, shuffle=shuffle, seed=3)
        counts = {len(b) for b in per_shard}
        assert len(counts) == 1, (n, shards, bs)
        assert counts.pop() == -(-n // (shards * bs))
        used = []
        for batches in per_shard:
            for b in batches:
                assert b.data.shape == (bs,) and b.mask.shape == (bs,) and b.mask.dtype == bool
                assert (b.data[~b.mask] == 0).all()
                used.extend(b.data[b.mask].tolist())
        assert sorted(used) == list(range(n)), (n, shards, bs)


def global_batches(num_examples, num_shards, global_batch, **kw):
    """Each step's global batch: the shards' index batches side by side, as (indices, mask) lists."""
    per_shard = epoch_batches(num_examples, num_shards, global_batch // num_shards, **kw)
    return [
        (np.concatenate([b.data for b in step]).tolist(), np.concatenate([b.mask for b in step]).tolist())
        for step in zip(*per_shard, strict=True)
    ]


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("num_examples", "global_batch"), [(0, 4), (3, 4), (8, 8), (21, 8), (44, 8), (97, 12)])
def test_sampler_global_batches_are_the_same_for_every_number_of_shards(
    num_examples, global_batch, shuffle, drop_remainder
):
    kw = {"shuffle": shuffle, "drop_remainder": drop_remainder, "seed": 6, "epoch": 2}
    one = global_batches(num_examples, 1, global_batch, **kw)
    for num_shards in (2, 4):
        assert global_batches(num_examples, num_shards, global_batch, **kw) == one, num_shards
    # The reference, from the epoch's order alone: full global batches, then the real rest and padding at the end.
    order = sc.ShardedSampler(num_examples, shard_index=0, num_shards=1, shuffle=shuffle, seed=6).order(2).tolist()
    steps = num_examples // global_batch if drop_remainder else -(-num_examples // global_batch)
    want = []
    for k in range(steps):
        real = order[k * global_batch : (k + 1) * global_batch]
        pad = global_batch - len(real)
        want.append((real + [0] * pad, [True] * len(real) + [False] * pad))
    assert one == want


def test_sampler_last_global_batch_has_its_padding_at_the_end():
    per_shard = epoch_batches(21, 4, 2, shuffle=False)  # 2 full global batches of 8, then 5 examples left
    assert [b.mask.tolist() for b in per_shard[0]] == [[True, True]] * 3  # shard 0 ends with real rows 16, 17
    assert [(bs[-1].data.tolist(), bs[-1].mask.tolist()) for bs in per_shard] == [
        ([16, 17], [True, True]),
        ([18, 19], [True, True]),
        ([20, 0], [True, False]),
        ([0, 0], [False, False]),  # a shard whose last batch is all padding still steps with the others
    ]
    assert [b.data.tolist() for b in per_shard[1]] == [[2, 3], [10, 11], [18, 19]]


def test_sampler_drop_remainder_uses_only_full_batches_without_repeats():
    for n, shards, bs in itertools.product([0, 7, 13, 64, 97], [1, 2, 3], [1, 4, 5]):
        per_shard = epoch_batches(n, shards, bs, drop_remainder=True)
        used = [i for batches in per_shard for b in batches for i in b.data.tolist()]
        assert all(b.mask.all() for batches in per_shard for b in batches)
        assert len(used) == len(set(used)) == (n // (shards * bs)) * shards * bs
        assert {len(b) for b in per_shard} == {n // (shards * bs)}


def test_sampler_reshuffles_each_epoch_without_set_epoch():
    s = sc.ShardedSampler(50, shard_index=0, num_shards=2, seed=1)
    first, second = [np.concatenate([b.data for b in s.batches(5)]) for _ in range(2)]
    assert s.epoch == 2 and not np.array_equal(first, second)
    again = sc.ShardedSampler(50, shard_index=0, num_shards=2, seed=1)
    np.testing.assert_array_equal(np.concatenate([b.data for b in again.batches(5, epoch=1)]), second)
    assert again.epoch == 0  # an explicit epoch leaves the counter alone
    other_seed = sc.ShardedSampler(50, shard_index=0, num_shards=2, seed=2)
    assert not np.array_equal(np.concatenate([b.data for b in other_seed.batches(5)]), first)
    ordered = sc.ShardedSampler(10, shard_index=0, num_shards=1, shuffle=False)
    assert np.concatenate([b.data for b in ordered.batches(5)]).tolist() == list(range(10))


def test_sampler_order_is_the_same_for_every_shard_with_the_same_seed():
    orders = [sc.ShardedSampler(40, shard_index=i, num_shards=4, seed=9).order(3) for i in range(4)]
    for order in orders[1:]:
        np.testing.assert_array_equal(order, orders[0])


def test_sampler_rejects_bad_arguments():
    with pytest.raises(SpmdError, match=r"shard_index=2 is not in \[0, num_shards=2\)"):
        sc.ShardedSampler(10, shard_index=2, num_shards=2)
    with pytest.raises(SpmdError, match="num_shards=0 must be an int >= 1"):
        sc.ShardedSampler(10, shard_index=0, num_shards=0)
    with pytest.raises(SpmdError, match="batch_size=0 must be a positive int"):
        sc.ShardedSampler(10, shard_index=0, num_shards=1).batches(0)


def test_take_batches_gathers_rows_and_zeroes_padding():
    data = batch_of(11)
    sampler = sc.ShardedSampler(11, shard_index=1, num_shards=2, seed=4)
    index_batches = list(sampler.batches(4, epoch=0))
    for idx, got in zip(index_batches, sc.take_batches(data, index_batches), strict=True):
        np.testing.assert_array_equal(got.mask, idx.mask)
        for name in data:
            np.testing.assert_array_equal(got.data[name][got.mask], data[name][idx.data[idx.mask]])
            assert (got.data[name][~got.mask] == 0).all()
    plain = list(sc.take_batches(data, [np.array([3, 1])]))
    np.testing.assert_array_equal(plain[0].data["x"], data["x"][[3, 1]])
    assert plain[0].mask.tolist() == [True, True]


# ---- join_batches (single process; the multi-process case is in test_data_multiprocess.py) -------------


def test_join_batches_single_process_adds_masks_and_ends():
    batches = [batch_of(4, seed=i) for i in range(3)] + [sc.pad_batch(batch_of(3), 4)]
    out = list(sc.join_batches(iter(batches)))
    assert len(out) == 4 and all(isinstance(b, sc.MaskedBatch) for b in out)
    assert [int(b.mask.sum()) for b in out] == [4, 4, 4, 3]
    np.testing.assert_array_equal(out[1].data["x"], batches[1]["x"])
    assert list(sc.join_batches([])) == []


def test_leading_size_reports_jax_arrays_too():
    assert sc.data.batches.leading_size("f", {"a": jax.numpy.zeros((3, 2)), "b": np.zeros(3)}) == 3
