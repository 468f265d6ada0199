"""Sharded strategies (ZeRO-2, FSDP): N devices train what one device trains, with 1/N of the state each.

Which cases run: the MLP under each strategy with Adam (parameters and two moments split) over 8 devices (where the
4-entry bias stays whole), and with SGD momentum over 4 (where every leaf splits, as on 2); the CNN under
each strategy and optimizer over 4. The fast tier (``-m "not slow"``) keeps the MLP on 8 devices under each
strategy, FSDP's split, skipping, evaluation and resume, and the collectives explain reports; the other training
runs are slow.
"""

import functools
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
    nnx_once,
    optimizer,
    per_device_bytes,
    run_ddp,
    run_reference,
)
from flax import nnx

import spmdcomm as sc

SHARDED = ["zero2", "fsdp", sc.FSDP(reshard_after_forward=False)]
IDS = ["zero2", "fsdp", "fsdp-keep"]


def needs(n):
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices")


# The MLP's leaves (8 x 16, 16 x 4, 16, 4) all split on dimension 0 on 2 or 4 devices alike; on 8 the bias of 4
# stays whole. Adam on 8 devices and SGD with momentum on 4 meet both layouts and both kinds of optimizer state.
MLP_CASES = [
    pytest.param(n, opt, strategy, id=f"{n}-{opt}-{name}", marks=() if fast else pytest.mark.slow)
    for n, opt, fast in [(8, "adam", True), (4, "sgd_momentum", False)]
    for strategy, name in zip(SHARDED, IDS, strict=True)
]


@pytest.mark.parametrize("n, opt, strategy", MLP_CASES)
def test_mlp_equals_one_device(n, opt, strategy, reference_run):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    state, history = run_ddp("mlp", n, opt, batches=BATCHES["mlp"], strategy=strategy)
    ref_params, _, ref_losses = reference_run("mlp", opt)
    assert_trees_close(state.full_params(), ref_params)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    assert int(state.step) == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SHARDED, ids=IDS)
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
@needs(4)
def test_cnn_with_cross_replica_batchnorm_equals_one_device(opt, strategy, reference_run):
    state, _ = run_ddp("cnn", 4, opt, batches=BATCHES["cnn"], strategy=strategy)
    ref_params, ref_model_state, _ = reference_run("cnn", opt)
    assert_trees_close(state.full_params(), ref_params)
    assert_trees_close(state.model_state, ref_model_state)
    sc.assert_replicated(state.model_state)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SHARDED, ids=IDS)
@needs(8)
def test_uneven_batches_with_accumulation_equal_one_device(strategy):
    # 30 real rows padded to 32 over 8 devices x 2 micro-batches: whole padding blocks included.
    batches = [example_batch("mlp", 30, seed=s) for s in range(3)]
    state, history = run_ddp(
        "mlp", 8, "adam", batches=[sc.pad_batch(b, 16) for b in batches], strategy=strategy, accum_steps=2
    )
    ref_params, _, ref_losses = run_reference("mlp", "adam", batches)
    assert_trees_close(state.full_params(), ref_params)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    assert all(h["examples"] == 30 for h in history)
    assert int(state.opt_state[0].count) == 3


@pytest.mark.parametrize("strategy", [pytest.param("zero2", marks=pytest.mark.slow), "fsdp"])
def test_skip_nonfinite_skips_on_every_device(strategy):
    bad = example_batch("mlp", 16, seed=9)
    bad["x"][13, 0] = np.inf  # only the last device sees it
    state, history = run_ddp(
        "mlp", 4, "adam", batches=[BATCHES["mlp"][0], bad, BATCHES["mlp"][1]], strategy=strategy, skip_nonfinite=True
    )
    assert [h["skipped"] for h in history] == [0.0, 1.0, 0.0]
    ref_params, _, _ = run_reference("mlp", "adam", [BATCHES["mlp"][0], BATCHES["mlp"][1]])
    assert_trees_close(state.full_params(), ref_params)


