"""The table schedules (``sc.Pipeline(..., schedule="1f1b" | "zb-h1", repeats=v)``: 1F1B, interleaved 1F1B, ZB-H1):
the tables keep at most ``v p`` micro-batch chunks per stage and respect every dependency; the train step equals
one device, as GPipe's does, under every strategy and layout; what they do not run is refused with a clear error.
The models and references are tests/test_pipeline.py's."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdcomm as sc
from spmdcomm.parallel.pipeline import split, tables
from tests.ddp_models import assert_trees_close
from tests.test_pipeline import (
    LOSS_SCALE,
    SLOW,
    TX,
    WIDTH,
    Net,
    NormBlock,
    batches,
    init,
    init_norm,
    loss_fn,
    net_of,
    nnx_norm_run,
    nnx_one_device,
    nnx_train,
    norm_loss,
    norm_one_device,
    one_device,
    one_device_with_a_non_finite_step,
    run_with_a_non_finite_step,
    train,
    train_norm,
)


def create(layout, strategy, m, *, net=None, axis="data", schedule="1f1b", **kwargs):
    net = net_of(Net("model" in layout)) if net is None else net
    return sc.TrainState.create(
        params=init(net),
        apply_fn=net.apply,
        tx=TX,
        mesh=sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))]),
        axis=axis,
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, schedule=schedule, **kwargs),
    )


# A covering set, not a product: each schedule, strategy, model axis, padding, accumulation, dropout and mesh without
# a data axis appears at least once; the references are tests/test_pipeline.py's (one run per setting per process).
# FSDP under a table schedule: tests/test_weighted_loss.py's ZB-H1 case (with a model axis, against one device).
GRID = [
    # (schedule, v, layout, strategy, m, accum, padded, block: "" | "rms" | "dropout")
    pytest.param("1f1b", 1, {"data": 2, "stage": 2}, "ddp", 4, 1, False, "", marks=SLOW),
    # The fast tier's case. Dropout keyed by example and layer: a stage running another device's micro-batch (of
    # another chunk) draws that micro-batch's bits, with accumulation too.
    ("zb-h1", 2, {"data": 2, "stage": 2}, "ddp", 2, 2, False, "dropout"),
    pytest.param("1f1b", 2, {"data": 2, "stage": 2, "model": 2}, "zero1", 2, 1, False, "", marks=SLOW),
    pytest.param("1f1b", 2, {"data": 4, "stage": 2}, "zero2", 4, 2, True, "", marks=SLOW),
    # A block not finite at zero (RMS normalisation without epsilon): idle stages compute nothing.
    pytest.param("zb-h1", 1, {"stage": 8}, "ddp", 8, 1, False, "rms", marks=SLOW),
]


@functools.cache
def one_device_eval(padded, rms):
    """One device's eval loss on the trained reference parameters (the grid's eval step compares with it)."""
    expected, _ = one_device(29 if padded else 32, rms=rms)
    mesh = sc.make_mesh({"data": 1}, devices=jax.devices()[:1])
    one = sc.TrainState.create(params=expected, apply_fn=Net(rms=rms).apply, tx=TX, mesh=mesh)
    return float(sc.make_eval_step(eval_metric)(one, eval_batch(padded))["loss"])


def eval_metric(params, batch, *, apply_fn, model_state, mask):
    return {
        "loss": loss_fn(params, batch, apply_fn=apply_fn, model_state=model_state, rng=jax.random.key(0), mask=mask)
    }


def eval_batch(padded):
    first = batches()[0]
    return sc.pad_batch({k: v[:29] for k, v in first.items()}, 32) if padded else first


@pytest.mark.parametrize("schedule, v, layout, strategy, m, accum, padded, block", GRID, ids=str)
def test_train_step_equals_one_device(schedule, v, layout, strategy, m, accum, padded, block):
    rms, dropout, rng = block == "rms", 0.2 if block == "dropout" else 0.0, "per_example" if block else "per_device"
    expected, expected_losses = one_device(29 if padded else 32, dropout=dropout, rng=rng, rms=rms)
    net = net_of(Net("model" in layout, dropout=dropout, rms=rms))
    state = create(layout, strategy, m, net=net, schedule=schedule, repeats=v)
    data = [{k: v[:29] for k, v in b.items()} for b in batches()] if padded else batches()
    state, losses = train(state, data, rng=rng, accum=accum, pad_to=32 if padded else None)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), expected, rtol=1e-5, atol=1e-5)
    if not dropout:
        # The eval step runs the stack's forward loop (GPipe's): one device's metric on the trained parameters.
        got = sc.make_eval_step(eval_metric)(state, eval_batch(padded))["loss"]
        np.testing.assert_allclose(got, one_device_eval(padded, rms), rtol=1e-5)


@SLOW
def test_1f1b_with_loss_scaling_skips_a_non_finite_step_as_one_device():
    """Loss scaling weighs each part of a micro-batch by its share of the global batch: a NaN in one row skips
    the step on every stage, the scale backs off once, and the run is one device's."""

    want, want_seen = one_device_with_a_non_finite_step()  # shared with GPipe's test
    state = create({"data": 2, "stage": 4}, "zero2", 8)
    got, seen = run_with_a_non_finite_step(
        state.replace(loss_scale=sc.TrainState.create(params={}, tx=TX, loss_scale=LOSS_SCALE).loss_scale)
    )
    np.testing.assert_allclose(seen, want_seen, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)


