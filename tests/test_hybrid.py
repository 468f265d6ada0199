"""Several data axes (hybrid sharding: ZeRO/FSDP split over the last data axis and replicate over the others) and
model axes (parameters split by their own specs, left to XLA inside the step) train exactly the model one device
trains on the global batch, under every strategy; explain names the axis each collective crosses; checkpoints move
between layouts.

Which cases run: every layout under FSDP, and each other strategy where it meets several data axes and a model axis
(``LAYOUT_CASES``; ZeRO-2 on the two layouts that accumulate micro-batches: with ``accum_steps=1`` it compiles to
ZeRO-1's program). The training runs, the two-process run and the checkpoint tour of four layouts are slow-tier
tests; the fast tier (``-m "not slow"``) compiles FSDP's step on replica 2 x shard 4, reads which axis each
collective crosses, and checks the layouts' state and errors.
"""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from ddp_models import assert_trees_close, mesh_of, per_device_bytes, reference_train, write_initial
from hybrid_models import Block, batches, boxed_params, loss_fn, plain_params
from jax.sharding import PartitionSpec as P

import spmdcomm as sc

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


# name: (mesh axes, data axes, partitioned parameters, padded batch, accum_steps)
LAYOUTS = {
    "hybrid_2x4": ({"replica": 2, "shard": 4}, ("replica", "shard"), False, True, 1),
    "hybrid_4x2": ({"replica": 4, "shard": 2}, ("replica", "shard"), False, False, 2),
    "data4_model2": ({"data": 4, "model": 2}, "data", True, True, 2),
    "hybrid_2x2_model2": ({"replica": 2, "shard": 2, "model": 2}, ("replica", "shard"), True, False, 1),
}


def make_tx():
    # Global-norm clipping and decoupled weight decay read the whole tree: they must see it as one device does.
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def data_size(axes, data_axes):
    return int(np.prod([axes[a] for a in ((data_axes,) if isinstance(data_axes, str) else data_axes)]))


@functools.cache
def reference(rows: int) -> tuple[dict, list[float]]:
    """Parameters and losses of 4 steps on one device on ``batches(4, rows=rows)``: every layout's target."""
    params, _, losses = reference_train(loss_fn, Block().apply, plain_params(), {}, make_tx(), batches(4, rows=rows))
    return params, losses


# FSDP, which splits parameters, gradients and optimizer state, on every layout but hybrid_4x2 (hybrid FSDP that
# accumulates runs in test_two_processes_replicas_across_processes_shards_inside_equal_one_device, and hybrid_4x2
# with ZeRO-2, which reduce-scatters each micro-batch's gradients as FSDP does); ZeRO-2 on both layouts that
# accumulate (one hybrid, one with a model axis); ZeRO-1 and DDP, whose state is whole on every data device, on the
# layout with two data axes and a model axis. Every strategy meets several data axes and a model axis.
LAYOUT_CASES = [
    pytest.param(layout, strategy, id=f"{layout}-{strategy}", marks=pytest.mark.slow)
    for layout, strategy in [
        ("hybrid_2x4", "fsdp"),
        ("data4_model2", "fsdp"),
        ("hybrid_2x2_model2", "fsdp"),
        ("hybrid_4x2", "zero2"),
        ("data4_model2", "zero2"),
        ("hybrid_2x2_model2", "zero1"),
        ("hybrid_2x2_model2", "ddp"),
    ]
]


