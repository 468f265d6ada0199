"""Multi-process pipeline worker: a mesh {"stage": 2, "data": 2} whose stage axis spans the processes (stage s on
process s) and whose data axis stays inside each process.

Usage: spmdcomm-launch -n 2 --devices-per-process 2 mp_pipeline.py OUT_DIR
The test hands both models' initial parameters over in OUT_DIR (ddp_models.write_initial).
Trains tests/test_pipeline.py's model (8 stacked blocks) 3 steps under FSDP with a GPipe schedule of 4
micro-batches, then with the 1F1B and ZB-H1 schedules, every process passing the global batch (host_input="global");
process 0 writes the parameters (in canonical layer order) and the losses of each.

Then, in the same processes (one job: each process starting and compiling its programs costs more than the steps),
tests/test_expert_parallel.py's MoE model: one SGD step on a mesh {"expert": 2, "data": 2} whose expert axis spans
the processes (the tokens' all-to-alls cross them), on a padded batch (the MoE layer leaves the padding rows out);
process 0 writes the new parameters and the loss.
"""

import sys
from pathlib import Path

import spmdcomm as sc

sc.initialize()

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_models import read_initial, write_params  # noqa: E402
from test_pipeline import TX, Net, batches, loss_fn  # noqa: E402


def experts(out_dir: Path, params) -> None:
    import optax
    from test_expert_parallel import LR, MODEL, REAL_ROWS, RULES, batch, masked_loss_fn

    mesh = sc.make_mesh({"expert": 2, "data": 2})
    rows = [{d.process_index for d in row} for row in mesh.devices]
    assert rows == [{0}, {1}], rows  # the expert axis across the processes
    state = sc.TrainState.create(
        params=params, tx=optax.sgd(LR), apply_fn=MODEL.apply, mesh=mesh, logical_axis_rules=RULES[None]
    )
    padded = sc.pad_batch(jax.tree.map(lambda a: a[:REAL_ROWS], batch()), 8)  # padding on both processes' rows
    state, history = sc.fit(sc.make_train_step(masked_loss_fn, host_input="global"), state, [padded])
    full = jax.jit(lambda p: p, out_shardings=sc.replicated_sharding(mesh=mesh))(state.full_params())
    write_params(out_dir, "experts", full, history)
    print("EXPERTS OK", flush=True)


def main(out_dir: Path) -> None:
    initial = read_initial(out_dir)
    mesh = sc.make_mesh({"stage": 2, "data": 2})
    rows = [{d.process_index for d in row} for row in mesh.devices]
    assert rows == [{0}, {1}], rows  # one stage per process: the activations cross processes
    step = sc.make_train_step(loss_fn, host_input="global")
    for name, schedule in [("pipeline", "gpipe"), ("pipeline_1f1b", "1f1b"), ("pipeline_zb", "zb-h1")]:
        state = sc.TrainState.create(
            params=initial["pipeline"],
            apply_fn=Net().apply,
            tx=TX,
            mesh=mesh,
            strategy="fsdp",
            pipeline=sc.Pipeline(microbatches=4, schedule=schedule),
        )
        report = sc.explain(step, state, batches()[0])
        assert report.pipeline.stage_gathers == 0 and report.pipeline.permutes > 0, report
        state, history = sc.fit(step, state, batches())
        full = jax.jit(lambda p: p, out_shardings=sc.replicated_sharding(mesh=mesh))(state.full_params())
        write_params(out_dir, name, full, history)
    print("PIPELINE OK", flush=True)
    experts(out_dir, initial["experts"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
