"""The ``expert`` mesh role (``sc.ExpertParallel``, spmdcomm/parallel/expert/layer.py): a train step of a model with
MoE layers on a mesh with an ``expert`` axis equals one device running every expert on the global batch, and the
same model on a plain ``data`` mesh does too.

One model (a dense layer, a MoE with k = 2 and a capacity that drops assignments, a dense head; the loss adds the
load-balancing loss) under DDP and FSDP on ``data 2 x expert 4``, on ``data 2 x expert 2 x model 2`` with each
expert's hidden units over ``model``, and on ``data 8``; the NNX layer on ``data 2 x expert 4``. Each state is
checked for where its expert leaves live, and the step for its new parameters, loss and the global load-balancing
loss against ``jax.value_and_grad`` on one device. Checkpoints keep the experts in their canonical order and restore
onto another expert-axis size or none. The errors come before anything compiles. Each program compiles once.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmdcomm as sc
from spmdcomm._format import format_flops
from spmdcomm.errors import AxisError, ShapeError, SpmdError
from spmdcomm.parallel.expert.report import ExpertLayer, ExpertReport, expert_report
from spmdcomm.parallel.registry import Program
from tests.ddp_models import assert_trees_close, jit_once, nnx_once

E, D, HIDDEN, ROWS, TOKENS, FEATURES = 8, 8, 16, 16, 4, 6
CAPACITY, BALANCE, LR = 1.0, 0.1, 0.1
REAL_ROWS = 13  # of ROWS in the padded cases: the last device of 8 holds padding only, the one before it half
RULES = {"model": [("embed", None), ("mlp", "model")], None: [("embed", None), ("mlp", None)]}


class Mlp(nn.Module):
    """An expert whose hidden units carry the logical name "mlp" (split over "model" by the rules that say so)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        up = nn.Dense(HIDDEN, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")), name="up")
        down = nn.Dense(D, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")), name="down")
        return down(nn.gelu(up(x)))


class Model(nn.Module):
    capacity: float | None = CAPACITY

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D)(x)
        h = h + sc.MoE(Mlp(), experts=E, k=2, capacity_factor=self.capacity)(h)
        return nn.Dense(1)(h)


MODEL = Model()


def batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROWS, TOKENS, FEATURES)).astype(np.float32)
    return {"x": x, "y": rng.standard_normal((ROWS, TOKENS, 1)).astype(np.float32)}


def balance_loss(moe_state):
    return sum(jax.tree.leaves(moe_state["MoE_0"]["load_balancing_loss"]))


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    out, found = apply_fn({"params": params}, batch["x"], mutable=["moe"])
    balance = balance_loss(found["moe"])
    return jnp.mean((out - batch["y"]) ** 2) + BALANCE * balance, {"balance": balance}


@pytest.fixture(scope="module")
def initial():
    return jax.jit(MODEL.init)(jax.random.key(0), batch()["x"][:1])["params"]  # one program, not one per op


@pytest.fixture(scope="module")
def reference(initial):
    """One device: every expert local, the global batch, one SGD step."""
    return one_device_step(initial)


def one_device_step(initial, rows=ROWS):
    """``(new parameters, loss, load-balancing loss)`` of one SGD step from ``initial`` on one device, every expert
    local, on the global batch's first ``rows`` rows (also the reference of tests/test_pipeline.py's two-process
    job, which pads ``REAL_ROWS`` of them)."""
    plain, data = nn.unbox(initial), jax.tree.map(lambda a: a[:rows], batch())

    def loss(p):
        out, found = MODEL.apply({"params": p}, data["x"], mutable=["moe"])
        balance = balance_loss(found["moe"])
        return jnp.mean((out - data["y"]) ** 2) + BALANCE * balance, balance

    new, value, balance = jax.jit(functools.partial(sgd, jax.value_and_grad(loss, has_aux=True)))(plain)
    return new, float(value), float(balance)


def sgd(value_and_grad, params):
    """``(params - LR * grads, loss, aux)``: one SGD step of a ``has_aux`` loss, to run inside one jitted program
    (the update run eagerly compiles two programs per leaf shape)."""
    (value, aux), grads = value_and_grad(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), value, aux


# name: (mesh, strategy, rules)
CASES = {
    "ddp-data2-expert4": ({"data": 2, "expert": 4}, "ddp", None),
    "fsdp-data2-expert4": ({"data": 2, "expert": 4}, "fsdp", None),
    "ddp-data2-expert2-model2": ({"data": 2, "expert": 2, "model": 2}, "ddp", "model"),
    "ddp-data8": ({"data": 8}, "ddp", None),
}
# The spec of the stacked "up" kernel [E, d, hidden] in each case.
UP_SPECS = {
    "ddp-data2-expert4": jax.P("expert", None, None),
    "fsdp-data2-expert4": jax.P("expert", "data", None),
    "ddp-data2-expert2-model2": jax.P("expert", None, "model"),
    "ddp-data8": jax.P(None, None, None),
}
_TRAINED: dict[str, tuple] = {}


def trained(case, initial):
    if case not in _TRAINED:
        mesh, strategy, rules = CASES[case]
        state = sc.TrainState.create(
            params=initial,
            tx=optax.sgd(LR),
            apply_fn=MODEL.apply,
            mesh=sc.make_mesh(mesh),
            strategy=strategy,
            logical_axis_rules=RULES[rules],
        )
        step = sc.make_train_step(loss_fn, donate=False)
        _TRAINED[case] = (state, step, *step(state, batch()))
    return _TRAINED[case]