@pytest.mark.parametrize("layout, strategy", LAYOUT_CASES)
def test_layout_equals_one_device(layout, strategy):
    axes, data_axes, partitioned, padded, accum = LAYOUTS[layout]
    params = plain_params()
    data = batches(4, rows=30 if padded else 32)
    ref_params, ref_losses = reference(30 if padded else 32)
    state = sc.TrainState.create(
        params=boxed_params() if partitioned else params,
        apply_fn=Block().apply,
        tx=make_tx(),
        mesh=sc.make_mesh(axes),
        axis=data_axes,
        strategy=strategy,
    )
    specs = {
        jax.tree_util.keystr(p): tuple(x.sharding.spec)
        for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
    }
    shard = data_axes if isinstance(data_axes, str) else data_axes[-1]
    if partitioned:
        assert "model" in specs["['q']['kernel']"] and "model" in specs["['down']['kernel']"], specs
        assert specs["['q']['bias']"][0] == "model" and "model" not in specs["['out']['bias']"], specs
    if strategy == "fsdp":
        # Split over the shard axis only: replicated over the others (hybrid), on a dimension no model axis uses.
        assert shard in specs["['up']['kernel']"], specs
        replicas = () if isinstance(data_axes, str) else data_axes[:-1]
        assert all(a not in s for s in specs.values() for a in replicas), specs
    n = data_size(axes, data_axes)
    fed = [sc.pad_batch(b, n * accum) for b in data] if padded else data
    state, history = sc.fit(sc.make_train_step(loss_fn, accum_steps=accum), state, fed)
    assert_trees_close(state.full_params(), ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    assert [int(h["examples"]) for h in history] == [len(b["y"]) for b in data]


def test_fsdp_hybrid_gathers_inside_the_shard_group_and_only_sums_across_replicas():
    mesh = sc.make_mesh({"replica": 2, "shard": 4})
    state = sc.TrainState.create(
        params=plain_params(),
        apply_fn=Block().apply,
        tx=make_tx(),
        mesh=mesh,
        axis=("replica", "shard"),
        strategy="fsdp",
    )
    report = sc.explain(sc.make_train_step(loss_fn), state, batches(1)[0])
    assert report.count("all-gather") > 0 and report.count("reduce-scatter") > 0
    for c in report.collectives:
        if c.kind in ("all-gather", "reduce-scatter"):
            assert c.axes == ("shard",), c  # never across the replica axis (the network between nodes)
    across = [c for c in report.collectives if "replica" in (c.axes or ())]
    assert across and {c.kind for c in across} == {"all-reduce"}
    # Across replicas: each device's gradient blocks (1/4 of the split leaves) and the whole leaves, once.
    layout, grads = state.layout, jax.tree.leaves(state.params)
    split = layout.is_split("grads")
    block_bytes = sum(g.nbytes // (4 if s else 1) for g, s in zip(grads, split, strict=True))
    assert (
        block_bytes <= report.total_bytes(over="replica") <= block_bytes + 128
    )  # + the step's statistics, the clip's squared norms
    assert "over each axis: replica" in str(report)


@pytest.mark.slow
def test_model_axis_collectives_are_reported_on_their_axis():
    mesh = sc.make_mesh({"data": 4, "model": 2})
    state = sc.TrainState.create(
        params=boxed_params(), apply_fn=Block().apply, tx=make_tx(), mesh=mesh, strategy="fsdp"
    )
    report = sc.explain(sc.make_train_step(loss_fn), state, batches(1)[0])
    assert report.count(over="model") > 0  # the tensor-parallel all-reduces XLA inserts
    assert report.count("all-gather", over="data") > 0 and report.count("reduce-scatter", over="data") > 0
    with pytest.raises(sc.SpmdError, match="over='replica' is not an axis"):
        report.count(over="replica")


def test_persistent_state_divides_by_shard_group_and_model_axis():
    def per_device(state):
        return per_device_bytes((state.params, state.opt_state))

    def make(params, axes, data_axes, strategy):
        return sc.TrainState.create(
            params=params, tx=optax.adam(1e-3), mesh=sc.make_mesh(axes), axis=data_axes, strategy=strategy
        )

    ddp = per_device(make(plain_params(), {"data": 8}, "data", "ddp"))
    hybrid = make(plain_params(), {"replica": 2, "shard": 4}, ("replica", "shard"), "fsdp")
    # Leaves 4 does not divide are stored padded (parameters and both moments), and Adam's count is whole.
    slack = hybrid.layout.padding_bytes("params") + hybrid.layout.padding_bytes("opt") + 4
    assert hybrid.layout.replicated_bytes() == 0  # every leaf has at least 4 elements: every leaf is split
    assert per_device(hybrid) <= ddp / 4 + slack
    tp = make(boxed_params(), {"data": 4, "model": 2}, "data", "ddp")
    split = sum(
        np.prod(s) * 4
        for s, spec in zip(tp.layout.shapes, tp.layout.param_leaf_specs, strict=True)
        if "model" in str(spec)
    )
    assert per_device(tp) == ddp - 3 * split // 2  # parameters and both moments halved where "model" splits


@pytest.mark.slow
def test_nnx_sharding_metadata_gives_the_model_axes():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(
                8, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")), rngs=rngs
            )
            self.down = nnx.Linear(
                16, 4, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None)), rngs=rngs
            )

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    def mse(model, batch, *, rng, mask):
        return sc.masked_mean(((model(batch["x"]) - batch["y"]) ** 2).sum(-1), mask)

    mesh = sc.make_mesh({"data": 4, "model": 2})
    with jax.set_mesh(mesh):
        model = Mlp(nnx.Rngs(0))
    rng = np.random.default_rng(1)
    data = [
        {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
        for _ in range(4)
    ]
    graphdef, params = nnx.split(model, nnx.Param)
    plain = jax.tree.map(np.asarray, params)
    tx = optax.adam(1e-2)
    ref, opt = plain, tx.init(plain)
    for b in data:
        loss = lambda p, b=b: ((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2).sum(-1).mean()
        updates, opt = tx.update(jax.grad(loss)(ref), opt, ref)
        ref = optax.apply_updates(ref, updates)
    state = sc.TrainState.create_nnx(model, tx=tx, mesh=mesh, strategy="fsdp")
    assert tuple(state.params["up"]["kernel"].sharding.spec) == ("data", "model")
    assert tuple(state.params["down"]["kernel"].sharding.spec) == ("model", "data")
    state, _ = sc.fit(sc.make_train_step(sc.nnx_loss_fn(mse)), state, data)
    assert_trees_close(state.full_params(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_checkpoints_restore_across_layouts(tmp_path):
    # FSDP on 8 -> hybrid FSDP 2 x 4 -> DDP on 2 -> FSDP data 4 x model 2, two steps each, equals 8 steps on one device.
    data = batches(8)
    ref_params, _, _ = reference_train(loss_fn, Block().apply, plain_params(), {}, make_tx(), data)
    layouts = [
        (mesh_of(8), "data", "fsdp", plain_params()),
        (sc.make_mesh({"replica": 2, "shard": 4}), ("replica", "shard"), "fsdp", plain_params()),
        (mesh_of(2), "data", "ddp", plain_params()),
        (sc.make_mesh({"data": 4, "model": 2}), "data", "fsdp", boxed_params()),
    ]
    step = sc.make_train_step(loss_fn)
    state = None
    for i, (mesh, axis, strategy, params) in enumerate(layouts):
        template = sc.TrainState.create(
            params=params, apply_fn=Block().apply, tx=make_tx(), mesh=mesh, axis=axis, strategy=strategy
        )
        state = template if state is None else sc.restore_checkpoint(tmp_path, template)
        assert int(state.step) == 2 * i
        state, _ = sc.fit(step, state, data[2 * i : 2 * i + 2])
        sc.save_checkpoint(tmp_path, state)
    assert_trees_close(state.full_params(), ref_params, rtol=1e-5, atol=1e-6)


def test_param_specs_tree_equals_flax_boxes():
    mesh = sc.make_mesh({"data": 4, "model": 2})
    specs = nn.get_partition_spec(boxed_params())
    given = sc.TrainState.create(params=plain_params(), tx=make_tx(), mesh=mesh, param_specs=specs, strategy="zero1")
    boxed = sc.TrainState.create(params=boxed_params(), tx=make_tx(), mesh=mesh, strategy="zero1")
    assert given.layout == boxed.layout
    # None stands for "not split" as P() does.
    none_for_whole = jax.tree.map(lambda s: None if s == P() else s, specs, is_leaf=lambda x: isinstance(x, P))
    also = sc.TrainState.create(
        params=plain_params(), tx=make_tx(), mesh=mesh, param_specs=none_for_whole, strategy="zero1"
    )
    assert also.layout == boxed.layout
    assert set(boxed.layout.param_leaf_specs) >= {P(None, "model"), P("model")}


BAD_SPECS = [
    # (spec for the q kernel, error type, facts the message must hold)
    (
        P(None, "data"),
        sc.AxisError,
        ["splits dimension 1 over 'data', a data axis", "params['q']['kernel']", "model axes ('model',)"],
    ),
    (P(None, "tensor"), sc.AxisError, ["names 'tensor', which is not an axis of the mesh", "params['q']['kernel']"]),
    (P(None, None, "model"), sc.ShapeError, ["has 3 entries but the leaf has shape (16, 16)"]),
]


@pytest.mark.parametrize("spec,error,facts", BAD_SPECS, ids=["data_axis", "unknown_axis", "too_many_entries"])
def test_bad_param_specs_raise_naming_the_leaf(spec, error, facts):
    params = plain_params()
    specs = jax.tree.map(lambda _: None, params)
    specs["q"]["kernel"] = spec
    with pytest.raises(error) as err:
        sc.TrainState.create(params=params, tx=make_tx(), mesh=sc.make_mesh({"data": 4, "model": 2}), param_specs=specs)
    for fact in facts:
        assert fact in str(err.value)


def test_param_spec_that_does_not_divide_raises():
    params = {"w": np.zeros((4, 5), np.float32)}
    mesh = sc.make_mesh({"data": 4, "model": 2})
    with pytest.raises(sc.ShapeError, match=r"splits dimension 1 of size 5 over \('model',\) \(2 devices\)"):
        sc.TrainState.create(params=params, tx=make_tx(), mesh=mesh, param_specs={"w": P(None, "model")})


def test_param_specs_of_another_structure_and_boxes_with_specs_raise():
    mesh = sc.make_mesh({"data": 4, "model": 2})
    with pytest.raises(sc.SpmdError, match="param_specs does not have the structure of params"):
        sc.TrainState.create(
            params={"w": np.zeros((4, 4), np.float32)}, tx=make_tx(), mesh=mesh, param_specs={"v": None}
        )
    with pytest.raises(sc.SpmdError, match="nn.with_partitioning.*param_specs was given too"):
        sc.TrainState.create(
            params=boxed_params(), tx=make_tx(), mesh=mesh, param_specs=jax.tree.map(lambda _: None, plain_params())
        )


@pytest.mark.parametrize("axis", [(), ("replica", "replica"), ("replica", 3)], ids=["empty", "repeated", "not_a_name"])
def test_bad_data_axes_raise(axis):
    with pytest.raises(sc.AxisError, match="must be a mesh axis name or a tuple of distinct ones"):
        sc.TrainState.create(
            params=plain_params(), tx=make_tx(), mesh=sc.make_mesh({"replica": 2, "shard": 4}), axis=axis
        )


def test_fsdp_param_dtype_casts_leaves_split_only_over_model_axes():
    # The q bias is split over "model" only (its one dimension is the model spec's): it must reach the model in
    # param_dtype like every leaf the data axis splits.
    import jax.numpy as jnp

    from spmdcomm.parallel.data.strategies import ReduceContext

    mesh = sc.make_mesh({"data": 4, "model": 2})
    strategy = sc.FSDP(param_dtype=jnp.bfloat16)
    state = sc.TrainState.create(params=boxed_params(), tx=make_tx(), mesh=mesh, strategy=strategy)
    assert tuple(state.params["q"]["bias"].sharding.spec) == ("model",)
    ctx = ReduceContext(state.data_axes, state.data_size, None, False)
    seen = []

    def model_view(params):
        seen.extend(x.dtype for x in jax.tree.leaves(strategy.compute_params(ctx, state.layout, params)))
        return jnp.zeros(())

    traced = jax.shard_map(
        model_view, mesh=mesh, in_specs=(state.layout.manual_specs("params"),), out_specs=P(), axis_names={"data"}
    )
    jax.eval_shape(traced, state.params)  # traced only: the dtypes the model would see
    assert len(seen) == len(jax.tree.leaves(state.params)) and set(seen) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_replicas_across_processes_shards_inside_equal_one_device(launch, tmp_path):
    write_initial(tmp_path, params=plain_params())
    out = launch("mp_hybrid.py", tmp_path, timeout=300)
    assert out.stdout.count("HYBRID OK") == 2  # one per process
    ref_params, ref_losses = reference(30)
    got = np.load(tmp_path / "params_fsdp.npz")
    for path, x in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(got[name], np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(np.load(tmp_path / "losses_fsdp.npy"), ref_losses, rtol=1e-5)


@pytest.mark.slow
def test_hybrid_per_example_rng_and_eval_equal_one_axis():
    # The data axes are flattened row-major, as the batch is split: per-example randomness and evaluation on
    # replica 2 x shard 4 equal those on one axis of the same 8 devices.
    def noisy_loss(params, batch, *, apply_fn, model_state, rng, mask):
        keep = jax.random.bernoulli(rng, 0.7, batch["x"].shape)
        logits = apply_fn({"params": params}, batch["x"] * keep / 0.7)
        return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask), {}

    def metric(params, batch, *, apply_fn, model_state, mask):
        return loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=None, mask=mask)[0]

    data = [sc.pad_batch(b, 8) for b in batches(3, rows=30)]
    results = []
    for mesh, axis in [(mesh_of(8), "data"), (sc.make_mesh({"replica": 2, "shard": 4}), ("replica", "shard"))]:
        state = sc.TrainState.create(
            params=plain_params(), apply_fn=Block().apply, tx=make_tx(), mesh=mesh, axis=axis, strategy="fsdp", rng=3
        )
        state, history = sc.fit(sc.make_train_step(noisy_loss, rng="per_example"), state, data)
        results.append((state.full_params(), [h["loss"] for h in history], sc.make_eval_step(metric)(state, data[0])))
    (one_axis, losses, evaluated), (hybrid, hybrid_losses, hybrid_evaluated) = results
    assert_trees_close(hybrid, one_axis, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hybrid_losses, losses, rtol=1e-5)
    np.testing.assert_allclose(float(hybrid_evaluated["loss"]), float(evaluated["loss"]), rtol=1e-5)
    assert float(hybrid_evaluated["examples"]) == 30
