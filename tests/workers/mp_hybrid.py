"""Multi-process hybrid-sharding worker: a 2-D mesh {"replica": 2, "shard": 2} whose replica axis spans the
processes (one replica per process, the multi-node layout) and whose shard axis stays inside each process.

Usage: spmdcomm-launch -n 2 --devices-per-process 2 mp_hybrid.py OUT_DIR
(the test hands the initial parameters over in OUT_DIR: ddp_models.write_initial)
Trains the test transformer block 4 steps under FSDP, which splits parameters, gradients and optimizer state over the
shard axis inside each process, in 2 micro-batches, on padded batches (30 real rows of 32), each process feeding its
own rows; process 0 writes the parameters and the losses. (tests/test_hybrid.py runs every strategy on these axes in
one process, and mp_ddp.py every strategy on one data axis across processes.)
"""

import sys
from pathlib import Path

import spmdcomm as sc

sc.initialize()

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_models import read_initial, write_params  # noqa: E402
from hybrid_models import Block, batches, loss_fn  # noqa: E402
from test_hybrid import make_tx  # noqa: E402

AXES = ("replica", "shard")
ACCUM_STEPS = 2


def local_rows(tree, mesh):
    """This process's rows of a global host batch: its devices' blocks over both data axes are contiguous."""
    size = len(jax.tree.leaves(tree)[0])
    index_map = sc.data_sharding(mesh=mesh, axis=AXES).addressable_devices_indices_map((size,))
    start = min(idx[0].start or 0 for idx in index_map.values())
    stop = max(idx[0].stop or size for idx in index_map.values())
    return jax.tree.map(lambda x: x[start:stop], tree)


def main(out_dir: Path) -> None:
    mesh = sc.make_mesh({"replica": 2, "shard": 2})
    rows = [{d.process_index for d in row} for row in mesh.devices]
    assert rows == [{0}, {1}], rows  # replicas across processes, shards inside one
    params = read_initial(out_dir)["params"]
    state = sc.TrainState.create(
        params=params, apply_fn=Block().apply, tx=make_tx(), mesh=mesh, axis=AXES, strategy="fsdp"
    )
    step = sc.make_train_step(loss_fn, accum_steps=ACCUM_STEPS)
    padded = [sc.pad_batch(b, 4 * ACCUM_STEPS) for b in batches(4, rows=30)]
    local = [sc.MaskedBatch(*local_rows((b.data, b.mask), mesh)) for b in padded]
    # Gathers and reduce-scatters stay inside a process; only all-reduces cross the replica axis.
    report = sc.explain(step, state, local[0])
    assert {c.kind for c in report.collectives if "replica" in (c.axes or ())} == {"all-reduce"}, report
    state, history = sc.fit(step, state, local)
    write_params(out_dir, "fsdp", state.full_params(), history)
    print("HYBRID OK", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
