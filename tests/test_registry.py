"""The parallelism registry (spmdcomm/parallel/registry.py): a parallelism registered in one line, here a test-only
toy shaped like expert parallelism, runs through TrainState.create, the roles, the train step and sc.explain without
any change to them. Its axis is recognised by its name (no keyword) or renamed by its config; it splits the batch's
rows as a data axis; its stacked leaves [E, ...] are split on dimension 0 over it by a logical name, composing with
FSDP on the other dimensions; the context it installs gives the model its axis, and a statistic of the global batch
reaches the metrics through aux. The step equals one device's."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import spmdcomm as sc
from spmdcomm.errors import describe
from spmdcomm.parallel import registry
from tests.ddp_models import assert_trees_close

EXPERTS, WIDTH, ROWS = 8, 6, 16
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("toy", default=None)


@dataclasses.dataclass(frozen=True)
class Toy:
    axis: str = "toy"
    experts: int | None = None  # when given, checked against the axis size before compiling


def check(fn, toy, mesh):
    size = int(mesh.shape[toy.axis])
    if toy.experts is not None and toy.experts % size:
        raise sc.SpmdError(describe(fn, f"{toy.experts} experts on {size} devices of {toy.axis!r}.", fix="e.g. 8."))


@contextlib.contextmanager
def toy_context(toy, roles):
    token = _ACTIVE.set(None if toy is None else (toy.axis, roles.manual))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def explain_section(state, program):
    axis = state.roles.axis("toy")
    return f"toy over {axis!r}: {sum(c.count for c in program.collectives if c.axes and axis in c.axes)} collective(s)"


TOY = registry.Parallelism(
    role="toy",
    keyword="toy",
    config=Toy,
    axis_words="the toy axis",
    example="Toy()",
    by_name="toy",
    stacks=True,
    logical="expert",
    check=check,
    step_context=toy_context,
    explain=explain_section,
)


@pytest.fixture(scope="module", autouse=True)
def registered():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_REGISTRY", list(registry.registered()))
        registry.register(TOY)  # the one line a parallelism adds
        yield


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    # Every device holds its block of the experts; the context names the axis to sum them over.
    active = _ACTIVE.get()
    experts = jnp.sum(params["experts"], axis=0)
    experts = experts if active is None else lax.psum(experts, active[0])
    loss = sc.masked_mean(jnp.mean((batch["x"] @ (params["w"] + experts)[:, None] - batch["y"]) ** 2, -1), mask)
    # A statistic of the global batch: the same on every device, so the step's mean over blocks keeps it.
    rows = jnp.sum(mask, dtype=jnp.float32) if active is None else sc.psum(jnp.sum(mask, dtype=jnp.float32), active[1])
    return loss, {"rows": rows}


def params():
    rng = np.random.default_rng(0)
    experts = rng.normal(size=(EXPERTS, WIDTH)).astype(np.float32)
    return {"experts": nn.LogicallyPartitioned(experts, ("expert", None)), "w": np.zeros(WIDTH, np.float32)}


def batch():
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32), "y": rng.normal(size=(ROWS, 1)).astype(np.float32)}


@pytest.fixture(scope="module")
def trained():
    state = sc.TrainState.create(
        params=params(), tx=optax.sgd(0.1), mesh=sc.make_mesh({"data": 2, "toy": 4}), strategy="fsdp"
    )
    step = sc.make_train_step(loss_fn, donate=False)
    return state, step, *step(state, batch())


def test_an_axis_of_its_name_runs_it_and_splits_the_rows_like_a_data_axis(trained):
    state, *_ = trained
    roles = state.roles
    assert state.configs == {"toy": Toy()} and state.parallel == (Toy(),)
    assert (roles.axis("toy"), roles.data, roles.batch, roles.manual, roles.stacked) == (
        "toy",
        ("data",),
        ("data", "toy"),
        ("data", "toy"),
        ("toy",),
    )
    assert str(roles) == "shard data=2, toy toy=4"


def test_stacked_leaves_split_on_dimension_0_over_its_axis_composing_with_fsdp(trained):
    state, *_ = trained
    assert state.params["experts"].sharding.spec == jax.sharding.PartitionSpec("toy", "data")
    assert state.params["w"].sharding.spec == jax.sharding.PartitionSpec("data")
    assert state.logical_axis_rules == (("expert", "toy"),)


def test_the_step_equals_one_device(trained):
    state, _, new, metrics = trained
    plain = {"experts": np.asarray(params()["experts"].value), "w": params()["w"]}
    data = batch()

    def reference(p):
        out = data["x"] @ (p["w"] + jnp.sum(p["experts"], axis=0))[:, None]
        return jnp.mean(jnp.mean((out - data["y"]) ** 2, -1))

    loss, grads = jax.value_and_grad(reference)(plain)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, plain, grads)
    assert_trees_close(jax.device_get(new.full_params()), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    assert float(metrics["rows"]) == ROWS and float(metrics["examples"]) == ROWS


def test_explain_shows_its_section(trained):
    state, step, *_ = trained
    report = sc.explain(step, state, batch())
    assert [str(s).split(":")[0] for s in report.sections] == ["toy over 'toy'"] and report.pipeline is None
    assert "toy over 'toy'" in str(report)


def test_a_config_renames_its_axis_and_is_checked_before_compiling():
    create = lambda mesh, **kw: sc.TrainState.create(params=params(), tx=optax.sgd(0.1), mesh=sc.make_mesh(mesh), **kw)
    assert create({"data": 2, "e": 4}, toy=Toy(axis="e")).roles.axis("toy") == "e"
    with pytest.raises(sc.SpmdError, match=r"6 experts on 4 devices of 'toy'"):
        create({"data": 2, "toy": 4}, toy=Toy(experts=6))
    with pytest.raises(sc.AxisError, match=r"the toy axis 'toy' must be a mesh axis of its own, not a data axis"):
        create({"data": 2, "toy": 4}, axis=("data", "toy"))
    with pytest.raises(sc.SpmdError, match=r"toy=3 is not a Toy.*pass Toy\(\)"):
        create({"data": 8}, toy=3)
    registered = r"\['context', 'expert', 'pipeline', 'toy'\]"
    with pytest.raises(sc.SpmdError, match=r"\['tensor'\] name no parallelism.*" + registered):
        create({"data": 8}, tensor=Toy())


def test_a_role_or_keyword_is_registered_once():
    with pytest.raises(sc.SpmdError, match=r"role 'toy' and keyword 'toy' is registered already as Toy"):
        registry.register(TOY)