@SLOW
def test_interleaved_1f1b_nnx_stack_trains_as_one_device():
    reference, expected = nnx_one_device()
    pipeline = sc.Pipeline(microbatches=4, schedule="1f1b", repeats=2)
    state, losses = nnx_train(sc.make_mesh({"data": 2, "stage": 4}), "zero2", pipeline=pipeline)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_trees_close(jax.device_get(state.full_params()), reference, rtol=1e-5, atol=1e-5)


@SLOW
def test_a_1f1b_checkpoint_resumes_under_gpipe_as_one_device(tmp_path):
    """The schedule changes nothing of the state: saved after two 1F1B steps, restored under GPipe (another
    layout), the third step gives one device's parameters."""
    expected, expected_losses = one_device(32)
    data = batches()
    state, losses = train(create({"data": 2, "stage": 2}, "ddp", 4), data[:2])  # the grid's first program
    sc.save_checkpoint(tmp_path, state)
    target = create({"data": 4, "stage": 2}, "fsdp", 2).replace(pipeline=sc.Pipeline(microbatches=2))
    restored, more = train(sc.restore_checkpoint(tmp_path, target), data[2:])
    np.testing.assert_allclose(losses + more, expected_losses, rtol=1e-5)
    assert_trees_close(jax.device_get(restored.full_params()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lockstep", [False, True], ids=["table", "lockstep"])
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("p, m, v", [(2, 2, 1), (4, 8, 1), (4, 16, 1), (2, 4, 2), (4, 8, 2), (8, 16, 2)])
def test_tables_keep_v_p_chunks_and_respect_every_dependency(kind, p, m, v, lockstep):
    """Replays a table: every stage runs each chunk of each micro-batch forward and backward once, after what it
    needs has arrived (a neighbour's output of an earlier unit, or the loss); the inbox and ring slots it reads hold
    what it needs; at most v p chunks are in flight per stage. 1F1B's bubble is GPipe's, (p - 1) / (v m + p - 1),
    in 3 (v m + p - 1) units; ZB-H1's is smaller, a third of it at m = p. A lockstep table runs one action per unit
    on every stage (the others masked), keeping up to p - 1 chunks more: 1F1B's the same bubble in 2 (v m + p - 1)
    units, stage s keeping v p + p - 1 - 2 s; ZB-H1's still below GPipe's, stage s keeping v p + p - 1 - s."""
    t = tables.table(kind, stages=p, microbatches=m, repeats=v, lockstep=lockstep)
    c, e = t.columns, t.events
    done, ring, inbox_f, inbox_b, grads = {}, {}, {}, {}, {}
    backward = tables.B if kind == "1f1b" else tables.I
    for u in range(t.units):
        sent = []
        for s in range(p):
            op, r, j = (int(c[name][u, s]) for name in ("op", "chunk", "item"))
            if op == tables.IDLE:
                continue
            if op == tables.F:
                if s == 0 and r == 0:
                    assert e["input"][u] == j and c["inbox"][u, s] == -1
                else:
                    assert inbox_f.pop((s, int(c["inbox"][u, s]))) == (j, r)
                ring[(s, int(c["res"][u, s]))] = (j, r)
                if s == p - 1 and r == v - 1:
                    assert e["loss"][u] == j
                    inbox_b[(s, int(c["recv_loss"][u, s]))] = (j, r)
                else:
                    sent.append(((s + 1, r) if s < p - 1 else (0, r + 1), "f", j))
            elif op == backward:
                assert inbox_b.pop((s, int(c["inbox"][u, s]))) == (j, r)
                assert ring[(s, int(c["res"][u, s]))] == (j, r)
                if op == tables.B:
                    del ring[(s, int(c["res"][u, s]))]
                else:
                    grads[(s, int(c["grad"][u, s]))] = (j, r)
                if s == 0 and r == 0:
                    assert e["back"][u] == j
                else:
                    sent.append(((s - 1, r) if s > 0 else (p - 1, r - 1), "b", j))
            else:
                assert op == tables.W and kind == "zb-h1"
                assert ring.pop((s, int(c["res"][u, s]))) == (j, r) == grads.pop((s, int(c["grad"][u, s])))
            assert (s, j, r, op) not in done
            done[(s, j, r, op)] = u
        for (to, chunk), way, j in sent:  # lands at the end of the unit, for the next
            inbox = inbox_f if way == "f" else inbox_b
            slot = (to, int(c["recv_f" if way == "f" else "recv_b"][u, to]))
            assert slot not in inbox
            inbox[slot] = (j, chunk)
        if lockstep:
            assert {int(o) for o in c["op"][u]} <= {tables.IDLE, int(t.kinds[u])}
        for s in range(p):
            assert sum(1 for stage, _ in ring if stage == s) <= v * p + (p - 1 if lockstep else 0)
    assert not ring and not inbox_f and not inbox_b and not grads
    assert len(done) == p * m * v * (2 if kind == "1f1b" else 3)
    gpipe = (p - 1) / (v * m + p - 1)
    if lockstep:
        keeps = [min(v * m, v * p + p - 1 - (2 if kind == "1f1b" else 1) * s) for s in range(p)]
        assert t.in_flight_per_stage == keeps
        if kind == "1f1b":
            assert t.units == 2 * (v * m + p - 1) and t.bubble == pytest.approx(gpipe)
        else:
            assert t.bubble < gpipe
        return
    assert t.in_flight == v * p and max(t.slots["res"], *t.in_flight_per_stage) == v * p
    if kind == "1f1b":
        assert t.units == 3 * (v * m + p - 1) and t.bubble == pytest.approx(gpipe)
        assert t.in_flight_per_stage == [v * p - s for s in range(p)]
    else:
        assert t.bubble < gpipe
        if m == p and v == 1:
            assert t.bubble == pytest.approx((p - 1) / (3 * m + p - 1))  # idle p - 1 units, 1F1B's 3 (p - 1)


@SLOW
def test_the_table_schedules_keep_p_micro_batches_and_recompute_nothing():
    """The compiled step's temporaries: 1F1B's ring of p micro-batches' activations (v p chunks interleaved),
    against GPipe keeping every tick's (v m + p - 1) without remat; explain reports each schedule's numbers."""
    batch = {k: np.concatenate([v] * 8) for k, v in batches()[0].items()}
    step = sc.make_train_step(loss_fn)
    layout = {"data": 2, "stage": 2}
    states = {
        "1f1b": create(layout, "ddp", 16),
        "zb-h1": create(layout, "ddp", 16, schedule="zb-h1"),
        "gpipe": create(layout, "ddp", 16).replace(pipeline=sc.Pipeline(microbatches=16, remat=False)),
    }
    reports = {name: sc.explain(step, state, batch) for name, state in states.items()}
    got = {name: r.pipeline for name, r in reports.items()}
    assert (got["1f1b"].ticks, got["1f1b"].in_flight, got["1f1b"].kept, got["1f1b"].recomputed) == (
        51,
        2,
        "every layer's activations",
        0,
    )
    assert got["1f1b"].bubble == pytest.approx(1 / 17) == got["gpipe"].bubble
    assert got["zb-h1"].in_flight == 2 and got["zb-h1"].bubble < got["1f1b"].bubble
    assert got["gpipe"].in_flight == 17
    temp = {k: r.memory.temp_bytes for k, r in reports.items()}
    # ZB-H1 also keeps the cotangents its weight gradients read until they run.
    assert temp["1f1b"] * 2.5 < temp["gpipe"] and temp["zb-h1"] < 1.25 * temp["1f1b"], temp


class EdgeNormNet(nn.Module):
    """BatchNorm (synchronised over ``axis_name``) before the stack, in its blocks and after it: the table schedules
    run the layers before and after the stack once per micro-batch."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        def norm(h):
            return sc.SyncBatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(h)

        h = sc.PipelineStack(NormBlock(self.axis_name), layers=4)(norm(nn.Dense(WIDTH, use_bias=False)(x)), train)
        # The residual keeps the first BatchNorm's bias in the loss (the normalisations would remove a shift).
        return nn.Dense(3)(h + jnp.tanh(norm(nn.Dense(WIDTH, use_bias=False)(h))))


@pytest.mark.parametrize(
    "schedule, layout, strategy, m, v, accum",
    [
        pytest.param("1f1b", {"data": 2, "stage": 2}, "ddp", 4, 1, 1, marks=SLOW),
        pytest.param("1f1b", {"data": 2, "stage": 2}, "ddp", 2, 1, 2, marks=SLOW),  # the state through the groups
        pytest.param("zb-h1", {"data": 2, "stage": 2, "model": 2}, "zero1", 2, 2, 1, marks=SLOW),
    ],
    ids=str,
)
def test_batchnorm_before_in_and_after_the_stack_equals_one_device_with_one_micro_batch_at_a_time(
    schedule, layout, strategy, m, v, accum
):
    """GPipe's rule for the stack's layers under the table schedules, and the same for the layers before and after
    it: each micro-batch normalised by its own statistics (synchronised over the data axis), the running statistics
    updated once per micro-batch, in micro-batch order (in the stack: once per forward pass of a chunk); one device
    with accum_steps=m, its micro-batch j holding every replica's micro-batch j (with accumulation: group by group)."""
    (want, want_stats), want_losses, want_error = norm_one_device(layout["data"], m, EdgeNormNet, accum=accum)
    assert set(want_stats["batch_stats"]) == {"BatchNorm_0", "BatchNorm_1", "PipelineStack_0"}
    (got, got_stats), losses, error = train_norm(
        EdgeNormNet("data"),
        sc.make_mesh(layout, devices=jax.devices()[: int(np.prod(list(layout.values())))]),
        batches(rows=16),
        accum=accum,
        strategy=strategy,
        pipeline=sc.Pipeline(microbatches=m, repeats=v, schedule=schedule),
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    assert_trees_close(got_stats, want_stats, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(error, want_error, rtol=1e-5)


@SLOW
def test_nnx_batchnorm_and_dropout_around_the_stack_under_1f1b_equal_one_device_accumulating():
    """The NNX model state under 1F1B on stage 2 (BatchStat before, in and after an sc.nnx.PipelineStack; a dropout
    stream's count moved on by the dropout before and after it): one device with accum_steps=4 on the same rows,
    the masks per example (rng="per_example"; the default per-device rng draws other masks on other devices)."""
    from flax import nnx

    def norm(rngs):
        return nnx.BatchNorm(WIDTH, momentum=0.8, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense, self.norm = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs), norm(rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.norm(self.dense(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed, self.first = nnx.Linear(5, WIDTH, use_bias=False, rngs=rngs), norm(rngs)
            self.stack = sc.nnx.PipelineStack(Block, layers=4, rngs=rngs)
            self.last, self.head = norm(rngs), nnx.Linear(WIDTH, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)

        def __call__(self, x):
            h = self.stack(self.drop(self.first(self.embed(x))))
            return self.head(h + self.drop(jnp.tanh(self.last(h))))

    one = sc.make_mesh({"data": 1}, devices=jax.devices()[:1])
    (want, want_state), want_losses = nnx_norm_run(Model, one, 4, rng="per_example")
    assert all(np.abs(want_state[k]["mean"]).max() > 0.01 for k in ("first", "last"))  # moved by training
    mesh = sc.make_mesh({"data": 1, "stage": 2}, devices=jax.devices()[:2])
    pipeline = sc.Pipeline(microbatches=4, schedule="1f1b")
    (got, got_state), losses = nnx_norm_run(Model, mesh, 1, pipeline=pipeline, rng="per_example")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    keys = lambda t: jax.tree.map(
        lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a, t
    )
    assert int(want_state["drop"]["rngs"]["count"].get_value()) == 3 * 4 * 2  # 3 steps, 4 micro-batches, 2 calls
    assert_trees_close(keys(got_state), keys(want_state), rtol=1e-5, atol=1e-5)


def test_what_the_table_schedules_do_not_run_is_refused():
    with pytest.raises(sc.SpmdError, match=r"schedule='zb' is not a schedule.*'gpipe', '1f1b', 'interleaved_1f1b'"):
        sc.Pipeline(microbatches=4, schedule="zb")
    # A loss whose model state changes tree: the check every schedule makes (before anything compiles).
    variables = init_norm(EdgeNormNet)
    state = sc.TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        apply_fn=EdgeNormNet().apply,
        tx=TX,
        mesh=sc.make_mesh({"data": 2, "stage": 2}, devices=jax.devices()[:4]),
        pipeline=sc.Pipeline(microbatches=2, schedule="1f1b"),
    )
    drops_state = lambda *a, **kw: (norm_loss(*a, **kw)[0], {"model_state": {"other": jnp.zeros(3)}})
    with pytest.raises(sc.SpmdError, match="model_state whose tree or shapes differ"):
        sc.make_train_step(drops_state)(state, batches(rows=16)[0])


def test_zb_h1_cuts_a_layers_backward_pass_so_that_nothing_runs_twice():
    """The input gradient and the weight gradient of split_backward equal jax.vjp's, and between them they run the
    backward pass's matmuls once: the weight gradient only its two ``x^T ct``."""
    mesh = jax.make_mesh((1,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    layer = lambda w, h: h + jnp.tanh(h @ w["a"]) @ w["b"]
    backward = lambda w, res, ct: jax.vjp(layer, w, res[0])[1](ct)
    rng = np.random.default_rng(3)
    w = {k: rng.normal(size=(4, 4)).astype(np.float32) for k in "ab"}
    h, ct = rng.normal(size=(2, 3, 4)).astype(np.float32)

    def local(w, h, ct):
        cut = split.split_backward(backward, w, [h], ct, axis="stage")
        g_h, kept = cut.input_grad(w, [h], ct)
        dots = lambda eqns: sum(cut.eqns[i].eqn.primitive.name == "dot_general" for i in eqns)
        # The input gradient: h @ a (the forward pass from the residual h, up to what the derivatives need), then
        # ct @ b^T and dz @ a^T; the weight gradient: tanh(h a)^T ct and h^T dz, nothing else.
        assert (dots(cut.first), dots(cut.second)) == (3, 2)
        return g_h, cut.weight_grad(kept, w, [h])

    specs = (P(), P("stage"), P("stage"))
    g_h, g_w = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P("stage"), P())))(w, h, ct)
    want_w, want_h = backward(w, [h], ct)
    np.testing.assert_allclose(g_h, want_h, rtol=1e-5, atol=1e-6)  # jit against eager: float32 round-off
    assert_trees_close(g_w, want_w, rtol=1e-5, atol=1e-6)