# The fast tier runs the expert axis with DDP and FSDP and on a plain data mesh; the model axis is a slow-tier case.
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if "model" in c else c for c in sorted(CASES)]
)
def test_the_step_equals_one_device_and_the_experts_live_on_the_expert_axis(case, initial, reference):
    state, _, new, metrics = trained(case, initial)
    mesh = CASES[case][0]
    assert state.roles.axis("expert") == ("expert" if "expert" in mesh else None)
    assert state.roles.batch == tuple(a for a in ("data", "expert") if a in mesh)
    assert new.params["MoE_0"]["experts"]["up"]["kernel"].sharding.spec == UP_SPECS[case]
    assert new.params["MoE_0"]["router"].sharding.spec in (jax.P(), jax.P("data"), jax.P(None, "data"))
    want, loss, balance = reference
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [loss, balance], rtol=1e-5)


def test_explain_lists_the_moe_layers_all_to_alls_and_expert_bytes_per_device(initial):
    for case, share in (("ddp-data2-expert4", 4), ("fsdp-data2-expert4", 8)):
        state, step, *_ = trained(case, initial)
        report = sc.explain(step, state, batch())
        (section,) = report.sections
        ((path, experts, mine, whole),) = section.layers
        assert (section.axis, section.size, path, experts) == ("expert", 4, "params['MoE_0']['experts']", E)
        assert mine * share == whole == 4 * E * (D * HIDDEN + HIDDEN + HIDDEN * D + D)
        assert section.padded and section.all_to_alls >= 4 and section.all_to_all_bytes > 0
        text = str(report)
        assert "experts over 'expert' (4 devices): 1 MoE layer; all-to-alls over 'expert': " in text
        split = "" if share == 4 else ", each split 2 ways over the data axes"  # FSDP: half of 2 experts each
        assert f"params['MoE_0']['experts']: 8 experts, 2 per device{split}; parameters" in text and "padded" in text
        # Every all-to-all over the axis, forward and backward, is attributed to the one MoE layer.
        ((layer, count, sent, path, _),) = section.per_layer
        assert (layer, count, sent, path) == ("MoE_0", section.all_to_alls, section.all_to_all_bytes, "grouped")
        assert f"layer MoE_0: grouped experts (routed rows only), {count} all-to-alls over 'expert'" in text
        # Padded or ragged is read from the program, not the platform: the same program with XLA's ragged
        # all-to-all in place of the dense ones (as on a GPU) is reported ragged, its moves still counted.
        ragged = tuple(
            dataclasses.replace(c, kind="ragged-all-to-all") if c.kind == "all-to-all" else c
            for c in report.collectives
        )
        native = expert_report(state, Program(ragged, report.hlo, lambda report=report: report.work))
        assert not native.padded and (native.all_to_alls, native.per_layer) == (section.all_to_alls, section.per_layer)
        assert "ragged (bytes are bounds)" in str(native)


