"""Multi-process NNX worker: a dropout model with RNG streams through create_nnx and the step.

Usage: spmdcomm-launch -n 2 --devices-per-process 2 mp_nnx.py OUT_DIR
Every process builds its model with DIFFERENT seeds (seed = process index), so its stream keys
differ: TrainState.create_nnx must broadcast process 0's, key data included. Process 0 writes the
parameters and the key data after 2 per-example steps; every process writes its keys to OUT_DIR/keys.<process>.json.
"""

import json
import sys
from pathlib import Path

import spmdcomm as sc

sc.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_models import local_rows  # noqa: E402
from test_rng import GLOBAL, NnxDropout, batches, nnx_mse  # noqa: E402


def main(out_dir: Path) -> None:
    mesh = sc.data_mesh()
    seed = jax.process_index()
    model = NnxDropout(nnx.Rngs(params=seed, dropout=seed + 1, noise=seed + 2))
    state = sc.TrainState.create_nnx(model, tx=optax.sgd(0.05), rng=7, mesh=mesh)
    keys = [
        np.asarray(jax.random.key_data(x.addressable_data(0))).tolist()
        for x in jax.tree.leaves(state.model_state)
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    # A file per process, not a printed line: Gloo's C++ prints share stdout and can cut into it.
    (out_dir / f"keys.{jax.process_index()}.json").write_text(json.dumps(keys))
    step = sc.make_train_step(sc.nnx_loss_fn(nnx_mse), rng="per_example")
    data = [local_rows(b, mesh) for b in batches(2)]
    assert len(jax.tree.leaves(data[0])[0]) == GLOBAL // jax.process_count()
    state, _ = sc.fit(step, state, data)
    sc.assert_replicated(state)
    if jax.process_index() == 0:
        flat = {
            jax.tree_util.keystr(p): np.asarray(jax.device_get(x.addressable_data(0)))
            for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
        }
        np.savez(out_dir / "nnx_params.npz", **flat)
    print("NNX OK", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
