"""Flax logical partitioning: parameters named by logical axes (Linen ``nn.with_logical_partitioning`` boxes, NNX
``out_sharding`` metadata) and mapped to mesh axes by rules (``logical_axis_rules=`` or the active
``nn.logical_axis_rules`` context) give the state the mesh-axis model gives, and train as one device does; the
model's own ``nn.with_logical_constraint`` calls work inside the step; a logical name with no rule raises an error
naming the leaf, the name and the rules.

One mesh (``data`` 4 x ``model`` 2); each training run compiles once per file (``functools.cache``).
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ddp_models import assert_trees_close, jit_once, reference_train
from hybrid_models import HEADS, HIDDEN, WIDTH, Block, batches, boxed_params, loss_fn, plain_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdcomm as sc

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

# MaxText-style: "embed" maps to the data axis (FSDP's job here, so it is dropped from parameter specs), heads and
# MLP features to "model"; activation names ("batch", "length") for the block's own constraints.
RULES = (
    ("batch", "data"),
    ("length", None),
    ("embed", "data"),
    ("heads", "model"),
    ("mlp", "model"),
    ("classes", None),
)
LECUN = nn.initializers.lecun_normal()
STEPS = 3


def _logical(names, base=LECUN):
    return nn.with_logical_partitioning(base, names)


class LogicalBlock(nn.Module):
    """``hybrid_models.Block`` with logical names in place of mesh axes (the same layers, names and
    initializers, so the same parameters), and logical constraints on its activations."""

    @nn.compact
    def __call__(self, x):
        bias = nn.initializers.normal(0.1)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.LayerNorm()(x)
        q, k, v = (
            nn.Dense(
                WIDTH,
                kernel_init=_logical(("embed", "heads")),
                bias_init=_logical(("heads",), bias),
                use_bias=n != "k",
                name=n,
            )(h)
            for n in "qkv"
        )
        split = lambda t: t.reshape(t.shape[:-1] + (HEADS, WIDTH // HEADS))
        scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(WIDTH // HEADS)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", attn, split(v)).reshape(x.shape)
        x = x + nn.Dense(WIDTH, kernel_init=_logical(("heads", "embed")), name="out")(mixed)
        up = nn.Dense(HIDDEN, kernel_init=_logical(("embed", "mlp")), bias_init=_logical(("mlp",), bias), name="up")
        h = nn.with_logical_constraint(nn.gelu(up(nn.LayerNorm()(x))), ("batch", "length", "mlp"))
        x = x + nn.Dense(WIDTH, kernel_init=_logical(("mlp", "embed")), name="down")(h)
        return nn.Dense(5, kernel_init=_logical(("embed", "classes")), name="head")(x.mean(axis=1))


@functools.cache
def logical_params():
    # Compiled as hybrid_models compiles Block's init, so that the two give the same values to the bit.
    return jit_once(LogicalBlock().init)(jax.random.PRNGKey(0), np.zeros((1, 6, WIDTH), np.float32))["params"]


def make_tx():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def mesh():
    return sc.make_mesh({"data": 4, "model": 2})


def specs_of(state):
    return {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}


def assert_same_shardings(state, other):
    # P(None, None) from two logical names lays a leaf out as P() does.
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(other.params)):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (jax.tree_util.keystr(path), x.sharding, y.sharding)


def create(params, strategy, apply_fn=None, **kwargs):
    return sc.TrainState.create(
        params=params, apply_fn=apply_fn, tx=make_tx(), mesh=mesh(), strategy=strategy, **kwargs
    )


@functools.cache
def reference():
    params, _, losses = reference_train(loss_fn, Block().apply, plain_params(), {}, make_tx(), batches(STEPS))
    return params, losses


@functools.cache
def trained(kind: str, strategy: str):
    """``(params, losses)`` after ``STEPS`` steps: the logical block with the rules given to create (``"given"``,
    its step run outside any rules context) or from the context around create and the step (``"context"``, the
    MaxText pattern), or the mesh-axis block (``"mesh_axes"``)."""
    step = sc.make_train_step(loss_fn)
    if kind == "mesh_axes":
        state = create(boxed_params(), strategy, Block().apply)
        state, history = sc.fit(step, state, batches(STEPS))
    elif kind == "given":
        state = create(logical_params(), strategy, LogicalBlock().apply, logical_axis_rules=RULES)
        state, history = sc.fit(step, state, batches(STEPS))
    else:
        with nn.logical_axis_rules(RULES):
            state = create(logical_params(), strategy, LogicalBlock().apply)
            state, history = sc.fit(step, state, batches(STEPS))
    return state.full_params(), [h["loss"] for h in history]


def test_logical_block_is_the_mesh_axis_block():
    assert_trees_close(nn.unbox(logical_params()), plain_params(), rtol=0, atol=0)
    boxes = jax.tree.leaves(logical_params(), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(isinstance(b, nn.LogicallyPartitioned) for b in boxes) == 10  # 7 kernels, the q, v and up biases


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_shardings_equal_the_mesh_axis_specs(strategy):
    want = create(boxed_params(), strategy)
    given = create(logical_params(), strategy, logical_axis_rules=RULES)
    assert_same_shardings(given, want)
    assert given.logical_axis_rules == RULES
    with nn.logical_axis_rules(RULES):
        in_context = create(logical_params(), strategy)
    assert_same_shardings(in_context, want)
    assert in_context.layout == given.layout
    assert in_context.logical_axis_rules == RULES  # the rules in force at create travel with the state
    if strategy == "ddp":  # "embed" -> "data" is dropped: the strategy, not the rule, splits over data
        assert specs_of(given)["['q']['kernel']"] == P(None, "model")
        assert specs_of(given)["['down']['kernel']"] == P("model", None)


# The fast tier trains FSDP, with the rules given and from the context; DDP trains in the slow tier (its state's
# shardings, from the same rules, are checked in the fast tier by test_shardings_equal_the_mesh_axis_specs).
@pytest.mark.parametrize("kind", ["given", "context"])
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_training_equals_the_mesh_axis_model_and_one_device(kind, strategy):
    params, losses = trained(kind, strategy)
    ref_params, ref_losses = reference()
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if kind == "given" and strategy == "fsdp":
        mesh_params, mesh_losses = trained("mesh_axes", strategy)
        assert_trees_close(params, mesh_params, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(losses, mesh_losses, rtol=1e-5)


def test_the_issue_case_works_inside_the_rules_context():
    # The issue: a {"data": 4, "model": 2} mesh raised "spec P('embed', 'mlp') names 'embed', which is not an axis
    # of the mesh" even inside nn.logical_axis_rules.
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, kernel_init=_logical(("embed", "mlp")))(x)

    params = Mlp().init(jax.random.PRNGKey(0), np.zeros((1, 8), np.float32))["params"]
    with nn.logical_axis_rules([("mlp", "model"), ("embed", None)]):
        state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh())
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    assert state.params["Dense_0"]["bias"].sharding.spec == P()


# Flax's mapping: rules in order; a rule takes its name's dimension when no other dimension uses its mesh axes.
MAPPING_CASES = [
    # (logical names, rules, expected spec over a {"data": 4, "model": 2} mesh with data axis "data")
    (("embed", "mlp"), [("embed", "model"), ("mlp", "model")], P("model", None)),
    (("embed", "mlp"), [("mlp", "model"), ("embed", "model")], P(None, "model")),
    (("embed", "mlp"), [("embed", None), ("mlp", "data"), ("mlp", "model")], P(None, None)),
    (("embed", "mlp"), [("embed", ("data", "model")), ("mlp", "model")], P("model", None)),
    (("layers", "mlp"), [("layers", None), ("mlp", ("model",))], P(None, "model")),
    ((None, "mlp"), [("mlp", "model")], P(None, "model")),
]


@pytest.mark.parametrize("names, rules, expected", MAPPING_CASES)
def test_mapping_follows_flax_and_drops_data_axes(names, rules, expected):
    params = {"w": nn.LogicallyPartitioned(np.zeros((8, 8), np.float32), names)}
    state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=rules)
    assert state.params["w"].sharding.spec == expected
    # Before the data axes are dropped, the assignment is Flax's own.
    flax_spec = nn.logical_to_mesh_axes(names, rules)
    dropped = [
        None if e is None else tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a != "data") or None
        for e in flax_spec
    ]
    assert P(*[d[0] if isinstance(d, tuple) and len(d) == 1 else d for d in dropped]) == expected


def test_a_box_with_its_own_rules_uses_them():
    params = {"w": nn.LogicallyPartitioned(np.zeros((8, 8), np.float32), ("embed", "mlp"), rules=(("mlp", "model"),))}
    with pytest.raises(sc.AxisError, match="'embed'.*has no rule; the rules in force: the box's own rules"):
        sc.TrainState.create(
            params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=RULES, missing_logical_rules="error"
        )
    params["w"] = params["w"].replace(rules=(("mlp", "model"), ("embed", None)))
    state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=RULES)
    assert state.params["w"].sharding.spec == P(None, "model")


def test_a_linen_logical_name_that_is_a_mesh_axis_still_needs_a_rule():
    # A logical box's names are all logical: without a rule, 'model' is a missing rule (whole, as Flax leaves it).
    params = {"w": nn.LogicallyPartitioned(np.zeros((8, 8), np.float32), ("embed", "model"))}
    with pytest.warns(sc.MissingLogicalRuleWarning, match=r"\['model'\] have no rule"):
        state = sc.TrainState.create(
            params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=[("embed", None)]
        )
    assert state.params["w"].sharding.spec == P(None, None)
    with pytest.raises(sc.AxisError, match="'model' is also a mesh axis; a logical name needs a rule even so"):
        sc.TrainState.create(
            params=params,
            tx=optax.sgd(0.1),
            mesh=mesh(),
            logical_axis_rules=[("embed", None)],
            missing_logical_rules="error",
        )
    rules = [("embed", None), ("model", "model")]
    state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=rules)
    assert state.params["w"].sharding.spec == P(None, "model")


def test_a_logical_name_without_a_rule_leaves_its_dimension_whole_as_flax_does_with_one_warning():
    """Flax's lm1b port: the attention kernels' 'kv' has no rule in the example's rules. Flax leaves the dimension
    whole; so does the state, with one warning naming every parameter, the name and the rule to add."""
    params = {
        "q": nn.LogicallyPartitioned(np.zeros((8, 16), np.float32), ("embed", "kv")),
        "up": nn.LogicallyPartitioned(np.zeros((8, 16), np.float32), ("embed", "mlp")),
        "out": nn.LogicallyPartitioned(np.zeros((16, 8), np.float32), ("kv", "embed")),
    }
    rules = [("embed", None), ("mlp", "model")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=rules)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].category is sc.MissingLogicalRuleWarning
    for fact in [
        "['kv'] have no rule",
        "params['out']: 'kv'",
        "params['q']: 'kv'",
        "[('kv', None)]",
        "('kv', 'model')",
    ]:
        assert fact in str(caught[0].message), str(caught[0].message)
    for name, leaf in params.items():
        assert state.params[name].sharding.spec == nn.logical_to_mesh_axes(leaf.names, rules), name


def test_the_missing_rule_warning_is_filtered_by_its_category():
    # A named category (as ReplicatedReductionWarning), not message text: "ignore" silences this warning alone.
    params = {"w": nn.LogicallyPartitioned(np.zeros((8, 8), np.float32), ("embed", "model"))}
    assert issubclass(sc.MissingLogicalRuleWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=sc.MissingLogicalRuleWarning)
        state = sc.TrainState.create(
            params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=[("embed", None)]
        )
    assert state.params["w"].sharding.spec == P(None, None)


def test_missing_logical_rules_takes_warn_or_error():
    with pytest.raises(sc.SpmdError, match="missing_logical_rules='raise' is not 'warn' or 'error'"):
        create(logical_params(), "ddp", logical_axis_rules=RULES, missing_logical_rules="raise")


ERROR_CASES = [
    # (rules given to create, None: the context below; the context; error; facts the message must hold)
    (
        [("embed", None)],
        None,
        sc.AxisError,
        [
            "leaf params['down']['kernel']",  # the first leaf in the tree's order that needs the missing rule
            "logical name 'mlp' (dimension 0 of ('mlp', 'embed'), from nn.with_logical_partitioning) has no rule",
            "logical_axis_rules=[('embed', None)]",
            "('mlp', None) keeps the dimension whole",
        ],
    ),
    (
        None,
        [("embed", None), ("heads", "model")],
        sc.AxisError,
        ["'mlp'", "has no rule", "the nn.logical_axis_rules context [('embed', None), ('heads', 'model')]"],
    ),
    (
        None,
        None,
        sc.AxisError,
        ["leaf params['down']['kernel']", "logical name 'mlp'", "none (logical_axis_rules was not given"],
    ),
    (
        [*RULES[:3], ("heads", "tensor"), ("mlp", "model"), ("classes", None)],
        None,
        sc.AxisError,
        [
            "leaf params['k']['kernel']",
            "'heads'",
            "maps to 'tensor'",
            "not an axis of the mesh {'data': 4, 'model': 2}",
        ],
    ),
    ([("embed", 3)], None, sc.SpmdError, ["logical_axis_rules is [('embed', 3)], not a sequence of"]),
    ({"embed": None}, None, sc.SpmdError, ["logical_axis_rules is {'embed': None}, not a sequence of"]),
]


@pytest.mark.parametrize(
    "given, context, error, facts",
    ERROR_CASES,
    ids=["no_rule", "no_rule_in_context", "no_rules_at_all", "absent_mesh_axis", "bad_target", "not_pairs"],
)
def test_errors_name_the_leaf_the_name_and_the_rules(given, context, error, facts):
    with nn.logical_axis_rules(context or ()), pytest.raises(error) as err:
        create(logical_params(), "ddp", logical_axis_rules=given, missing_logical_rules="error")
    for fact in facts:
        assert fact in str(err.value), str(err.value)


def test_a_mapped_split_that_does_not_divide_names_the_logical_names():
    params = {"w": nn.LogicallyPartitioned(np.zeros((4, 5), np.float32), ("embed", "mlp"))}
    with pytest.raises(sc.ShapeError, match=r"the logical names \('embed', 'mlp'\) mapped to P\(None, 'model'\)"):
        sc.TrainState.create(params=params, tx=optax.sgd(0.1), mesh=mesh(), logical_axis_rules=RULES[:5])


# ----- NNX ---------------------------------------------------------------------------------------------------


def nnx_mlp(names_up, names_down, **metadata):
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            init = lambda names: nnx.with_partitioning(LECUN, names, **metadata)
            self.up = nnx.Linear(8, 16, kernel_init=init(names_up), rngs=rngs)
            self.down = nnx.Linear(16, 4, kernel_init=init(names_down), rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    return Mlp(nnx.Rngs(0))


def nnx_loss(model, batch, *, rng, mask):
    return sc.masked_mean(((model(batch["x"]) - batch["y"]) ** 2).sum(-1), mask)


def nnx_data():
    rng = np.random.default_rng(1)
    return [
        {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
        for _ in range(STEPS)
    ]


def test_nnx_logical_metadata_equals_mesh_axes_and_one_device():
    from flax import nnx

    with jax.set_mesh(mesh()):
        by_mesh_axes = nnx_mlp((None, "model"), ("model", None))
        with nn.logical_axis_rules(RULES):  # NNX places variables as it creates them: it needs the rules too
            logical = nnx_mlp(("embed", "mlp"), ("mlp", "embed"))
    assert logical.up.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    want = sc.TrainState.create_nnx(by_mesh_axes, tx=optax.adam(1e-2), mesh=mesh(), strategy="fsdp")
    state = sc.TrainState.create_nnx(
        logical, tx=optax.adam(1e-2), mesh=mesh(), strategy="fsdp", logical_axis_rules=RULES
    )
    assert_same_shardings(state, want)
    assert state.params["up"]["kernel"].sharding.spec == P("data", "model")

    graphdef, params = nnx.split(logical, nnx.Param)
    ref, tx = jax.tree.map(np.asarray, params), optax.adam(1e-2)
    opt = tx.init(ref)

    @jax.jit  # one program for the reference's steps (eagerly, each of its operations compiles its own)
    def reference_step(ref, opt, b):
        loss = lambda p: ((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2).sum(-1).mean()
        updates, opt = tx.update(jax.grad(loss)(ref), opt, ref)
        return optax.apply_updates(ref, updates), opt

    for b in nnx_data():
        ref, opt = reference_step(ref, opt, b)
    state, _ = sc.fit(sc.make_train_step(sc.nnx_loss_fn(nnx_loss)), state, nnx_data())
    assert_trees_close(state.full_params(), ref, rtol=1e-5, atol=1e-6)


def create_nnx_specs(model, strategy, **kwargs):
    return specs_of(sc.TrainState.create_nnx(model, tx=optax.adam(1e-2), mesh=mesh(), strategy=strategy, **kwargs))


def test_nnx_names_without_eager_sharding_rules_from_context_and_variable():
    from flax import nnx

    with nnx.use_eager_sharding(False):
        logical = nnx_mlp(("embed", "mlp"), ("mlp", "embed"))
        own = nnx_mlp(("embed", "mlp"), ("mlp", "embed"), sharding_rules=(("mlp", None),))
        mixed = nnx_mlp(("embed", "model"), ("model", "embed"))  # a name with no rule that is a mesh axis stays
    with nn.logical_axis_rules(RULES):
        specs = create_nnx_specs(logical, "ddp")
    assert specs["['up']['kernel'].value"] == P(None, "model")
    assert create_nnx_specs(own, "ddp", logical_axis_rules=RULES)["['up']['kernel'].value"] == P(None, None)
    assert create_nnx_specs(mixed, "ddp", logical_axis_rules=RULES)["['down']['kernel'].value"] == P("model", None)
    with pytest.raises(sc.AxisError) as err:
        create_nnx_specs(logical, "ddp", logical_axis_rules=[("embed", None)], missing_logical_rules="error")
    for fact in ["leaf params['down']['kernel'].value", "'mlp'", "from NNX sharding metadata", "has no rule"]:
        assert fact in str(err.value), str(err.value)


# ----- with_logical_constraint inside the step ------------------------------------------------------------------


def test_constraints_naming_the_data_axis_trace_inside_the_step():
    # The step is manual over "data": JAX refuses a constraint naming it. The step traces the model under the
    # state's rules with their data axes dropped, even inside a context that maps "batch" to "data".
    state = create(plain_params(), "ddp", LogicalBlock().apply)
    assert state.logical_axis_rules is None
    step = sc.make_train_step(loss_fn, donate=False)
    with nn.logical_axis_rules(RULES):
        _, metrics = step(state, batches(1)[0])
    assert np.isfinite(float(metrics["loss"]))
    evaluate = sc.make_eval_step(lambda *a, **k: loss_fn(*a, rng=None, **k)[0])
    with nn.logical_axis_rules(RULES):
        assert np.isfinite(float(evaluate(state, batches(1)[0])["loss"]))


def test_constraints_reach_the_compiled_step():
    # The same model and state, its hidden activation constrained split over "model" ("mlp") or whole ("embed"):
    # the constraint is applied inside the step, so XLA moves the activations over "model" differently.
    class Constrained(nn.Module):
        names: tuple

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(64, kernel_init=_logical(("embed", "mlp")))(x.reshape(x.shape[0], -1))
            h = nn.relu(nn.with_logical_constraint(h, self.names))
            return nn.Dense(5, kernel_init=_logical(("mlp", "classes")))(h)

    params = Constrained(()).init(jax.random.PRNGKey(0), batches(1)[0]["x"])["params"]
    over_model = []
    for names in [("batch", "mlp"), ("batch", "embed")]:
        state = create(params, "ddp", Constrained(names).apply, logical_axis_rules=RULES)
        report = sc.explain(sc.make_train_step(loss_fn), state, batches(1)[0])
        over_model.append([(c.kind, c.bytes) for c in report.collectives if "model" in (c.axes or ())])
    assert over_model[0] != over_model[1], over_model


# ----- parameters that arrive placed -------------------------------------------------------------------------


def test_parameters_that_arrive_split_over_a_model_axis_keep_their_split():
    """Unboxed parameters initialised split for tensor parallelism (jax.jit(init, out_shardings=...)) keep the split
    over the state's model axis; their data-axis split is the strategy's to decide."""
    placed = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh(), P("data", "model")))
    state = sc.TrainState.create(params={"w": placed, "b": np.ones(16, np.float32)}, tx=optax.sgd(0.1), mesh=mesh())
    assert (state.params["w"].sharding.spec, state.params["b"].sharding.spec) == (P(None, "model"), P())


def test_parameters_split_over_an_axis_the_state_lacks_warn():
    other = sc.make_mesh({"data": 4, "tensor": 2})
    placed = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(other, P(None, "tensor")))
    with pytest.warns(UserWarning) as caught:
        state = sc.TrainState.create(params={"w": placed}, tx=optax.sgd(0.1), mesh=mesh())
    message = str(caught[0].message)
    for fact in ["params['w'] over ['tensor'] (P(None, 'tensor'))", "{'data': 4, 'model': 2} lacks", "param_specs="]:
        assert fact in message, message
    assert state.params["w"].sharding.spec == P()
