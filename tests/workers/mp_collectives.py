"""Worker for tests/test_multiprocess.py: every collective and sync across processes, vs NumPy.

Run it under the launcher:
``spmdcomm-launch -n 2 --devices-per-process 2 mp_collectives.py SHARED_FILE``.
Each process prints ``CHECKS OK <count>`` at the end; any failed check raises (non-zero exit).
"""

import sys
import time

import spmdcomm as sc

sc.initialize(timeout=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from checks import check, checks  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

P = sc.P
shared = sys.argv[1]
pid, nproc = sc.process_index(), sc.process_count()
n = sc.device_count()
mesh = sc.data_mesh()


def host(tree):
    """The global value of each (possibly multi-process) array of ``tree`` as NumPy."""

    def one(x):
        if x.is_fully_addressable or x.sharding.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def run(fn, x, in_specs=None, out_specs=None, backend="shard_map"):
    in_specs = P("data") if in_specs is None else in_specs
    out_specs = P() if out_specs is None else out_specs
    # Every process passes the whole input (the global value), not its own rows.
    f = sc.spmd(fn, in_specs=in_specs, out_specs=out_specs, mesh=mesh, backend=backend, host_input="global")
    return host(f(x))


# --- topology -----------------------------------------------------------------------------------
assert nproc > 1 and sc.is_initialized()
sc.initialize()  # a second call is a no-op
try:
    sc.initialize(num_processes=nproc + 1)
except sc.DistributedError as e:
    assert "already joined as process" in str(e)
    checks.append("initialize_again")
check("local_rank", sc.local_rank(), pid)  # one host: local rank == process index
check("is_main", sc.is_main_process(), pid == 0)
check("is_main_local", sc.is_main_process(local=True), pid == 0)
check("process_devices", len(sc.process_devices()), sc.local_device_count())
check(
    "process_devices_other",
    [d.process_index for d in sc.process_devices(nproc - 1)],
    [nproc - 1] * sc.local_device_count(),
)

# --- device collectives (one row per device) ----------------------------------------------------
k = 3
x = (np.arange(n * k, dtype=np.float32).reshape(n, k) - 4) * 1.5
check("psum", run(lambda b: sc.psum(b, "data"), x), x.sum(0, keepdims=True))
check("psum_rs_ag", run(lambda b: sc.psum(b, "data", algorithm="rs_ag"), x), x.sum(0, keepdims=True))
check("pmean", run(lambda b: sc.pmean(b, "data"), x), x.mean(0, keepdims=True))
check("pmax", run(lambda b: sc.pmax(b, "data"), x), x.max(0, keepdims=True))
check("pmin", run(lambda b: sc.pmin(b, "data"), x), x.min(0, keepdims=True))
xi = np.arange(n * k, dtype=np.int32).reshape(n, k) % 5 - 2
check("all_reduce_prod", run(lambda b: sc.all_reduce(b, "data", op="prod"), xi), xi.prod(0, keepdims=True))
check("psum_tree", run(lambda b: sc.psum({"a": b, "b": 2 * b}, "data"), x)["b"], 2 * x.sum(0, keepdims=True))
check("all_gather", run(lambda b: sc.all_gather(b, "data"), x), x)
check("all_gather_stacked", run(lambda b: sc.all_gather(b, "data", tiled=False), x), x[:, None, :])
m = 2
y = np.arange(n * n * m, dtype=np.float32).reshape(n * n, m)
blocks = y.reshape(n, n, m)  # device i holds blocks[i]
check("reduce_scatter_sum", run(lambda b: sc.reduce_scatter(b, "data"), y, out_specs=P("data")), blocks.sum(0))
check(
    "reduce_scatter_max", run(lambda b: sc.reduce_scatter(b, "data", op="max"), y, out_specs=P("data")), blocks.max(0)
)
sq = np.arange(n * n, dtype=np.int32).reshape(n, n)
check(
    "all_to_all",
    run(lambda b: sc.all_to_all(b, "data", split_dim=1, concat_dim=0), sq, out_specs=P("data")).reshape(n, n),
    sq.T,
)
root = n - 1
check("broadcast", run(lambda b: sc.broadcast(b, "data", root=root), x), x[root : root + 1])
want = x.copy()
want[0] = x.sum(0)
check("reduce", run(lambda b: sc.reduce(b, "data", root=0), x, out_specs=P("data")), want)
want = np.zeros((n * n, k), np.float32)
want[n : 2 * n] = x
check("gather", run(lambda b: sc.gather(b, "data", root=1), x, out_specs=P("data")), want)
z = np.arange(n * 2, dtype=np.float32)
check("scatter", run(lambda b: sc.scatter(b, "data", root=0), z, in_specs=P(), out_specs=P("data")), z)
want = np.zeros_like(x)
want[0], want[1] = x[1], x[0]
check("permute", run(lambda b: sc.permute(b, "data", perm=[(0, 1), (1, 0)]), x, out_specs=P("data")), want)
check("shift", run(lambda b: sc.shift(b, "data", offset=1), x, out_specs=P("data")), np.roll(x, 1, axis=0))
check("axis_index", run(lambda b: sc.axis_index("data")[None], x, out_specs=P("data")), np.arange(n))
check("axis_size", run(lambda b: np.full((1,), sc.axis_size("data")), x), [n])

# --- the pmap backend gives the same answers across processes ------------------------------------
check("pmap_psum", run(lambda b: sc.psum(b, "data"), x, backend="pmap"), x.sum(0, keepdims=True))
check(
    "pmap_shift",
    run(lambda b: sc.shift(b, "data", offset=1), x, out_specs=P("data"), backend="pmap"),
    np.roll(x, 1, axis=0),
)
check(
    "pmap_scatter",
    run(lambda b: sc.scatter(b, "data", root=0), z, in_specs=P(), out_specs=P("data"), backend="pmap"),
    z,
)
check("pmap_all_gather", run(lambda b: sc.all_gather(b, "data"), x, backend="pmap"), x)

# --- debug mode: identical calls pass the check -------------------------------------------------
sc.set_debug(True)
check("debug_ok", run(lambda b: sc.psum(b, "data"), x), x.sum(0, keepdims=True))
sc.set_debug(False)

# --- host-level collectives ---------------------------------------------------------------------
vals = [np.array([p + 1, -p, 2 * p], np.int64) for p in range(nproc)]
for op, ref in [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min), ("prod", np.prod)]:
    got = sc.host_all_reduce({"v": vals[pid], "s": np.float32(pid)}, op=op)
    check(f"host_all_reduce_{op}", got["v"], ref(np.stack(vals), axis=0))
    check(f"host_all_reduce_{op}_scalar", got["s"], ref(np.arange(nproc, dtype=np.float32)))