def test_fsdp_splits_each_leaf_on_its_first_divisible_dimension_and_keeps_the_tree():
    apply_fn, params, _ = init("mlp")  # Dense_0: kernel (8, 16), bias (16,); Dense_1: kernel (16, 4), bias (4,)
    ddp = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.adam(1e-3), mesh=mesh_of(8))
    fsdp = sc.TrainState.create(params=params, apply_fn=apply_fn, tx=optax.adam(1e-3), mesh=mesh_of(8), strategy="fsdp")
    assert jax.tree.map(lambda x: x.shape, fsdp.params) == jax.tree.map(np.shape, params)
    specs = {
        "Dense_0": {"kernel": sc.P("data"), "bias": sc.P("data")},
        "Dense_1": {"kernel": sc.P("data"), "bias": sc.P()},
    }
    assert jax.tree.map(lambda x: x.sharding.spec, fsdp.params) == specs
    # Adam's moments are split as their parameters; its count is replicated.
    assert jax.tree.map(lambda x: x.sharding.spec, fsdp.opt_state[0].mu) == specs
    assert fsdp.opt_state[0].count.sharding.spec == sc.P()
    assert {s.data.shape for s in fsdp.params["Dense_1"]["kernel"].addressable_shards} == {(2, 4)}
    assert fsdp.layout.replicated_bytes() == 4 * 4  # the 4-entry bias: 4 floats on every device
    assert_trees_close(fsdp.full_params(), params, rtol=0, atol=0)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(fsdp.full_params()))

    def state_bytes(state):
        return per_device_bytes((state.params, state.opt_state))

    # Params + two Adam moments: 3 x 212 floats whole; per device 3 x (16 + 2 + 8 + 4 replicated) floats,
    # plus the count.
    assert state_bytes(ddp) == 3 * 212 * 4 + 4
    assert state_bytes(fsdp) == 3 * 30 * 4 + 4


def explain(strategy, accum_steps=1, rows=16):
    apply_fn, params, _ = init("mlp")
    state = sc.TrainState.create(
        params=params, apply_fn=apply_fn, tx=optax.adam(1e-3), mesh=mesh_of(4), strategy=strategy
    )
    step = sc.make_train_step(loss_fn, accum_steps=accum_steps)
    return sc.explain(step, state, example_batch("mlp", rows, seed=0))


def ops(report, kind):
    """``[(bytes, where), ...]`` of one kind of collective, one entry per occurrence."""
    return sorted((c.bytes, c.where) for c in report.collectives if c.kind == kind for _ in range(c.count))


@needs(4)
def test_explain_inventory_of_each_sharded_strategy():
    # The MLP's 212 float32 parameters (leaves of 128, 16, 64 and 4 floats, each split 4 ways on dimension 0) are
    # one 848-byte buffer for ZeRO, or one gather and one reduce-scatter per leaf for FSDP; the 12-byte all-reduce
    # carries the example count, loss and accuracy.
    zero2 = explain("zero2")
    assert ops(zero2, "reduce-scatter") == [(848, "entry")]
    assert ops(zero2, "all-gather") == [(848, "entry")]
    assert ops(zero2, "all-reduce") == [(12, "entry")]
    leaves = [(16, "entry"), (64, "entry"), (256, "entry"), (512, "entry")]
    # XLA:CPU in jax 0.10 merges resharding's second gather (Dense_1's kernel, the only gathered value the backward
    # pass needs) with the first (test below); jax 0.11's keeps it.
    regather = [(256, "entry")] if jax.__version_info__ >= (0, 11) else []
    for strategy, gathers in (("fsdp", sorted(leaves + regather)), (sc.FSDP(reshard_after_forward=False), leaves)):
        report = explain(strategy)
        # Each leaf is gathered for the forward pass; the backward pass reduce-scatters each leaf's gradient;
        # nothing is gathered after the update (the parameters stay split).
        assert ops(report, "all-gather") == gathers, report
        assert ops(report, "reduce-scatter") == leaves, report
        assert ops(report, "all-reduce") == [(12, "entry")], report


