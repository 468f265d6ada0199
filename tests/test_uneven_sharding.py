"""Leaves that no dimension divides: ZeRO and FSDP store them padded on one dimension (as torch FSDP2 pads uneven
shards), the model and the optimizer see their own shapes, and checkpoints hold the unpadded leaves.

One model with odd layer widths (101, 99, 103; 10 classes) throughout, compiled once per strategy and layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdcomm as sc
from tests.ddp_models import assert_trees_close, mesh_of

WIDTHS = (30, 101, 99, 103, 10)


def odd_params(seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True)):
        params[f"layer{i}"] = {
            "kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "bias": np.zeros(b, np.float32),
        }
    params["temperature"] = np.ones((), np.float32)
    return params


SHAPES = {k: np.shape(v) for k, v in jax.tree_util.tree_flatten_with_path(odd_params())[0]}


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    # The model must see every leaf at its own shape (checked while tracing).
    seen = {k: v.shape for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert seen == SHAPES, seen
    h = batch["x"]
    for i in range(len(WIDTHS) - 1):
        h = h @ params[f"layer{i}"]["kernel"] + params[f"layer{i}"]["bias"]
        h = jnp.tanh(h) if i < len(WIDTHS) - 2 else h
    logits = h * params["temperature"]
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)


def batches(steps=3, rows=13):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.normal(size=(rows, WIDTHS[0])).astype(np.float32), "y": rng.integers(0, 10, rows).astype(np.int32)}
        for _ in range(steps)
    ]


def by_ndim(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


TXS = {
    "adam": optax.adam(1e-2, eps=1e-4),  # eps: a near-zero gradient entry would amplify rounding to a full step
    # Factored second moments over the odd dimensions (rows and columns of 99 and 103 entries).
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=32),
    # Per-leaf trust ratios, a global norm and a weight-decay mask by shape: each reads the leaves' own values.
    "lamb+clip": optax.chain(
        optax.clip_by_global_norm(0.5), optax.lamb(1e-2, eps=1e-4, weight_decay=0.1, mask=by_ndim)
    ),
}


@functools.cache
def one_device(tx_name):
    state = sc.TrainState.create(params=odd_params(), tx=TXS[tx_name], mesh=mesh_of(1))
    step = sc.make_train_step(loss_fn)
    for batch in batches():
        state, _ = step(state, batch)
    return jax.device_get(state.params)


def train(state, data=None):
    step = sc.make_train_step(loss_fn)
    for batch in batches() if data is None else data:
        state, _ = step(state, sc.pad_batch(batch, state.data_size))
    return state


# Each strategy once, on 8, 4 and 2 devices (every one pads: no dimension of 99, 101 or 103 divides); Adam's
# elementwise moments are covered inside lamb+clip (scale_by_adam before the trust ratio). The fast tier trains FSDP,
# which pads parameters, gradients and optimizer state alike.
@pytest.mark.parametrize(
    "strategy, n, tx_name",
    [
        ("fsdp", 4, "adafactor"),
        pytest.param("zero1", 8, "lamb+clip", marks=pytest.mark.slow),
        pytest.param("zero2", 2, "adafactor", marks=pytest.mark.slow),
    ],
)
def test_padded_leaves_train_as_one_device(strategy, n, tx_name):
    state = sc.TrainState.create(params=odd_params(), tx=TXS[tx_name], mesh=mesh_of(n), strategy=strategy)
    split = state.layout.is_split("grads")
    # Every leaf of at least n elements is split (padded where no dimension divides); only the scalar is whole.
    assert split == tuple(np.prod(s, dtype=int) >= n for s in SHAPES.values())
    assert state.layout.pads and state.layout.padding_bytes("opt") > 0
    state = train(state)
    assert_trees_close(jax.device_get(state.full_params()), one_device(tx_name), rtol=2e-5, atol=2e-6)


def shard_bytes(tree):
    """The bytes of ``tree``'s blocks on the device that holds the most."""
    per_device = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