class TwoPaths(nn.Module):
    """A grouped MoE layer, then one on the static buffer (grouped=False), both dropless."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D)(x)
        h = h + sc.MoE(Mlp(), experts=E, k=2, capacity_factor=None)(h)
        h = h + sc.MoE(Mlp(), experts=E, k=2, capacity_factor=None, grouped=False)(h)
        return nn.Dense(1)(h)


def test_explain_says_each_moe_layers_path_and_its_experts_matmul_flops_as_counted_by_hand():
    rows, n, k = 64, 4, 2  # 32 tokens per device: tiles of 2 rows (one-row tiles' weight gradients are no matmuls)
    data = {
        "x": np.ones((rows, TOKENS, FEATURES), np.float32),
        "y": np.ones((rows, TOKENS, 1), np.float32),
    }
    model = TwoPaths()
    params = jax.jit(model.init)(jax.random.key(0), data["x"][:1])["params"]
    mesh = sc.make_mesh({"data": 2, "expert": n})
    state = sc.TrainState.create(
        params=params, tx=optax.sgd(LR), apply_fn=model.apply, mesh=mesh, logical_axis_rules=RULES[None]
    )
    report = sc.explain(sc.make_train_step(loss_fn, donate=False), state, data)
    (section,) = report.sections
    tokens, local = rows * TOKENS // 8, E // n
    # Per device, forward and backward: 3 passes (the output, the rows' gradient, the weights' gradient) of the
    # expert's 2 matmuls, 2 d HIDDEN FLOPs per row each. The grouped layer computes every tile of its static bound
    # of n T k received rows (any routing) sorted into tiles of b rows per expert, so the bound plus less than a
    # tile per expert (docs/experts.md, Costs); the buffer L B rows, B = n T dropless.
    tile = 2  # the largest power of two within T k / (16 L)
    assert tile <= tokens * k / (16 * local) < 2 * tile
    per_row = 3 * 2 * 2 * D * HIDDEN
    grouped, buffer = (n * tokens * k + local * tile) * per_row, local * n * tokens * per_row
    got = {layer.layer: (layer.path, layer.flops) for layer in section.per_layer}
    assert got == {"MoE_0": ("grouped", grouped), "MoE_1": ("buffer", buffer)}
    assert all(layer.all_to_alls == 5 for layer in section.per_layer)
    text = str(section)
    assert "layer MoE_0: grouped experts (routed rows only), 5 all-to-alls over 'expert', " in text
    assert f"per device, at most {format_flops(grouped)} per device" in text
    assert "layer MoE_1: buffered experts (a static buffer of rows per expert), 5 all-to-alls" in text
    assert text.endswith(f"per device, {format_flops(buffer)} per device")
    # A matmul that lost its metadata next to a layer's experts may be theirs: that layer's count is not given.
    lost = dataclasses.replace(report.work, unscoped_near=("TwoPaths/MoE_1/sc:MoE_1/buffered_experts/Mlp_1",))
    doubt = expert_report(state, Program(report.collectives, report.hlo, lambda: lost))
    assert [(layer.layer, layer.flops) for layer in doubt.per_layer] == [("MoE_0", grouped), ("MoE_1", None)]
    assert str(doubt).endswith("per device, matmul FLOPs unknown")
    assert isinstance(doubt.per_layer[0], ExpertLayer)


def test_a_checkpoint_keeps_the_experts_in_order_and_restores_on_another_expert_axis_or_none(initial, tmp_path):
    _, _, new, _ = trained("ddp-data2-expert4", initial)
    sc.save_checkpoint(tmp_path, new)
    full = jax.device_get(new.full_params())
    for mesh in ({"data": 4, "expert": 2}, {"data": 8}):
        template = sc.TrainState.create(
            params=initial,
            tx=optax.sgd(LR),
            apply_fn=MODEL.apply,
            mesh=sc.make_mesh(mesh),
            logical_axis_rules=RULES[None],
        )
        restored = sc.restore_checkpoint(tmp_path, template)
        want_spec = jax.P("expert", None, None) if "expert" in mesh else jax.P(None, None, None)
        assert restored.params["MoE_0"]["experts"]["up"]["kernel"].sharding.spec == want_spec
        assert_trees_close(jax.device_get(restored.full_params()), full, rtol=0, atol=0)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(D, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, D, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.head = nnx.Linear(FEATURES, D, rngs=rngs), nnx.Linear(D, 1, rngs=rngs)
        self.moe = sc.nnx.MoE(NnxMlp, experts=E, features=D, k=2, capacity_factor=CAPACITY, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        return self.head(h + self.moe(h))


def nnx_loss(model, batch, *, rng, mask):
    out, found = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, batch["x"])
    balance = found["moe"]["load_balancing_loss"].get_value()[0]
    per_row = jnp.mean((out - batch["y"]) ** 2, axis=(1, 2))
    return (jnp.mean(per_row) if mask is None else sc.masked_mean(per_row, mask)) + BALANCE * balance, {
        "balance": balance
    }


@pytest.mark.slow
def test_the_nnx_layer_in_a_step_on_data2_expert4_equals_one_device():
    """On a padded batch: the NNX layer takes the step's row mask too (one device: the real rows alone)."""
    model, data = nnx_once(lambda: NnxModel(nnx.Rngs(0))), batch()
    state = sc.TrainState.create_nnx(model, tx=optax.sgd(LR), mesh=sc.make_mesh({"data": 2, "expert": 4}))
    assert state.params["moe"]["experts"]["up"]["kernel"].sharding.spec == jax.P("expert", None, None)
    padded = sc.pad_batch(jax.tree.map(lambda a: a[:REAL_ROWS], data), 8)
    new, metrics = sc.make_train_step(sc.nnx_loss_fn(nnx_loss), donate=False)(state, padded)
    data = jax.tree.map(lambda a: a[:REAL_ROWS], data)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def reference(params):
        def loss(p):
            return nnx_loss(nnx.merge(graphdef, p, rest), data, rng=None, mask=None)

        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, aux["balance"], jax.tree.map(lambda p, g: p - LR * g, params, grads)

    value, balance, want = reference(params)
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [value, balance], rtol=1e-5)
    got = jax.tree.map(np.asarray, jax.device_get(new.full_params()))
    assert_trees_close(nnx.to_pure_dict(got), nnx.to_pure_dict(want), rtol=1e-5, atol=1e-6)
    # The router's initializer, as the Linen layer's router_init.
    layer = sc.nnx.MoE(NnxMlp, experts=2, features=D, k=1, router_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer.router[...], np.ones((D, 2), np.float32))


# ---- errors before anything compiles -----------------------------------------------------------------------------


def create(initial, mesh, **kwargs):
    return sc.TrainState.create(
        params=initial, tx=optax.sgd(LR), apply_fn=MODEL.apply, mesh=sc.make_mesh(mesh), **kwargs
    )


class SixExperts(nn.Module):
    @nn.compact
    def __call__(self, x):
        return sc.MoE(Mlp(), experts=6, k=1)(x)


def test_experts_that_do_not_divide_by_the_expert_axis_raise_at_create():
    params = jax.eval_shape(SixExperts().init, jax.random.key(0), np.ones((1, D), np.float32))["params"]
    with pytest.raises(ShapeError) as caught:
        create(params, {"data": 2, "expert": 4}, logical_axis_rules=RULES[None])
    for fact in ("params['MoE_0']['experts']", "dimension 0 of size 6 over ('expert',) (4 devices)", "multiple of 4"):
        assert fact in str(caught.value)


