"""Worker for tests/test_placement.py: the host-input rule across processes, checked against NumPy.

Run it under the launcher: ``spmdcomm-launch -n 2 --devices-per-process 2 mp_placement.py``. Each process
prints ``CHECKS OK <count>``; a failed check raises. Every process runs every call, so the sync points of
the shape checks stay paired even where a call raises.
"""

import spmdcomm as sc

sc.initialize(timeout=60)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from checks import check, checks  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

pid, nproc = sc.process_index(), sc.process_count()
mesh = sc.data_mesh()
local = sc.local_device_count()


def check_global(name, arr, want):
    """``arr`` is the global array ``want``: its shape, each of this process's shards, and all of it."""
    assert arr.shape == want.shape, (name, arr.shape, want.shape)
    for shard in arr.addressable_shards:
        check(f"{name} shard on {shard.device}", shard.data, want[shard.index])
    check(f"{name} gathered", multihost_utils.process_allgather(arr, tiled=True), want)


def raises(name, cls, *fragments):
    """A context that expects ``cls`` with every fragment in its message."""

    class Expect:
        def __enter__(self):
            self.info = pytest.raises(cls)
            self.info.__enter__()

        def __exit__(self, *exc):
            self.info.__exit__(*exc)
            message = str(self.info.excinfo.value)
            for fragment in fragments:
                assert fragment in message, (name, fragment, message)
            checks.append(name)
            return True

    return Expect()


rows = 3 * local  # per process
global_x = np.arange(nproc * rows * 2, dtype=np.float32).reshape(nproc * rows, 2)
mine = global_x[pid * rows : (pid + 1) * rows]
weights = np.array([2.0, -1.0], np.float32)  # replicated: the same under both rules

# shard_batch: "local" takes this process's rows, "global" the whole batch; both give global_x.
check_global("shard_batch local", sc.shard_batch({"x": mine})["x"], global_x)
check_global("shard_batch global", sc.shard_batch({"x": global_x}, host_input="global")["x"], global_x)
masked = sc.shard_batch(sc.pad_batch({"x": mine[: rows - 1]}, local))
check_global("shard_batch local mask", masked.mask, np.tile(np.r_[np.ones(rows - 1, bool), False], nproc))

# spmd: the same two rules; a replicated argument is the same under both.
double = sc.spmd(lambda x, w: x * w, in_specs=(sc.P("data"), sc.P()), out_specs=sc.P("data"))
check_global("spmd local", double(mine, weights), global_x * weights)
double_global = sc.spmd(
    lambda x, w: x * w, in_specs=(sc.P("data"), sc.P()), out_specs=sc.P("data"), host_input="global"
)
check_global("spmd global", double_global(global_x, weights), global_x * weights)
total = sc.spmd(lambda x: sc.psum(x.sum(0), "data"), in_specs=sc.P("data"), out_specs=sc.P())
check("spmd local sum", total(mine), global_x.sum(0))
check("spmd local sum, second call (cached signature)", total(mine + 1), global_x.sum(0) + nproc * rows)

# prefetch_to_device: both rules, placed in-line and by the threads.
for threads in ("never", "always"):
    with sc.prefetch_to_device(({"x": mine + 1000 * k} for k in range(3)), threads=threads) as it:
        for k, b in enumerate(it):
            check_global(f"prefetch local batch {k}, threaded={it.threaded}", b["x"], global_x + 1000 * k)
    with sc.prefetch_to_device(
        ({"x": global_x + 1000 * k} for k in range(3)), host_input="global", threads=threads
    ) as it:
        for k, b in enumerate(it):
            check_global(f"prefetch global batch {k}, threaded={it.threaded}", b["x"], global_x + 1000 * k)

# Loader: "local" with this process's shard of the sampler, "global" with one shard of the whole global batch on
# every process; both give global_x (and an all-True mask).
for host_input, shard_index, num_shards, batch_size in (("local", pid, nproc, rows), ("global", 0, 1, nproc * rows)):
    sampler = sc.ShardedSampler(nproc * rows, shard_index=shard_index, num_shards=num_shards, shuffle=False)
    (batch,) = sc.Loader({"x": global_x}, sampler, batch_size=batch_size, host_input=host_input)
    check_global(f"Loader {host_input}", batch.data["x"], global_x)
    check_global(f"Loader {host_input} mask", batch.mask, np.ones(nproc * rows, bool))

# Processes passing different local shapes for the same leaf: every process raises, naming both.
uneven = np.ones(((2 + 2 * pid) * local, 2), np.float32)  # process 0: 2 rows per device, process 1: 4
shapes = [f"process {p} ({(2 + 2 * p) * local}, 2) float32" for p in range(nproc)]
with raises("shard_batch mismatch", sc.ProcessMismatchError, "leaf ['x']", *shapes):
    sc.shard_batch({"x": uneven})
with raises("spmd mismatch", sc.ProcessMismatchError, "leaf args[0]", *shapes):
    total(uneven)
with raises("global mismatch", sc.ProcessMismatchError, "leaf ['x']", "host_input='global'"):
    sc.shard_batch({"x": uneven}, host_input="global")
# (A signature a process has already agreed on is not checked again: both sides must be new to be compared.)
with raises("dtype mismatch", sc.ProcessMismatchError, "leaf ['x']", "float32", "float64"):
    sc.shard_batch({"x": np.ones((5 * local, 2), np.float32 if pid == 0 else np.float64)})
for threads in ("never", "always"):
    with raises(f"prefetch mismatch, threads={threads}", sc.ProcessMismatchError, *shapes):
        with sc.prefetch_to_device(iter([{"x": uneven}]), threads=threads) as it:
            next(it)

# Rows that do not divide over one process's devices: that process says how to pad, the others name it.
odd = np.ones((local + (1 if pid == 0 else 0), 2), np.float32)
if pid == 0:
    expected = (f"{local + 1} examples on process 0", f"pad_batch(batch, {local})")
else:
    expected = ("process 0 cannot place its host input",)
with raises("indivisible rows", sc.ShapeError, *expected):
    sc.shard_batch({"x": odd})
with raises(
    "indivisible rows in spmd", sc.ShapeError, *((f"process 0 holds {local} of them",) if pid == 0 else expected)
):
    total(odd)

# After the errors, matching calls still work (and their sync points still pair up).
check_global("shard_batch after errors", sc.shard_batch({"x": mine})["x"], global_x)

sc.barrier("done")
print("CHECKS OK", len(checks))