@needs(4)
def test_resharding_gathers_again_what_the_backward_pass_needs_and_recomputes_nothing():
    # In the program JAX hands to XLA, resharding gathers each leaf for the forward pass and again each one the
    # backward pass needs: Dense_1's kernel (for the gradient of its input). Dense_0's kernel only meets the data,
    # and no bias is needed by any derivative. Keeping the gathered parameters gathers once. XLA:CPU in jax 0.10
    # then merges the identical gathers (it drops the rematerialisation barrier before its CSE pass), so there the
    # compiled programs gather alike (test above). No layer is recomputed: the same arithmetic either way.
    apply_fn, params, _ = init("mlp")
    counts, flops = {}, {}
    for reshard in (True, False):
        state = sc.TrainState.create(
            params=params,
            apply_fn=apply_fn,
            tx=optax.adam(1e-3),
            mesh=mesh_of(4),
            strategy=sc.FSDP(reshard_after_forward=reshard),
        )
        lowered = sc.make_train_step(loss_fn).lower(state, BATCHES["mlp"][0])
        counts[reshard] = lowered.as_text().count('"stablehlo.all_gather"')
        cost = lowered.compile().cost_analysis()
        flops[reshard] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert counts == {True: 5, False: 4}
    # (Recomputing the forward pass would add about a third: 1.006 against 0.754 GFLOP for the MNIST CNN.)
    assert flops[True] == pytest.approx(flops[False], rel=0.05)


@pytest.mark.slow
@needs(4)
def test_zero2_reduces_each_micro_batch_and_zero1_once():
    assert ops(explain("zero1"), "reduce-scatter") == ops(explain("zero2"), "reduce-scatter")
    zero1 = explain("zero1", accum_steps=4, rows=32)
    zero2 = explain("zero2", accum_steps=4, rows=32)
    assert ops(zero1, "reduce-scatter") == [(848, "entry")]
    # ZeRO-2: the first micro-batch's reduce-scatter, then one in the accumulation loop's body.
    assert ops(zero2, "reduce-scatter") == [(848, "entry"), (848, "while")]


@pytest.mark.slow
def test_param_dtype_computes_in_bf16_with_float32_master_shards():
    bf16, _ = run_ddp("mlp", 4, "adam", batches=BATCHES["mlp"], strategy=sc.FSDP(param_dtype=jnp.bfloat16))
    f32, _ = run_ddp("mlp", 4, "adam", batches=BATCHES["mlp"], strategy="fsdp")
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(bf16.params))
    assert_trees_close(bf16.full_params(), f32.full_params(), rtol=5e-2, atol=5e-3)
    assert not np.array_equal(bf16.full_params()["Dense_0"]["kernel"], f32.full_params()["Dense_0"]["kernel"])


@needs(4)
@pytest.mark.parametrize(
    "strategy,reduce_dtype,gathered,reduced",
    [
        (sc.FSDP(param_dtype=jnp.bfloat16), None, "bf16", "bf16"),
        pytest.param("fsdp", jnp.bfloat16, "f32", "bf16", marks=pytest.mark.slow),
        ("fsdp", None, "f32", "f32"),
        pytest.param("zero2", jnp.bfloat16, "f32", "bf16", marks=pytest.mark.slow),
    ],
)
def test_gathers_and_reductions_run_in_the_chosen_dtypes(strategy, reduce_dtype, gathered, reduced):
    # As handed to XLA (XLA:CPU may widen a bf16 reduction for its kernel; GPUs run it in bf16).
    apply_fn, params, _ = init("mlp")
    state = sc.TrainState.create(
        params=params, apply_fn=apply_fn, tx=optax.adam(1e-3), mesh=mesh_of(4), strategy=strategy
    )
    text = sc.make_train_step(loss_fn, reduce_dtype=reduce_dtype).lower(state, BATCHES["mlp"][0]).as_text()
    # The operand type after each op (a reduce-scatter's comes after its reduction region).
    results = lambda op: set(re.findall(rf'"stablehlo\.{op}".*?: \(tensor<(?:\d+x)+(\w+)>\) ->', text, re.S))
    assert results("reduce_scatter") == {reduced}
    assert results("all_gather") == {gathered}
    if reduce_dtype is not None:
        trained, _ = run_ddp("mlp", 4, "adam", batches=BATCHES["mlp"], strategy=strategy, reduce_dtype=reduce_dtype)
        exact, _ = run_ddp("mlp", 4, "adam", batches=BATCHES["mlp"], strategy=strategy)
        assert_trees_close(trained.full_params(), exact.full_params(), rtol=2e-2, atol=2e-3)