def test_an_expert_axis_also_named_a_data_axis_raises(initial):
    with pytest.raises(AxisError, match=r"the expert axis 'expert' must be a mesh axis of its own, not a data axis"):
        create(initial, {"data": 2, "expert": 4}, axis=("data", "expert"), logical_axis_rules=RULES[None])
    with pytest.raises(SpmdError, match=r"expert=4 is not a ExpertParallel.*pass sc.ExpertParallel\(\)"):
        create(initial, {"data": 8}, expert=4)
    with pytest.raises(SpmdError, match=r"ExpertParallel: axis=3 is not a mesh axis name"):
        sc.ExpertParallel(axis=3)


def test_a_renamed_expert_axis_runs_and_a_layer_naming_another_axis_raises_while_tracing(initial):
    state = create(initial, {"data": 2, "e": 4}, expert=sc.ExpertParallel(axis="e"), logical_axis_rules=RULES[None])
    assert state.roles.axis("expert") == "e"
    assert state.params["MoE_0"]["experts"]["up"]["kernel"].sharding.spec == jax.P("e", None, None)

    class Named(nn.Module):
        @nn.compact
        def __call__(self, x):
            return sc.MoE(Mlp(), experts=E, k=2, axis_name="expert")(nn.Dense(D)(x))

    def named_loss(params, batch, **_):
        return jnp.mean(Named().apply({"params": params}, batch["x"]) ** 2)

    params = {name: initial[name] for name in ("Dense_0", "MoE_0")}  # Named's layers are MODEL's first two
    named = create(params, {"data": 2, "e": 4}, expert=sc.ExpertParallel(axis="e"), logical_axis_rules=RULES[None])
    with pytest.raises(AxisError, match=r"axis_name='expert', but the step runs its MoE layers with axis_name='e'"):
        sc.make_train_step(named_loss, donate=False)(named, batch())


@pytest.mark.slow
def test_a_context_axis_splits_every_sequence_and_the_dropless_step_equals_one_device(initial):
    """data 2 x expert 2 x context 2: the tokens of every row are split over the context axis too; the dropless
    layer's output and its statistics are the global batch's, whatever order the devices hold the tokens in."""
    dropless = Model(capacity=None)
    data, plain = batch(), nn.unbox(initial)

    def loss_of(apply_fn):
        def loss_fn(params, batch, **_):
            out, found = apply_fn({"params": params}, batch["x"], mutable=["moe"])
            balance = balance_loss(found["moe"])
            return jnp.mean((out - batch["y"]) ** 2) + BALANCE * balance, {"balance": balance}

        return loss_fn

    mesh = {"data": 2, "expert": 2, "context": 2}
    state = create(initial, mesh, context=sc.ContextParallel(), logical_axis_rules=RULES[None])
    state = state.replace(apply_fn=dropless.apply)
    assert state.roles.manual == ("data", "expert", "context")
    new, metrics = sc.make_train_step(loss_of(dropless.apply), donate=False)(state, data)
    value_and_grad = jax.value_and_grad(lambda p: loss_of(dropless.apply)(p, data), has_aux=True)
    want, value, aux = jax.jit(functools.partial(sgd, value_and_grad))(plain)
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [value, aux["balance"]], rtol=1e-5)
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)


CONTEXT_CAPACITY = 0.5  # drops about a third of the assignments: which ones depends on the order throughout


def context_loss(params, batch, *, apply_fn, **_):
    """:func:`loss_fn`, with the layer's dropped fraction in the aux too."""
    out, found = apply_fn({"params": params}, batch["x"], mutable=["moe"])
    balance = balance_loss(found["moe"])
    dropped = sum(jax.tree.leaves(found["moe"]["MoE_0"]["dropped_fraction"]))
    return jnp.mean((out - batch["y"]) ** 2) + BALANCE * balance, {"balance": balance, "dropped": dropped}


@pytest.fixture(scope="module")
def context_reference(initial):
    """One device, the whole batch, ``Model(capacity=CONTEXT_CAPACITY)``: ``(new parameters, loss, aux)``."""
    model, data = Model(capacity=CONTEXT_CAPACITY), batch()
    value_and_grad = jax.value_and_grad(lambda p: context_loss(p, data, apply_fn=model.apply), has_aux=True)
    return jax.jit(functools.partial(sgd, value_and_grad))(nn.unbox(initial))


@pytest.mark.slow  # the fast tier checks the slots against NumPy (tests/test_moe.py)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_capacity_with_every_sequence_over_a_context_axis_drops_what_one_device_drops(
    layout, initial, context_reference
):
    """data 2 x expert 2 x context 2 with a capacity that drops assignments: the drop order is one device's on the
    unsplit batch (first choices first, then rows, then each row's positions in the original sequence order), not
    the order the devices hold the tokens in (each device holds a part of every row; in the zig-zag layout two
    chunks far apart)."""
    model = Model(capacity=CONTEXT_CAPACITY)
    mesh = {"data": 2, "expert": 2, "context": 2}
    state = create(initial, mesh, context=sc.ContextParallel(layout=layout), logical_axis_rules=RULES[None])
    new, metrics = sc.make_train_step(context_loss, donate=False)(state.replace(apply_fn=model.apply), batch())
    want, loss, aux = context_reference
    assert float(aux["dropped"]) > 0.2  # one device drops many: the order decides which
    np.testing.assert_allclose(
        [metrics["loss"], metrics["balance"], metrics["dropped"]], [loss, aux["balance"], aux["dropped"]], rtol=1e-5
    )
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)


