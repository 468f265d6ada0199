"""DDP equivalence: N devices must train exactly what one device trains on the global batch.

Which cases run: each model and optimizer over every device count. The fast tier (``-m "not slow"``) keeps the
MLP with Adam on 8 devices, the gradient trap and devices without real examples; the rest is slow.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ddp_models import (
    BATCHES,
    STEPS,
    assert_trees_close,
    example_batch,
    init,
    loss_fn,
    mesh_of,
    optimizer,
    reference_train,
    run_ddp,
    run_reference,
)

import spmdcomm as sc


def run(n: int, *, fast: bool = False) -> object:
    """One device-count parameter, marked slow (left out of the fast tier) unless ``fast``."""
    return pytest.param(n, marks=() if fast else pytest.mark.slow, id=f"{n}dev")


# DDP holds the same replicated layout on any device count that divides the batch: one device (no collective
# has a partner) and eight (the smallest blocks) stand for 2 and 4.
@pytest.mark.parametrize("opt", [pytest.param("sgd_momentum", marks=pytest.mark.slow), "adam"])
@pytest.mark.parametrize("n", [run(1), run(8, fast=True)])
def test_mlp_n_devices_equal_one_device_on_global_batch(n, opt, reference_run):
    state, history = run_ddp("mlp", n, opt, batches=BATCHES["mlp"])
    ref_params, _, ref_losses = reference_run("mlp", opt)
    assert_trees_close(state.params, ref_params)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    assert int(state.step) == STEPS and all(h["examples"] == 16 for h in history)
    sc.assert_replicated(state)


# Cross-replica statistics over the fewest devices that share them (2) and the most (8, two rows each); 4 devices
# train in test_without_cross_replica_batchnorm_statistics_differ and in test_sharded's CNN cases.
@pytest.mark.parametrize("opt", [pytest.param("sgd_momentum", marks=pytest.mark.slow), "adam"])
@pytest.mark.parametrize("n", [run(2), run(8)])
def test_cnn_with_cross_replica_batchnorm_equals_one_device(n, opt, reference_run):
    state, _ = run_ddp("cnn", n, opt, batches=BATCHES["cnn"])
    ref_params, ref_model_state, _ = reference_run("cnn", opt)
    assert_trees_close(state.params, ref_params)
    assert_trees_close(state.model_state, ref_model_state)
    sc.assert_replicated(state)


@pytest.mark.slow
def test_without_cross_replica_batchnorm_statistics_differ(reference_run):
    # The same CNN with per-device BatchNorm does NOT match one device: the test above can fail.
    apply_fn, params, model_state = init("cnn", axis_name=None)
    mesh = mesh_of(4)
    state = sc.TrainState.create(
        params=params,
        model_state=model_state,
        apply_fn=apply_fn,
        tx=optimizer("sgd_momentum"),
        mesh=mesh,
    )
    state, _ = sc.fit(sc.make_train_step(loss_fn), state, BATCHES["cnn"])
    ref_params, _, _ = reference_run("cnn", "sgd_momentum")
    kernel = np.asarray(state.params["Dense_0"]["kernel"])
    assert not np.allclose(kernel, ref_params["Dense_0"]["kernel"], rtol=1e-5, atol=1e-6)


def test_gradient_trap_naive_step_differs():
    # A hand-written shard_map step that pmeans jax.grad of replicated params is n times too large.
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(4)

    def naive(params, data):
        grads = jax.grad(
            lambda p: loss_fn(p, data, apply_fn=apply_fn, model_state={}, rng=None, mask=jnp.ones(4, bool))[0]
        )(params)
        return jax.lax.pmean(grads, "data")

    got = sc.spmd(naive, mesh=mesh, in_specs=(sc.P(), sc.P("data")), out_specs=sc.P())(params, BATCHES["mlp"][0])
    full = jax.jit(  # one program (eagerly, each operation of the loss and its derivative compiles its own)
        jax.grad(
            lambda p: loss_fn(
                p,
                BATCHES["mlp"][0],
                apply_fn=apply_fn,
                model_state={},
                rng=None,
                mask=jnp.ones(16, bool),
            )[0]
        )
    )(params)
    ratio = np.asarray(got["Dense_1"]["bias"]) / np.asarray(full["Dense_1"]["bias"])
    np.testing.assert_allclose(ratio, 4.0, rtol=1e-4)


@pytest.mark.slow
def test_accumulation_equals_one_big_batch():
    batches = [example_batch("mlp", 32, seed=s) for s in range(3)]
    state, history = run_ddp("mlp", 2, "adam", batches=batches, accum_steps=4)
    ref_params, _, ref_losses = run_reference("mlp", "adam", batches)
    assert_trees_close(state.params, ref_params)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    assert int(state.step) == 3
    assert int(state.opt_state[0].count) == 3  # one optimizer step per global step, not per micro-batch


@pytest.mark.slow
@pytest.mark.parametrize("n", [4, 8])
def test_uneven_batch_equals_one_device_on_the_real_examples(n):
    batches = [example_batch("mlp", 15, seed=s) for s in range(STEPS)]
    state, history = run_ddp("mlp", n, "adam", batches=[sc.pad_batch(b, n) for b in batches])
    ref_params, _, ref_losses = run_reference("mlp", "adam", batches)
    assert_trees_close(state.params, ref_params)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    assert all(h["examples"] == 15 for h in history)


def test_devices_without_real_examples_get_weight_zero():
    # 3 real examples on 8 devices: 5 devices see only padding (their mean loss is 0/0 in a naive
    # loss).
    def nan_prone_loss(params, batch, *, apply_fn, model_state, rng, mask):
        ce = optax.softmax_cross_entropy_with_integer_labels(apply_fn({"params": params}, batch["x"]), batch["y"])
        return jnp.sum(ce * mask) / jnp.sum(mask)

    batches = [example_batch("mlp", 3, seed=s) for s in range(3)]
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(8)
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh)
    state, history = sc.fit(sc.make_train_step(nan_prone_loss), state, [sc.pad_batch(b, 8) for b in batches])
    ref_params, _, ref_losses = reference_train(loss_fn, apply_fn, params, {}, optax.adam(1e-2), batches)
    assert_trees_close(state.params, ref_params)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_zero1_equals_replicated_and_shards_optimizer_state(opt):
    replicated, _ = run_ddp("mlp", 4, opt, batches=BATCHES["mlp"])
    sharded, _ = run_ddp("mlp", 4, opt, batches=BATCHES["mlp"], strategy="zero1")
    assert_trees_close(sharded.params, replicated.params, rtol=1e-6)
    full, part = sc.optimizer_state_bytes(replicated), sc.optimizer_state_bytes(sharded)
    n_params = sum(x.size for x in jax.tree.leaves(replicated.params))
    moments = 1 if opt == "sgd_momentum" else 2
    # 1/4 of the (padded) moments, plus the replicated step counters.
    assert part <= moments * 4 * -(-n_params // 4) + 8
    assert part < full / 3.5
    sc.assert_replicated(sharded.params)


@pytest.mark.slow
def test_zero1_with_uneven_batch_and_accumulation():
    batches = [example_batch("mlp", 30, seed=s) for s in range(3)]
    state, _ = run_ddp(
        "mlp",
        4,
        "adam",
        batches=[sc.pad_batch(b, 8) for b in batches],
        strategy="zero1",
        accum_steps=2,
    )
    ref_params, _, _ = run_reference("mlp", "adam", batches)
    assert_trees_close(state.params, ref_params)


@pytest.mark.slow
def test_bf16_reduction_is_close_and_reduces_in_bf16():
    f32, _ = run_ddp("mlp", 4, "adam", batches=BATCHES["mlp"])
    bf16, _ = run_ddp("mlp", 4, "adam", batches=BATCHES["mlp"], reduce_dtype=jnp.bfloat16)
    assert_trees_close(bf16.params, f32.params, rtol=2e-2, atol=2e-3)
    assert not np.array_equal(bf16.params["Dense_0"]["kernel"], f32.params["Dense_0"]["kernel"])
    apply_fn, params, _ = init("mlp")
    mesh = mesh_of(4)
    state = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.adam(1e-2), mesh=mesh)
    lowered = sc.make_train_step(loss_fn, reduce_dtype=jnp.bfloat16).lower(state, BATCHES["mlp"][0])
    operands = re.findall(r'stablehlo\.all_reduce".*?\}\) : \(([^)]*)\)', lowered.as_text(), re.S)
    # The f32 vector of metrics, and each gradient leaf in bf16 (XLA:CPU later promotes a bf16
    # all-reduce back to f32 for its kernel, so on CPU the rounding happens but the bytes moved do
    # not shrink).
    assert sorted(o.rsplit("x", 1)[-1] for o in operands) == ["bf16>"] * 4 + ["f32>"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16.params))
