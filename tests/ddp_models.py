"""Tiny models, data and a plain single-device reference trainer shared by the DDP tests and the
multi-process test script. The reference uses only jax and optax (no spmdcomm), so it is an
independent check."""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import spmdcomm as sc


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(x)


class CNN(nn.Module):
    """Conv -> cross-replica BatchNorm -> relu -> mean pool -> Dense."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)  # a bias before BatchNorm has no gradient but noise
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(4)(x)


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    """Masked cross entropy following the spmdcomm contract; updates batch_stats when the model has
    them."""
    if model_state:
        logits, new_state = apply_fn({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
    else:
        logits, new_state = apply_fn({"params": params}, batch["x"]), model_state
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    acc = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    return sc.masked_mean(ce, mask), {
        "model_state": new_state,
        "accuracy": sc.masked_mean(acc, mask),
    }


def token_loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    """A token-weighted loss in spmdcomm's contract: the MLP on every token of ``x`` ``[rows, tokens, 8]``, its
    cross-entropy summed over the real tokens (``w``) and their count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(apply_fn({"params": params}, batch["x"]), batch["y"])
    return sc.weighted(jnp.sum(ce * batch["w"]), jnp.sum(batch["w"])), {}


def token_mean_loss(params, batch, *, apply_fn, model_state, rng, mask):
    """What :func:`token_loss_fn` must train on, written for one device: ``sum(loss * w) / sum(w)``."""
    ce = optax.softmax_cross_entropy_with_integer_labels(apply_fn({"params": params}, batch["x"]), batch["y"])
    return jnp.sum(ce * batch["w"]) / jnp.sum(batch["w"]), {}