@pytest.mark.parametrize(
    "layout",
    [{"data": 2}, {"data": 4}, {"data": 8}, {"replica": 2, "shard": 4}, {"data": 4, "model": 2}],
)
def test_every_leaf_is_sharded_and_memory_is_ddp_over_n_plus_padding(layout):
    """Parameters + optimizer state per device <= DDP's / N + the padding the layout reports (FSDP), and the
    optimizer state <= DDP's / N + padding (ZeRO-1); the shard group is the last data axis."""
    mesh = sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))])
    axis = tuple(a for a in layout if a != "model")
    n = layout[axis[-1]]
    params = odd_params()
    # Only the input dimension (30) is even: the model axis splits it, and the data axis pads another dimension.
    specs = jax.tree.map(lambda _: None, params)
    specs["layer0"]["kernel"] = sc.P("model")
    model_specs = specs if "model" in layout else None
    tx = optax.adam(1e-3)

    def create(strategy):
        return sc.TrainState.create(
            params=params, tx=tx, mesh=mesh, axis=axis, strategy=strategy, param_specs=model_specs
        )

    ddp, zero1, fsdp = create("ddp"), create("zero1"), create("fsdp")
    ddp_bytes = shard_bytes((ddp.params, ddp.opt_state))
    fsdp_bytes = shard_bytes((fsdp.params, fsdp.opt_state))
    padding = fsdp.layout.padding_bytes("params") + fsdp.layout.padding_bytes("opt")
    scalars = 4 * 4  # the temperature, its two moments and Adam's int32 count stay whole
    assert fsdp_bytes <= ddp_bytes / n + padding + scalars, (fsdp_bytes, ddp_bytes / n, padding)
    assert fsdp_bytes < ddp_bytes / n * 1.1
    opt = shard_bytes(zero1.opt_state)
    assert opt <= shard_bytes(ddp.opt_state) / n + zero1.layout.padding_bytes("opt") + scalars
    # The leaves stored padded are exactly those no free dimension divides.
    stored = dict(zip(SHAPES, fsdp.layout.stored_shapes("params"), strict=True))
    for name, shape in SHAPES.items():
        assert stored[name] == shape or any(s % n for s in shape), name
    assert stored[next(iter(SHAPES))] != next(iter(SHAPES.values()))  # layer0/bias: 101 entries, padded


@pytest.mark.slow
def test_checkpoints_hold_unpadded_leaves_and_restore_onto_any_layout(tmp_path):
    """Saved at N = 8 under FSDP (padded to 104, 104, 16 ...), restored at N = 4, on ZeRO-1 and DDP: the same model
    and optimizer state, and training continues to the parameters of a run that never stopped."""
    data = batches(4)
    saved = train(sc.TrainState.create(params=odd_params(), tx=TXS["adam"], mesh=mesh_of(8), strategy="fsdp"), data[:2])
    sc.save_checkpoint(tmp_path, saved)
    saved_params = jax.device_get(saved.full_params())
    straight = jax.device_get(train(saved, data[2:]).full_params())
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata(tmp_path / "2" / "default").item_metadata
    assert tuple(meta["params"]["layer0"]["bias"].shape) == (101,)  # stored unpadded
    for n, strategy in [(4, "fsdp"), (2, "zero1"), (1, "ddp")]:
        template = sc.TrainState.create(params=odd_params(1), tx=TXS["adam"], mesh=mesh_of(n), strategy=strategy)
        restored = sc.restore_checkpoint(tmp_path, template)
        assert_trees_close(jax.device_get(restored.full_params()), saved_params, 0, 0)
        resumed = jax.device_get(train(restored, data[2:]).full_params())
        assert_trees_close(resumed, straight, rtol=2e-5, atol=2e-6)


def test_explain_and_the_state_report_the_padding():
    state = sc.TrainState.create(params=odd_params(), tx=TXS["adam"], mesh=mesh_of(8), strategy="fsdp")
    memory = state.memory()
    assert memory.padding == state.layout.padding_bytes("params") + state.layout.padding_bytes("opt") > 0
    assert memory.whole == 4  # the scalar temperature
    assert memory.params == shard_bytes(state.params) and memory.opt_state == shard_bytes(state.opt_state)
    report = sc.explain(sc.make_train_step(loss_fn), state, sc.pad_batch(batches(1)[0], 8))
    assert report.state == memory
    assert f"(of which padding {memory.padding} B;" in report.table()
    # Gathered once per leaf in the forward pass and reduce-scattered in the backward pass: the padded leaves
    # move as blocks like every other split leaf (no all-to-all or permute from the cut or the padding).
    assert report.count("all-to-all") == 0 and report.count("collective-permute") == 0