class Flat(nn.Module):
    """``Model`` with the MoE layer given the tokens as ``[rows * tokens, d]``."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D)(x)
        h = h + sc.MoE(Mlp(), experts=E, k=2, capacity_factor=CAPACITY)(h.reshape(-1, D)).reshape(h.shape)
        return nn.Dense(1)(h)


def test_a_capacity_on_a_context_axis_raises_while_tracing_for_an_input_without_the_sequence_dimension(initial):
    state = create(initial, {"data": 4, "context": 2}, context=sc.ContextParallel(), logical_axis_rules=RULES[None])
    with pytest.raises(ShapeError, match=r"MoE: capacity_factor=1.0 in a step that splits every sequence over "):
        sc.make_train_step(loss_fn, donate=False)(state.replace(apply_fn=Flat().apply), batch())


class MoEBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + sc.MoE(Mlp(), experts=4, k=2, capacity_factor=CAPACITY)(h)


class Stacked(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(sc.PipelineStack(MoEBlock(), 2)(nn.Dense(D)(x)))


@functools.cache
def stacked_params():
    """The stack's initial parameters, for both tests that build it: one init compiled without XLA:CPU's backend
    optimisation (a quarter of the compile time; both sides of the comparison start from these values)."""
    return jit_once(Stacked().init)(jax.random.key(0), batch()["x"][:1])["params"]


def stacked_loss(params, batch, *, apply_fn, **_):
    """The task loss and the load-balancing loss of every layer of the stack, averaged over the micro-batches."""
    out, found = apply_fn({"params": params}, batch["x"], mutable=["moe"])
    per_layer = found["moe"]["PipelineStack_0"]["layers"]["MoE_0"]["load_balancing_loss"][0]  # [L, micro-batches]
    balance = jnp.sum(jnp.mean(per_layer, axis=1))
    return jnp.mean((out - batch["y"]) ** 2) + BALANCE * balance, {"balance": balance}


def masked_stacked_loss(params, batch, *, apply_fn, mask, **_):
    """:func:`stacked_loss` with the task loss over this device's real rows."""
    out, found = apply_fn({"params": params}, batch["x"], mutable=["moe"])
    per_layer = found["moe"]["PipelineStack_0"]["layers"]["MoE_0"]["load_balancing_loss"][0]  # [L, micro-batches]
    balance = jnp.sum(jnp.mean(per_layer, axis=1))
    return sc.masked_mean(jnp.mean((out - batch["y"]) ** 2, axis=(1, 2)), mask) + BALANCE * balance, {
        "balance": balance
    }


@functools.cache
def stacked_reference(padded):
    """One device accumulating the micro-batches of a ``data 2 x stage 2 x expert 2`` pipeline with m = 2: micro-batch
    i holds, in (data, expert) order, the rows of the stage-i device of each (data, expert) replica (device
    (d, s, e) holds rows block 4 d + 2 s + e), each run with its real rows alone."""
    data, params = batch(), stacked_params()
    real = np.arange(ROWS) < (REAL_ROWS if padded else ROWS)
    blocks = np.arange(ROWS).reshape(2, 2, 2, ROWS // 8)
    micro = [[r for r in blocks[:, i].reshape(-1) if real[r]] for i in range(2)]

    def loss(p):
        parts = [
            stacked_loss(p, jax.tree.map(lambda a, r=r: a[np.array(r)], data), apply_fn=Stacked().apply) for r in micro
        ]
        # The task loss is a mean over every real row; the balance a mean over the micro-batches.
        task = sum((v - BALANCE * a["balance"]) * len(r) for (v, a), r in zip(parts, micro, strict=True))
        balance = sum(a["balance"] for _, a in parts) / 2
        return task / real.sum() + BALANCE * balance, balance

    return jax.jit(functools.partial(sgd, jax.value_and_grad(loss, has_aux=True)))(nn.unbox(params))


class NnxMoEBlock(nnx.Module):
    def __init__(self, rngs):
        self.moe = sc.nnx.MoE(NnxMlp, experts=4, features=D, k=2, capacity_factor=CAPACITY, rngs=rngs)

    def __call__(self, h):
        return h + self.moe(h)


class NnxStacked(nnx.Module):
    """The NNX twin of ``Stacked``."""

    def __init__(self, rngs):
        self.embed, self.head = nnx.Linear(FEATURES, D, rngs=rngs), nnx.Linear(D, 1, rngs=rngs)
        self.stack = sc.nnx.PipelineStack(NnxMoEBlock, layers=2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.stack(self.embed(x)))


def test_an_nnx_gpipe_stack_hands_out_per_layer_and_micro_batch_what_one_device_sows():
    """The eval step on stage 2 with 2 micro-batches and 4 layers (2 per stage): the capture holds [L, m], layer l's
    value on micro-batch i (stage device i's rows) as one device's on those rows. Under 1F1B the same step."""
    stack = nnx_once(lambda: sc.nnx.PipelineStack(Sowing, layers=4, rngs=nnx.Rngs(0)))
    mesh = sc.make_mesh({"data": 1, "stage": 2}, devices=jax.devices()[:2])
    state = sc.TrainState.create_nnx(stack, tx=optax.sgd(LR), mesh=mesh, pipeline=sc.Pipeline(microbatches=2))

    def sown(model, x, *, mask):
        _, found = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, x)
        (means,) = found["layers"]["mean"].get_value()
        return {f"{layer}/{i}": means[layer, i] for layer, i in np.ndindex(means.shape)}

    x = batch()["x"][:8]
    got = sc.make_eval_step(sc.nnx_metric_fn(sown))(state, x)
    graphdef, variables = nnx.split(stack)
    want = jit_once(lambda v, xs: [sown(nnx.merge(graphdef, v), x, mask=None) for x in xs])(variables, [x[:4], x[4:]])
    for i in range(2):
        for layer in range(4):
            np.testing.assert_allclose(got[f"{layer}/{i}"], want[i][f"{layer}/0"], rtol=1e-5)

    # A table schedule hands the loss each micro-batch's values, [L, 1]: a loss that averages over dimension 1
    # trains as under GPipe.
    def loss(model, x, *, rng, mask):
        _, found = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, x)
        (means,) = found["layers"]["mean"].get_value()
        return jnp.sum(jnp.mean(means, axis=1))

    step = sc.make_train_step(sc.nnx_loss_fn(loss), donate=False)
    table = state.replace(pipeline=sc.Pipeline(microbatches=2, schedule="1f1b"))
    (gpipe_state, gpipe), (table_state, got) = step(state, x), step(table, x)
    np.testing.assert_allclose(got["loss"], gpipe["loss"], rtol=1e-5)
    assert_trees_close(jax.device_get(table_state.full_params()), jax.device_get(gpipe_state.full_params()), rtol=1e-5)