check("host_all_gather", sc.host_all_gather({"p": pid, "v": vals[pid]})["v"], np.stack(vals))
check("host_broadcast", sc.host_broadcast({"v": vals[pid]}, root=nproc - 1)["v"], vals[-1])
assert sc.broadcast_object({"from": pid, "cfg": [1, "a"]}, root=1) == {"from": 1, "cfg": [1, "a"]}
assert sc.all_gather_object(("p", pid)) == [("p", p) for p in range(nproc)]
checks.append("objects")

# --- barrier ordering: all "before" lines precede all "after" lines -----------------------------
for rnd in range(3):
    time.sleep(0.3 if pid == rnd % nproc else 0.0)  # one late process per round
    with open(shared, "a") as f:
        f.write(f"before {rnd} {pid}\n")
    sc.barrier(f"round {rnd}", timeout=60)
    with open(shared, "a") as f:
        f.write(f"after {rnd} {pid}\n")
    sc.barrier(f"round {rnd} done", timeout=60)
    lines = open(shared).read().split("\n")
    mine = [ln for ln in lines if f" {rnd} " in ln]
    kinds = [ln.split()[0] for ln in mine]
    check(f"barrier_order_{rnd}", kinds, ["before"] * nproc + ["after"] * nproc)

# --- main_process_first: main's block finishes before any other process starts it ---------------
order = shared + ".first"
with sc.main_process_first(timeout=60):
    if pid == 0:
        time.sleep(0.3)
    with open(order, "a") as f:
        f.write(f"{pid}\n")
sc.barrier("after first", timeout=60)
check("main_process_first", open(order).read().split()[0], "0")

sc.sync_devices(timeout=60)
print(f"CHECKS OK {len(checks)}", flush=True)
