"""Worker for tests/test_data_multiprocess.py: the input pipeline across processes, checked against NumPy.

Run it under the launcher: ``spmdcomm-launch -n 2 --devices-per-process 2 mp_data.py``.
Each process prints ``CHECKS OK <count>`` and ``STEPS <n>`` for the join run; a failed check raises.
"""

import spmdcomm as sc

sc.initialize(timeout=60)

import numpy as np  # noqa: E402
from checks import check, checks  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

pid, nproc = sc.process_index(), sc.process_count()
mesh = sc.data_mesh()
local = sc.local_device_count()


def check_placement(name, arr, global_host):
    assert arr.shape == global_host.shape, (name, arr.shape)
    assert arr.sharding == sc.data_sharding(mesh=mesh), name
    for shard in arr.addressable_shards:
        assert shard.device.process_index == pid
        check(f"{name} shard on {shard.device}", shard.data, global_host[shard.index])
    check(f"{name} gathered", multihost_utils.process_allgather(arr, tiled=True), global_host)


rows = 3 * local  # per process
global_x = np.arange(nproc * rows * 2, dtype=np.float32).reshape(nproc * rows, 2)
mine = global_x[pid * rows : (pid + 1) * rows]

# shard_batch: every process passes its own slice.
placed = sc.shard_batch({"x": mine})
check_placement("shard_batch", placed["x"], global_x)
masked = sc.shard_batch(sc.pad_batch({"x": mine[: rows - 1]}, local))
check_placement("shard_batch mask", masked.mask, np.tile(np.r_[np.ones(rows - 1, bool), False], nproc))

# prefetch_to_device: same layout, several batches, padding; placed in-line and by the threads.
for threads in ("never", "always"):
    with sc.prefetch_to_device(({"x": mine + 1000 * k} for k in range(3)), threads=threads) as it:
        for k, b in enumerate(it):
            check_placement(f"prefetch batch {k}, threaded={it.threaded}", b["x"], global_x + 1000 * k)
with sc.prefetch_to_device(iter([{"x": mine[: rows - 1]}]), multiple_of=local) as it:
    (b,) = list(it)
    real = sum(int(np.asarray(s.data).sum()) for s in b.mask.addressable_shards)
    check("prefetch padded mask count", sc.host_all_reduce(np.int64(real)), nproc * (rows - 1))

# ShardedSampler: same order everywhere; every example exactly once across processes.
sampler = sc.ShardedSampler(37, shard_index=pid, num_shards=nproc, seed=5)
for epoch in range(2):
    batches = list(sampler.batches(4))
    orders = sc.host_all_gather(sampler.order(epoch))
    check(f"sampler epoch {epoch} same order", orders, np.tile(orders[0], (nproc, 1)))
    counts = sc.host_all_gather(np.int64(len(batches)))
    check(f"sampler epoch {epoch} same batch count", counts, np.full(nproc, counts[0]))
    used = np.concatenate([b.data[b.mask] for b in batches])
    padded_used = np.full(37, -1)
    padded_used[: len(used)] = used
    everything = sc.host_all_gather(padded_used)
    check(f"sampler epoch {epoch} exactly once", np.sort(everything[everything >= 0]), np.arange(37))

# join_batches: process p has 2 + 3p batches; every process must run the same number of device steps.
count = sc.spmd(lambda m: sc.psum(m.sum(), "data"), in_specs=sc.P("data"), out_specs=sc.P())
n_batches = [2 + 3 * p for p in range(nproc)]
source = ({"x": np.ones((local * 2, 2), np.float32) * (k + 1)} for k in range(n_batches[pid]))
steps, seen = 0, 0
with sc.prefetch_to_device(sc.join_batches(source, timeout=60)) as it:
    for b in it:
        seen += int(count(b.mask.astype(np.int32)))
        steps += 1
check("join steps", steps, max(n_batches))
check("join examples", seen, sum(n_batches) * local * 2)
print("STEPS", steps)

# A process with no batches at all still joins, given an example batch.
empty = iter([] if pid == 0 else [{"x": np.ones((local, 2), np.float32)}])
out = list(sc.join_batches(empty, like={"x": np.zeros((local, 2), np.float32)}, timeout=60))
check("join with like", len(out), 1)
check("join with like mask", out[0].mask.all(), pid != 0)

sc.barrier("done")
print("CHECKS OK", len(checks))