def nnx_stacked_loss(model, batch, *, rng, mask):
    """The task loss and every layer's load-balancing loss, averaged over the micro-batches, read from the capture;
    ``sc.moe_metrics`` reads the same capture."""
    out, found = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, batch["x"])
    (per_layer,) = found["stack"]["layers"]["moe"]["load_balancing_loss"].get_value()  # [L, micro-batches]
    balance = jnp.sum(jnp.mean(per_layer, axis=1))
    metrics = sc.moe_metrics(found, prefix="")
    return jnp.mean((out - batch["y"]) ** 2) + BALANCE * balance, {
        "balance": balance,
        "dropped": metrics["stack/layers/moe/dropped_fraction"],
    }


class Sowing(nnx.Module):
    """A block that sows its output's mean under ``nnx.capture`` (the default reduce: a tuple, one entry per
    call)."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(FEATURES, FEATURES, rngs=rngs)

    def __call__(self, h):
        h = jnp.tanh(self.dense(h))
        if hasattr(self, "__captures__"):  # as sc.nnx.MoE: only under nnx.capture (elsewhere sow is deprecated)
            self.sow(nnx.Intermediate, "mean", jnp.mean(h))
        return h


def test_the_nnx_stack_hands_out_what_its_blocks_sow_per_layer_under_nnx_capture():
    """Outside a step the stack is a scan: each value is [L, 1] (one micro-batch), layer l's what the block sows on
    layer l's input; each call under the same capture adds an entry, nothing of the capture stays in the model, and
    the stack runs outside a capture too."""
    stack, x = nnx_once(lambda: sc.nnx.PipelineStack(Sowing, layers=3, rngs=nnx.Rngs(0))), batch()["x"][:4]
    graphdef, variables = nnx.split(stack)

    def run(variables, x):
        stack = nnx.merge(graphdef, variables)
        (h_first, _), found = nnx.capture(lambda s, x: (s(x), s(s(x))), nnx.Intermediate)(stack, x)
        layers, h, means = nnx.split(stack.layers), x, []
        for layer in range(3):  # each block by hand, on the layer before's output
            h = nnx.merge(layers[0], jax.tree.map(lambda a, layer=layer: a[layer], layers[1])).dense(h)
            h = jnp.tanh(h)
            means.append(jnp.mean(h))
        plain = stack(x)  # no capture: nothing sown
        return h_first, found, jnp.stack(means), nnx.state(stack, nnx.Intermediate), plain

    h_first, found, means, left, plain = jit_once(run)(variables, x)
    first, second, third = found["layers"]["mean"].get_value()  # three calls: s(x), then s(s(x))
    assert first.shape == second.shape == third.shape == (3, 1)
    np.testing.assert_allclose(first[:, 0], means, rtol=1e-6)
    np.testing.assert_allclose(second, first, rtol=1e-6)  # the same input
    assert not np.allclose(third, first)  # the third call ran on the second's output
    assert jax.tree.leaves(left) == []
    np.testing.assert_allclose(plain, h_first, rtol=1e-6)


@pytest.mark.slow
def test_nnx_moe_blocks_in_a_gpipe_stack_on_data2_stage2_expert2_equal_one_device_accumulating_micro_batches():
    """The NNX twin of the Linen test above: the capture hands the loss each layer's losses per micro-batch [L, m],
    and ``sc.moe_metrics`` reads them; the step equals one device running the micro-batches in turn."""
    data = batch()
    model = nnx_once(lambda: NnxStacked(nnx.Rngs(0)))
    state = sc.TrainState.create_nnx(
        model,
        tx=optax.sgd(LR),
        mesh=sc.make_mesh({"data": 2, "stage": 2, "expert": 2}),
        pipeline=sc.Pipeline(microbatches=2),
    )
    assert state.params["stack"]["layers"]["moe"]["experts"]["up"]["kernel"].sharding.spec[:2] == ("stage", "expert")
    new, metrics = sc.make_train_step(sc.nnx_loss_fn(nnx_stacked_loss), donate=False)(state, data)
    blocks = np.arange(ROWS).reshape(2, 2, 2, ROWS // 8)  # device (d, s, e) holds rows block 4 d + 2 s + e
    micro = [blocks[:, i].reshape(-1) for i in range(2)]  # micro-batch i: its stage-i devices' blocks
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def reference(params):
        def loss(p):
            parts = [
                nnx_stacked_loss(
                    nnx.merge(graphdef, p, rest), jax.tree.map(lambda a, r=r: a[r], data), rng=None, mask=None
                )
                for r in micro
            ]
            value = sum(v for v, _ in parts) / 2  # micro-batches of equal size: the mean of their means
            aux = jax.tree.map(lambda *a: sum(a) / 2, *(a for _, a in parts))
            return value, aux

        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, aux, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    value, aux, want = reference(params)
    assert float(aux["dropped"]) > 0  # the capacity drops assignments in each micro-batch
    np.testing.assert_allclose(
        [metrics["loss"], metrics["balance"], metrics["dropped"]], [value, aux["balance"], aux["dropped"]], rtol=1e-5
    )
    got = jax.tree.map(np.asarray, jax.device_get(new.full_params()))
    assert_trees_close(nnx.to_pure_dict(got), nnx.to_pure_dict(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "schedule, padded",
    [
        pytest.param("gpipe", False, id="gpipe-full", marks=pytest.mark.slow),
        pytest.param("gpipe", True, id="gpipe-padded", marks=pytest.mark.slow),
        pytest.param("1f1b", False, id="1f1b-full", marks=pytest.mark.slow),
        pytest.param("zb-h1", False, id="zb-h1-full", marks=pytest.mark.slow),
    ],
)
def test_moe_blocks_in_a_stack_on_data2_stage2_expert2_equal_one_device_accumulating_micro_batches(schedule, padded):
    """Each layer's losses and capacity are per micro-batch, as one device accumulating the same micro-batches
    (:func:`stacked_reference`). Padded, each stage runs its micro-batch with that micro-batch's real rows (the real
    rows' capacity and losses), as one device given each micro-batch's real rows alone. The table schedules (lockstep
    on the expert axis) hand the loss each micro-batch's sown values, [L, 1]: the same numbers."""
    data = batch()
    state = sc.TrainState.create(
        params=stacked_params(),
        tx=optax.sgd(LR),
        apply_fn=Stacked().apply,
        mesh=sc.make_mesh({"data": 2, "stage": 2, "expert": 2}),
        pipeline=sc.Pipeline(microbatches=2, schedule=schedule),
        logical_axis_rules=RULES[None],
    )
    given = sc.pad_batch(jax.tree.map(lambda a: a[:REAL_ROWS], data), 8) if padded else data
    step = sc.make_train_step(masked_stacked_loss if padded else stacked_loss, donate=False)
    new, metrics = step(state, given)
    want, value, balance = stacked_reference(padded)
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [value, balance], rtol=1e-5)
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)
    if schedule == "gpipe" and not padded:
        # explain counts the stack's 2 MoE layers of 4 experts: 2 experts of 1 layer a device, 1 / (p e) of the bytes.
        (section,) = [s for s in sc.explain(step, state, given).sections if isinstance(s, ExpertReport)]
        path = "params['PipelineStack_0']['layers']['MoE_0']['experts']"
        whole = sum(a.nbytes for a in jax.tree.leaves(state.params["PipelineStack_0"]["layers"]["MoE_0"]["experts"]))
        assert (section.layers, section.stacked) == (((path, 4, whole // 4, whole),), ((path, 2, 2),))
        assert "2 MoE layers" in str(section) and "1 layer of 2 experts per device" in str(section)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, third", [(s, t) for t in ("model", "context") for s in ("gpipe", "1f1b", "zb-h1")])
def test_moe_blocks_on_stage2_expert2_and_model_or_context_equal_one_device_accumulating_micro_batches(schedule, third):
    """No data axis: device (s, e, .) holds rows block 2 s + e, so micro-batch i is blocks 2 i and 2 i + 1; one device
    accumulating those two micro-batches. With a model axis the experts' MLPs are split over it too
    (``RULES["model"]``); with a context axis every sequence is (the capacity drops in one device's token order)."""
    data = batch()
    state = sc.TrainState.create(
        params=stacked_params(),
        tx=optax.sgd(LR),
        apply_fn=Stacked().apply,
        mesh=sc.make_mesh({"stage": 2, "expert": 2, third: 2}),
        pipeline=sc.Pipeline(microbatches=2, schedule=schedule),
        logical_axis_rules=RULES["model" if third == "model" else None],
        **({"context": sc.ContextParallel()} if third == "context" else {}),
    )
    up = state.params["PipelineStack_0"]["layers"]["MoE_0"]["experts"]["up"]["kernel"]
    assert tuple(up.sharding.spec)[:2] == ("stage", "expert") and ("model" in tuple(up.sharding.spec)) == (
        third == "model"
    )
    new, metrics = sc.make_train_step(stacked_loss, donate=False)(state, data)
    want, value, balance = model_axis_reference()
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [value, balance], rtol=1e-5)
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)


@functools.cache
def model_axis_reference():
    data, half = batch(), ROWS // 2

    def loss(p):
        parts = [
            stacked_loss(p, jax.tree.map(lambda a, i=i: a[i * half : (i + 1) * half], data), apply_fn=Stacked().apply)
            for i in range(2)
        ]
        value = sum(v for v, _ in parts) / 2
        balance = sum(a["balance"] for _, a in parts) / 2
        return value, balance

    return jax.jit(functools.partial(sgd, jax.value_and_grad(loss, has_aux=True)))(nn.unbox(stacked_params()))


@pytest.mark.slow
def test_a_padded_batch_accumulated_in_two_micro_batches_equals_one_device_on_each_ones_real_rows(initial):
    """accum_steps=2: each micro-batch's MoE runs on its real rows (capacity, losses), as one device accumulating
    the same micro-batches given their real rows alone: micro-batch j holds row j of every device's two rows."""
    state, *_ = trained("ddp-data2-expert4", initial)
    padded = sc.pad_batch(jax.tree.map(lambda a: a[:REAL_ROWS], batch()), 8)
    new, metrics = sc.make_train_step(masked_loss_fn, accum_steps=2, donate=False)(state, padded)
    micro = [[r for r in range(j, ROWS, 2) if r < REAL_ROWS] for j in range(2)]
    data = batch()

    def loss(p):
        task, balance = 0.0, 0.0
        for rows in micro:
            part = jax.tree.map(lambda a, rows=rows: a[np.array(rows)], data)
            out, found = MODEL.apply({"params": p}, part["x"], mutable=["moe"])
            task += jnp.sum(jnp.mean((out - part["y"]) ** 2, axis=(1, 2)))
            balance += balance_loss(found["moe"]) * len(rows)  # a metric weighted by the micro-batch's rows
        return task / REAL_ROWS + BALANCE * balance / REAL_ROWS, balance / REAL_ROWS

    want, value, balance = jax.jit(functools.partial(sgd, jax.value_and_grad(loss, has_aux=True)))(nn.unbox(initial))
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [value, balance], rtol=1e-5)
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)


