"""Every strategy keeps the model's tree: the optimizer sees what it sees on one device, so any optax recipe
(masks and labels by path or shape, global-norm clipping, LAMB, Adafactor, schedules, MultiSteps ...) trains under
DDP, ZeRO-1, ZeRO-2 and FSDP exactly the model that plain optax trains on one device on the global batch.

Which cases run: every recipe under FSDP, and under ZeRO-1 those whose optimizer state is not shaped like the
parameters (the two strategies split the tree the optimizer sees); every strategy on the recipes whose rows
accumulate micro-batches (with ``accum_steps=1`` ZeRO-2 compiles to ZeRO-1's program, and DDP hands the optimizer
the whole tree as one device does, so only the step's batch handling is at stake there). The fast tier (``-m "not
slow"``) runs global-norm clipping with a scheduled AdamW (it reads the whole tree) under FSDP, with padding and
accumulation.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ddp_models import assert_trees_close, jit_once, mesh_of, reference_train

import spmdcomm as sc

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp"]


class Net(nn.Module):
    """Dense -> LayerNorm -> Dense (128 x 128: Adafactor factors it) -> Dense(5): leaves that split over 2/4/8
    devices on dimension 0 or 1, and leaves that split nowhere (the 5-entry bias, the (128, 5) kernel's 5)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.LayerNorm()(nn.Dense(128)(x)))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(5)(x)


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["x"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask), {}


def no_decay_by_path(params):
    # The Hugging Face Flax scripts' mask: no weight decay on biases and LayerNorm parameters.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in ("bias", "scale") or "LayerNorm" in str(k) for k in path),
        params,
    )


def frozen_first_layer(params):
    return {k: "frozen" if k == "Dense_0" else "train" for k in params}


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=6)

RECIPES = {
    "adamw_mask_by_ndim": lambda: optax.adamw(
        1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
    ),
    "adamw_mask_by_path": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=no_decay_by_path),
    "multi_transform_freeze": lambda: optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, frozen_first_layer
    ),
    "clip_global_norm_adamw_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(0.05), optax.adamw(SCHEDULE, weight_decay=0.1)
    ),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "apply_if_finite_sgd": lambda: optax.apply_if_finite(optax.sgd(0.1), 3),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.1),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}

# Each recipe runs on one device count (cycling 2, 4, 8) under all four strategies; some rows pad the batch
# (30 real rows) and accumulate micro-batches.
CASES = [
    (name, n, padded, accum)
    for (name, (n, padded, accum)) in zip(
        RECIPES,
        [
            (8, False, 1),
            (4, True, 1),
            (2, False, 2),
            (8, True, 2),
            (4, False, 1),
            (2, True, 1),
            (8, False, 1),
            (4, True, 2),
            (2, False, 1),
        ],
        strict=True,
    )
]


def batches(padded, steps=4):
    rng = np.random.default_rng(0)
    rows = 30 if padded else 32
    return [
        {"x": rng.standard_normal((rows, 12)).astype(np.float32), "y": rng.integers(0, 5, rows).astype(np.int32)}
        for _ in range(steps)
    ]


@functools.cache
def init():
    """The model's apply and initial parameters (as NumPy), drawn once for every test: one compiled init (eagerly,
    each initializer compiles its own programs); every test and its reference start from these values."""
    model = Net()
    params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((2, 12), np.float32))["params"]
    return model.apply, jax.tree.map(np.asarray, params)


@functools.cache
def reference(recipe: str, padded: bool) -> tuple[dict, list[float]]:
    """Parameters and losses of plain optax on one device on ``batches(padded)``: every strategy's target."""
    apply_fn, params = init()
    ref_params, _, ref_losses = reference_train(loss_fn, apply_fn, params, {}, RECIPES[recipe](), batches(padded))
    return ref_params, ref_losses


FAST = {("clip_global_norm_adamw_schedule", "fsdp")}
# Under ZeRO-1 the optimizer meets the same split tree as under FSDP; what ZeRO-1 adds (whole parameters kept
# beside the split optimizer state) is met by the recipes whose state is not shaped like the parameters (Adafactor's
# factors, LAMB's per-leaf trust ratios, a frozen label's empty state, injected hyperparameters).
ZERO1 = {"adafactor", "lamb", "multi_transform_freeze", "inject_hyperparams"}
SLOW = pytest.mark.slow
RECIPE_CASES = [
    pytest.param(*case, strategy, id=f"{case[0]}-{strategy}", marks=() if (case[0], strategy) in FAST else SLOW)
    for case in CASES
    for strategy in STRATEGIES
    if strategy == "fsdp" or (strategy == "zero1" and case[0] in ZERO1) or case[3] > 1
]


