"""Worker for tests/test_multiprocess.py: processes that disagree or fall out of step, in one job.

Run it under the launcher with 2 processes x 2 devices. Agreements that hold print ``OK <name>``; checks that
must fail print ``CAUGHT <name>: <message>``: differing descriptions, trees and replicas (through
spmdcomm.runtime.transport), then mismatched barrier names, an exception inside main_process_first, a
debug-mode shape mismatch and a host_all_reduce shape mismatch. Then the missing-process cases: process 1 stops
iterating ``join_batches`` early (process 0 prints ``JOIN TIMEOUT after <s> s: <message>``); process 0 calls
``barrier`` once more than process 1, the seed bug (``BARRIER TIMEOUT after <s> s: <message>``); process 1
never calls ``broadcast_tree``: process 0 prints ``TIMEOUT after <s> s: <message>`` and exits 1. Process 1
prints ``DONE``.
"""

import sys
import time

import spmdcomm as sc

sc.initialize(timeout=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from checks import expect  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from spmdcomm.runtime import host_collectives, transport  # noqa: E402

pid = sc.process_index()
assert sc.process_count() == 2
mesh = sc.data_mesh()
FIX = "build it the same way everywhere."


def ok(name, condition):
    assert condition, name
    print(f"OK {name}", flush=True)


def replicated(value):
    """A fully replicated global array whose copies hold each process's own ``value`` (unchecked by JAX)."""
    return jax.make_array_from_process_local_data(NamedSharding(mesh, sc.P()), value, value.shape)


# --- agreement that holds ------------------------------------------------------------------------------
transport.check_same_across_processes("f", "descriptions", "['w']: (3,) float32", fix=FIX, timeout=30)
ok("same description", True)

# Process 1's tree reaches every process bit for bit: -0.0, a denormal, a NaN payload, bf16, bool, a 3 MB leaf.
bits = np.array([0x8000_0000, 0x0000_0001, 0x7FC0_0001 + pid], np.uint32)
tree = {
    "f32": bits.view(np.float32) if pid == 1 else np.zeros(3, np.float32),
    "bf16": (np.arange(5) - pid).astype(jax.numpy.bfloat16),
    "mask": np.array([pid == 1, False]),
    "big": np.full((768, 1024), pid, np.float32),
    "step": np.int64(10 + pid),
}
got = host_collectives.broadcast_tree("TrainState.create", tree, root=1, timeout=30)
ok("broadcast_tree structure", jax.tree.structure(got) == jax.tree.structure(tree))
ok("broadcast_tree f32 bits", got["f32"].view(np.uint32).tolist() == [0x8000_0000, 1, 0x7FC0_0002])
ok("broadcast_tree bf16", got["bf16"].astype(np.float32).tolist() == [-1, 0, 1, 2, 3])
ok("broadcast_tree bool", got["mask"].tolist() == [True, False] and got["mask"].dtype == bool)
ok("broadcast_tree big", got["big"].shape == (768, 1024) and (got["big"] == 1).all())
ok("broadcast_tree scalar", got["step"].dtype == np.int64 and int(got["step"]) == 11)

same = {"w": replicated(np.arange(4, dtype=np.float32)), "b": replicated(np.ones(2, np.int32))}
ok("replicas in sync", sc.check_replicas_in_sync(same, timeout=30) == [])

# --- disagreement is named: which process, what differs ----------------------------------------------
expect(
    "description",
    sc.ProcessMismatchError,
    lambda: transport.check_same_across_processes(
        "TrainState.create", "parameter trees", f"['w']: ({3 + pid},) float32", fix=FIX, timeout=30
    ),
)
expect(
    "tree_shapes",
    sc.ProcessMismatchError,
    lambda: host_collectives.broadcast_tree("TrainState.create", {"w": np.zeros(3 + pid, np.float32)}, timeout=30),
)
drifted = {"w": replicated(np.full(4, pid, np.float32))}
process1 = sorted(d.id for d in sc.process_devices(1))
want = [sc.runtime.Divergence("['w']", device, 1) for device in process1]
ok("divergence on process 1's devices", sc.check_replicas_in_sync(drifted, timeout=30) == want)
expect("diverged", sc.ReplicaDivergenceError, lambda: sc.assert_replicated(drifted, timeout=30))
extra = dict(same, **({"extra": replicated(np.zeros(1, np.float32))} if pid == 1 else {}))
expect("replica_leaves", sc.ProcessMismatchError, lambda: sc.check_replicas_in_sync(extra, timeout=30))

# --- processes out of step raise instead of hanging -----------------------------------------------------


def enter_first():
    with sc.main_process_first(timeout=30):
        if sc.is_main_process():
            raise OSError("dataset download failed")


def debug_call():
    sc.set_debug(True)
    try:
        f = sc.spmd(lambda b: sc.psum(b, "data"), in_specs=sc.P("data"), out_specs=sc.P())
        f(np.zeros((4, 3 + pid), np.float32))
    finally:
        sc.set_debug(False)


expect("mismatch", sc.ProcessMismatchError, lambda: sc.barrier(f"name{pid}", timeout=30))
if pid == 0:
    expect("first_main", OSError, enter_first)
else:
    expect("first_other", sc.RemoteProcessError, enter_first)
expect("debug", sc.ProcessMismatchError, debug_call)
expect(
    "host_shapes",
    sc.ProcessMismatchError,
    lambda: sc.host_all_reduce({"v": np.zeros(2 + pid)}, op="sum", timeout=30),
)

# --- a missing process is named within the timeout ------------------------------------------------------
# join_batches: process 1 leaves after one step while process 0 has more batches.
start = time.monotonic()
try:
    for _ in sc.join_batches(({"x": np.ones(2)} for _ in range(3)), timeout=3):
        if pid == 1:
            break
except sc.BarrierTimeoutError as e:
    print(f"JOIN TIMEOUT after {time.monotonic() - start:.2f} s: {e}", flush=True)
sc.barrier("after join", timeout=60)  # join_batches has its own channel: the main one is still in step

if pid == 0:
    # The seed bug: process 0 calls barrier twice, process 1 once.
    start = time.monotonic()
    try:
        sc.barrier("b", timeout=3)
    except sc.BarrierTimeoutError as e:
        print(f"BARRIER TIMEOUT after {time.monotonic() - start:.2f} s: {e}", flush=True)
    # broadcast_tree: process 1 never calls it.
    start = time.monotonic()
    try:
        host_collectives.broadcast_tree("TrainState.create", {"w": np.zeros(3)}, timeout=3)
    except sc.BarrierTimeoutError as e:
        print(f"TIMEOUT after {time.monotonic() - start:.2f} s: {e}", flush=True)
        sys.exit(1)
print("DONE", flush=True)