# The expert axis across two processes: tests/test_pipeline.py's two-process job (tests/workers/mp_pipeline.py).


def masked_loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    """``loss_fn`` with the task loss over this device's real rows (what a padded batch needs)."""
    out, found = apply_fn({"params": params}, batch["x"], mutable=["moe"])
    balance = balance_loss(found["moe"])
    per_row = jnp.mean((out - batch["y"]) ** 2, axis=(1, 2))
    return sc.masked_mean(per_row, mask) + BALANCE * balance, {"balance": balance, **sc.moe_metrics(found["moe"])}


@pytest.mark.slow  # the fast tier keeps the masked layer's cases of tests/test_moe.py
def test_a_padded_batch_trains_and_evaluates_as_one_device_on_the_real_rows_alone(initial):
    """The MoE layers take the step's row mask: padding rows are not routed, take no capacity slot (the real rows'
    capacity is smaller than the padded batch's) and count in no loss; the train and eval steps equal one device
    given the real rows alone. A model that moves the rows off dimension 0 must pass the layer its own mask."""
    state, *_ = trained("ddp-data2-expert4", initial)
    padded = sc.pad_batch(jax.tree.map(lambda a: a[:REAL_ROWS], batch()), 8)
    assert padded.mask.shape == (ROWS,) and int(padded.mask.sum()) == REAL_ROWS
    new, metrics = sc.make_train_step(masked_loss_fn, donate=False)(state, padded)
    evaluate = sc.make_eval_step(lambda p, b, **kw: masked_loss_fn(p, b, rng=None, **kw)[1])
    evaluated = evaluate(state, padded)
    want, value, balance = one_device_step(initial, REAL_ROWS)
    np.testing.assert_allclose([metrics["loss"], metrics["balance"]], [value, balance], rtol=1e-5)
    np.testing.assert_allclose(evaluated["balance"], balance, rtol=1e-5)
    # The layer's statistics as scalar metrics: the real tokens' assignments, k = 2 each, none of the padding's.
    counts = [metrics[f"moe/MoE_0/expert_counts/{j}"] for j in range(E)]
    assert sum(counts) == 2 * REAL_ROWS * TOKENS and evaluated["moe/MoE_0/expert_counts/0"] == counts[0]
    assert 0 < metrics["moe/MoE_0/dropped_fraction"] < 1
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)

    def flattened_loss(params, batch, *, apply_fn, mask, **_):
        rows = batch["x"].reshape(-1, 1, FEATURES)  # tokens as rows: the layer cannot match them to the mask
        return jnp.mean(apply_fn({"params": params}, rows, mutable=["moe"])[0])

    with pytest.raises(SpmdError) as caught:
        sc.make_train_step(flattened_loss, donate=False)(state, padded)
    for fact in ["the step's batch is masked", "input (8, 1, 8)", "(2 rows)", "pass the layer mask="]:
        assert fact in str(caught.value)