@pytest.mark.parametrize("recipe,n,padded,accum,strategy", RECIPE_CASES)
def test_optax_recipe_equals_one_device(recipe, n, padded, accum, strategy):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    apply_fn, params = init()
    data = batches(padded)
    ref_params, ref_losses = reference(recipe, padded)
    state = sc.TrainState.create(
        params=params, apply_fn=apply_fn, tx=RECIPES[recipe](), mesh=mesh_of(n), strategy=strategy
    )
    fed = [sc.pad_batch(b, n * accum) for b in data] if padded else data
    state, history = sc.fit(sc.make_train_step(loss_fn, accum_steps=accum), state, fed)
    # The state holds the model's tree (a leaf that no dimension divides is stored padded: full_params() and the
    # optimizer see it at its own shape).
    assert jax.tree.structure(state.params) == jax.tree.structure(params)
    assert jax.tree.map(jnp.shape, state.full_params()) == jax.tree.map(np.shape, params)
    # Summation order differs from one device: Adam-like updates of near-zero gradient entries amplify float32
    # rounding a little, hence rtol 1e-4 on the few largest parameters.
    assert_trees_close(state.full_params(), ref_params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)


class Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=8)(x, x)
        return nn.Dense(5)(y.mean(axis=1))


@pytest.mark.slow
def test_checkpoint_of_other_leaf_shapes_of_the_same_sizes_raises_naming_the_leaf(tmp_path):
    x = np.zeros((2, 3, 8), np.float32)
    # Each init one compiled program (eagerly, each initializer and layer operation compiles its own).
    saved_params = jit_once(Attention(heads=2).init)(jax.random.PRNGKey(0), x)["params"]
    other_params = jit_once(Attention(heads=4).init)(jax.random.PRNGKey(0), x)["params"]
    # 2 heads of 4 features and 4 heads of 2: every leaf has the same number of entries.
    sizes = lambda p: [a.size for a in jax.tree.leaves(p)]
    assert sizes(saved_params) == sizes(other_params)
    for strategy in STRATEGIES:
        directory = tmp_path / strategy
        state = sc.TrainState.create(params=saved_params, tx=optax.adam(1e-3), mesh=mesh_of(2), strategy=strategy)
        sc.save_checkpoint(directory, state)
        template = sc.TrainState.create(params=other_params, tx=optax.adam(1e-3), mesh=mesh_of(2), strategy="fsdp")
        with pytest.raises(sc.SpmdError, match="does not match the template") as err:
            sc.restore_checkpoint(directory, template)
        text = str(err.value)
        leaf = "params.MultiHeadDotProductAttention_0.query.kernel"
        assert f"{leaf}: the checkpoint has float32[8, 2, 4], the template float32[8, 4, 2]" in text
        assert "Fix: build the template from the same model configuration" in text


def test_checkpoint_leaves_are_written_split_as_the_state_holds_them(tmp_path):
    import orbax.checkpoint as ocp

    apply_fn, params = init()
    state = sc.TrainState.create(
        params=params, apply_fn=apply_fn, tx=optax.adam(1e-3), mesh=mesh_of(4), strategy="fsdp"
    )
    sc.save_checkpoint(tmp_path, state)
    metadata = ocp.StandardCheckpointer().metadata(tmp_path / "0" / "default").item_metadata
    kernel = metadata["params"]["Dense_1"]["kernel"]
    assert tuple(kernel.shape) == (128, 128) and tuple(kernel.sharding.partition_spec) == ("data",)
    assert tuple(metadata["opt_state"][0]["mu"]["Dense_2"]["bias"].sharding.partition_spec) == ()  # 5 entries


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_resume_across_strategies_and_device_counts_with_factored_and_clipped_optimizer(tmp_path):
    # FSDP on 8 -> ZeRO-1 on 4 -> DDP on 2, each two steps, equals 6 uninterrupted steps on one device.
    apply_fn, params = init()
    data = batches(False, steps=6)
    make_tx = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adafactor(1e-2))
    ref_params, _, _ = reference_train(loss_fn, apply_fn, params, {}, make_tx(), data)
    step = sc.make_train_step(loss_fn)
    state = None
    for i, (strategy, n) in enumerate([("fsdp", 8), ("zero1", 4), ("ddp", 2)]):
        template = sc.TrainState.create(
            params=params, apply_fn=apply_fn, tx=make_tx(), mesh=mesh_of(n), strategy=strategy
        )
        state = template if state is None else sc.restore_checkpoint(tmp_path, template)
        assert int(state.step) == 2 * i
        state, _ = sc.fit(step, state, data[2 * i : 2 * i + 2])
        sc.save_checkpoint(tmp_path, state)
    assert_trees_close(state.full_params(), ref_params, rtol=1e-4, atol=1e-5)