def token_batches(rows: int, tokens: int, steps: int) -> list[dict[str, np.ndarray]]:
    """``steps`` batches of ``rows`` rows of ``tokens`` tokens whose real tokens (``w``) crowd the first half of the
    rows: the second half (another process's, on 2 processes) holds few, and its last quarter none. Its inputs are
    larger, so are their losses: a mean that weighs its few tokens as much as the first half's many is far off."""
    batches = []
    for s in range(steps):
        rng = np.random.default_rng(100 + s)
        lengths = np.concatenate(
            [rng.integers(0, tokens + 1, rows // 2), rng.integers(0, 2, rows // 4), np.zeros(rows - 3 * (rows // 4))]
        )
        batches.append(
            {
                "x": (
                    rng.standard_normal((rows, tokens, 8)) * np.where(np.arange(rows) < rows // 2, 1, 5)[:, None, None]
                ).astype(np.float32),
                "y": rng.integers(0, 4, (rows, tokens)).astype(np.int32),
                "w": (np.arange(tokens) < lengths[:, None]).astype(np.float32),
            }
        )
    return batches


def init(kind: str, *, axis_name: str | None = None, seed: int = 0) -> tuple[Any, Any, Any]:
    """(apply_fn, params, model_state) of an "mlp" or a "cnn" (whose BatchNorm syncs over
    axis_name)."""
    model = MLP() if kind == "mlp" else CNN(axis_name=axis_name)
    variables = _jitted_init(model)(jax.random.PRNGKey(seed), example_batch(kind, 2, seed=0)["x"])
    variables = jax.tree.map(np.asarray, dict(variables))
    params = variables.pop("params")
    return model.apply, params, variables


def example_batch(kind: str, size: int, *, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (size, 8) if kind == "mlp" else (size, 6, 6, 1)
    return {
        "x": rng.standard_normal(shape).astype(np.float32),
        "y": rng.integers(0, 4, size).astype(np.int32),
    }


def optimizer(name: str) -> optax.GradientTransformation:
    return {"sgd_momentum": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(1e-2)}[name]


def reference_train(loss, apply_fn, params, model_state, tx, batches) -> tuple[Any, Any, list[float]]:
    """One device, whole batches, plain jax.grad + optax: what N-device training must reproduce."""
    opt_state = tx.init(params)
    losses = []

    @jax.jit
    def step(params, opt_state, model_state, data):
        mask = jnp.ones(jax.tree.leaves(data)[0].shape[0], bool)
        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(
            params,
            data,
            apply_fn=apply_fn,
            model_state=model_state,
            rng=jax.random.PRNGKey(0),
            mask=mask,
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            aux.get("model_state", model_state),
            value,
        )

    for data in batches:
        params, opt_state, model_state, value = step(params, opt_state, model_state, data)
        losses.append(float(value))
    return params, model_state, losses


STEPS = 5


def mesh_of(n):
    return sc.data_mesh(devices=jax.devices()[:n])


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
    flat_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def run_ddp(kind, n, opt, *, batches, strategy="ddp", **step_kwargs):
    apply_fn, params, model_state = init(kind, axis_name="data")
    state = sc.TrainState.create(
        params=params,
        model_state=model_state,
        apply_fn=apply_fn,
        tx=optimizer(opt),
        mesh=mesh_of(n),
        strategy=strategy,
    )
    step = sc.make_train_step(loss_fn, **step_kwargs)
    return sc.fit(step, state, batches)


def run_reference(kind, opt, batches):
    apply_fn, params, model_state = init(kind, axis_name=None)
    return reference_train(loss_fn, apply_fn, params, model_state, optimizer(opt), batches)


BATCHES = {kind: [example_batch(kind, 16, seed=s) for s in range(STEPS)] for kind in ("mlp", "cnn")}


def per_device_bytes(tree):
    """Bytes of ``tree``'s placed arrays on one device (the largest, where devices hold different amounts)."""
    per = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def write_params(out_dir, tag, params, history):
    """Process 0 of a multi-process worker writes the (replicated) ``params`` and the losses of ``history``."""
    flat = {
        jax.tree_util.keystr(p): np.asarray(jax.device_get(x.addressable_data(0)))
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    if jax.process_index() == 0:
        np.savez(out_dir / f"params_{tag}.npz", **flat)
        np.save(out_dir / f"losses_{tag}.npy", [h["loss"] for h in history])


def write_initial(out_dir, **trees) -> None:
    """Writes a job's initial parameters (``read_initial`` reads them in each process), drawn once by the test: the
    processes of a job other than process 0 read no compilation cache, so compiling a model's init there costs a
    process more than handing it the numbers."""
    with open(Path(out_dir) / "initial.pkl", "wb") as f:
        pickle.dump(jax.tree.map(np.asarray, trees), f)


def read_initial(out_dir) -> dict[str, Any]:
    """The trees ``write_initial`` wrote, by keyword (NumPy leaves)."""
    with open(Path(out_dir) / "initial.pkl", "rb") as f:
        return pickle.load(f)


def local_rows(batch, mesh):
    """This process's rows of a global host batch (its devices' blocks are contiguous), as
    ``jax.make_array_from_process_local_data`` and the train step expect host input with several processes."""
    size = len(jax.tree.leaves(batch)[0])
    index_map = sc.data_sharding(mesh=mesh).addressable_devices_indices_map((size,))
    start = min(idx[0].start or 0 for idx in index_map.values())
    stop = max(idx[0].stop or size for idx in index_map.values())
    return jax.tree.map(lambda x: x[start:stop], batch)


def jit_once(fn):
    """``jax.jit(fn)`` for a program that runs once, such as a model's ``init``: on CPU without XLA's backend
    optimisation, which compiles in a fraction of the time. Its results may differ from the optimised program's in
    the last bit: compare only with references computed from the same results."""
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    return jax.jit(fn, compiler_options=options)


def nnx_once(make):
    """The NNX module ``make()`` returns, its variables drawn by one program compiled with ``jit_once`` (eagerly,
    each initializer compiles its own programs); its structure comes from ``nnx.eval_shape``, which compiles
    nothing."""
    return nnx.merge(nnx.graphdef(nnx.eval_shape(make)), jit_once(lambda: nnx.state(make()))())


@functools.cache
def _jitted_init(model: nn.Module):
    """``model.init`` as one compiled program, built once per model (Flax modules are hashable dataclasses):
    eagerly, every initializer shape and layer operation compiles its own."""
    return jax.jit(model.init)
