"""Multi-process DDP worker: trains the test MLP and writes process 0's final parameters.

Usage: spmdcomm-launch -n 2 --devices-per-process 2 mp_ddp.py OUT_DIR
Every process starts from DIFFERENT parameters (seed = process index; the test hands both sets over in OUT_DIR,
ddp_models.write_initial): TrainState.create must broadcast process 0's. Each process feeds only its own rows of
every global batch, as a DDP data loader would. Then a token-weighted loss (sc.weighted) on batches whose real
tokens are uneven between the processes (process 1's few, one of its devices none), under DDP with 2 accumulation
micro-batches and under FSDP.
"""

import sys
from pathlib import Path

import spmdcomm as sc

sc.initialize()

import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_models import (  # noqa: E402
    MLP,
    example_batch,
    local_rows,
    loss_fn,
    read_initial,
    token_batches,
    token_loss_fn,
    write_params,
)

WEIGHTED = {"ddp": 2, "fsdp": 1}  # strategy: accum_steps


def main(out_dir: Path) -> None:
    mesh = sc.data_mesh()
    apply_fn, params = MLP().apply, read_initial(out_dir)[f"seed{jax.process_index()}"]
    batches = [sc.pad_batch(example_batch("mlp", 15, seed=s), 4) for s in range(5)]
    for strategy in sc.train.STRATEGIES:
        state = sc.TrainState.create(
            params=params, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh, strategy=strategy
        )
        step = sc.make_train_step(loss_fn)
        local = [sc.MaskedBatch(*local_rows((b.data, b.mask), mesh)) for b in batches]
        if strategy == "ddp":
            # Across processes the default DDP reduces ONE flat float32 buffer per step: the 212 parameters
            # after the example count, loss and accuracy.
            hlo = step.lower(state, local[0]).compile().as_text()
            reduces = [line for line in hlo.splitlines() if " all-reduce(" in line or " all-reduce-start(" in line]
            assert len(reduces) == 1 and "f32[215]" in reduces[0].split(" all-reduce")[0], reduces
        state, history = sc.fit(step, state, local)
        full = state.full_params()
        sc.assert_replicated(full)
        write_params(out_dir, strategy, full, history)
        print("DDP OK", strategy, flush=True)
    tokens = [local_rows(b, mesh) for b in token_batches(16, 6, 3)]
    for strategy, accum in WEIGHTED.items():
        state = sc.TrainState.create(
            params=params, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh, strategy=strategy
        )
        state, history = sc.fit(sc.make_train_step(token_loss_fn, accum_steps=accum), state, tokens)
        write_params(out_dir, f"weighted_{strategy}", state.full_params(), history)
        print("WEIGHTED OK", strategy, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