def test_fsdp_eval_step_and_checkpoint_resume_are_exact(tmp_path):
    apply_fn, params, model_state = init("cnn", axis_name="data")
    batches = [example_batch("cnn", 8, seed=s) for s in range(6)]

    def fresh():
        return sc.TrainState.create(
            params=params,
            model_state=model_state,
            apply_fn=apply_fn,
            tx=optax.adam(1e-2),
            mesh=mesh_of(4),
            rng=3,
            strategy="fsdp",
        )

    step = sc.make_train_step(loss_fn)
    straight, _ = sc.fit(step, fresh(), batches)
    first, _ = sc.fit(step, fresh(), batches[:3])
    sc.save_checkpoint(tmp_path, first)
    resumed, _ = sc.fit(step, sc.restore_checkpoint(tmp_path, fresh()), batches[3:])
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        loss, aux = loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)
        return {"loss": loss}

    ddp = sc.TrainState.create(
        params=straight.full_params(),
        model_state=straight.model_state,
        apply_fn=apply_fn,
        tx=optax.adam(1e-2),
        mesh=mesh_of(4),
    )
    evaluate = sc.make_eval_step(metric_fn)
    batch = sc.pad_batch(example_batch("cnn", 7, seed=11), 4)
    np.testing.assert_allclose(float(evaluate(straight, batch)["loss"]), float(evaluate(ddp, batch)["loss"]), rtol=1e-6)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def nnx_ce(model, batch, *, rng, mask):
    logits = model(batch["x"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_nnx_models_train_like_ddp(strategy):
    def run(strategy):
        model = nnx_once(lambda: NnxMLP(nnx.Rngs(0)))
        state = sc.TrainState.create_nnx(model, tx=optimizer("adam"), mesh=mesh_of(4), strategy=strategy)
        state, _ = sc.fit(sc.make_train_step(sc.nnx_loss_fn(nnx_ce)), state, BATCHES["mlp"])
        return state.full_params()

    assert_trees_close(run(strategy), run("ddp"))


@pytest.mark.parametrize(
    "source,target",
    [
        pytest.param(("fsdp", 8), ("fsdp", 4), marks=pytest.mark.slow),
        pytest.param(("fsdp", 4), ("ddp", 2), marks=pytest.mark.slow),
        pytest.param(("zero1", 4), ("fsdp", 8), marks=pytest.mark.slow),
        pytest.param(("ddp", 2), ("zero2", 8), marks=pytest.mark.slow),
    ],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
@needs(8)
def test_checkpoint_restores_onto_another_strategy_and_device_count(tmp_path, source, target):
    # A run stopped after 3 steps and resumed elsewhere reaches the parameters of a run that never stopped.
    batches = cnn_batches()
    step = sc.make_train_step(loss_fn)
    first, _ = sc.fit(step, fresh_cnn(*source), batches[:3])
    sc.save_checkpoint(tmp_path, first)
    template = fresh_cnn(*target)
    resumed = sc.restore_checkpoint(tmp_path, template)
    assert jax.tree.structure(resumed) == jax.tree.structure(template)
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(template), strict=True):
        assert got.shape == want.shape and got.sharding == want.sharding
    assert int(resumed.opt_state[0].count) == 3
    resumed, _ = sc.fit(step, resumed, batches[3:])
    straight_params, straight_model_state = uninterrupted_cnn_run()
    assert_trees_close(resumed.full_params(), straight_params)
    assert_trees_close(resumed.model_state, straight_model_state)


def cnn_batches():
    return [example_batch("cnn", 16, seed=s) for s in range(6)]


def fresh_cnn(strategy, n):
    apply_fn, params, model_state = init("cnn", axis_name="data")
    return sc.TrainState.create(
        params=params,
        model_state=model_state,
        apply_fn=apply_fn,
        tx=optax.adam(1e-2),
        mesh=mesh_of(n),
        rng=3,
        strategy=strategy,
    )


@functools.cache
def uninterrupted_cnn_run():
    """Parameters and model state after the 6 steps uninterrupted under DDP on 8 devices: the target of every
    resumed run above, trained once per file."""
    straight, _ = sc.fit(sc.make_train_step(loss_fn), fresh_cnn("ddp", 8), cnn_batches())
    return jax.device_get((straight.params, straight.model_state))
