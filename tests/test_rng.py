"""Device-count independent randomness: per-example keys and make_train_step(rng="per_example").

The device-count sweep trains on 1 and 8 devices and accumulates on 4 devices (2 micro-batches, so that every row's
key offset has a device and a micro-batch part): 2 devices, accumulation on 1 device, or 4 micro-batches on 2 would
take no other path (2 devices also run in the resume test, whose first two steps there continue on 4 devices to the
parameters of 1 device). The fast tier (``-m "not slow"``) checks the keys themselves
(float32 draws) and the step's per-example keys; the training runs and the other dtypes are slow.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmdcomm as sc
from spmdcomm.parallel.rng import is_per_example_key, per_example_key, stream_key_for_call

GLOBAL = 16
STEPS = 5


def mesh_of(n):
    return sc.data_mesh(devices=jax.devices()[:n])


def batches(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.standard_normal((GLOBAL, 6), dtype=np.float32), "y": rng.standard_normal(GLOBAL, dtype=np.float32)}
        for _ in range(steps)
    ]


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        x = nn.Dropout(0.25, deterministic=not train)(nn.Dense(8)(x))  # a second layer: a second fold_in
        return nn.Dense(1)(x)[:, 0]


def linen_loss(params, batch, *, apply_fn, model_state, rng, mask):
    pred = apply_fn({"params": params}, batch["x"], rngs={"dropout": rng})
    return sc.masked_mean((pred - batch["y"]) ** 2, mask)


class NnxDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)
        self.rngs = rngs  # the "noise" stream, drawn in the forward pass

    def __call__(self, x):
        h = self.drop(nnx.relu(self.l1(x)))
        h = h + 0.1 * self.rngs.noise.normal(h.shape)
        return self.l2(h)[:, 0]


def nnx_mse(model, batch, *, rng, mask):
    return sc.masked_mean((model(batch["x"]) - batch["y"]) ** 2, mask)


def make_state(kind, mesh):
    if kind == "linen":
        model = LinenDropout()
        params = model.init(jax.random.key(0), np.zeros((1, 6), np.float32), train=False)["params"]
        return sc.TrainState.create(params=params, apply_fn=model.apply, tx=optax.sgd(0.05), rng=7, mesh=mesh)
    model = NnxDropout(nnx.Rngs(params=0, dropout=1, noise=2))
    return sc.TrainState.create_nnx(model, tx=optax.sgd(0.05), rng=7, mesh=mesh)


def train(kind, n, data, *, accum_steps=1, rng="per_example", state=None):
    mesh = mesh_of(n)
    state = make_state(kind, mesh) if state is None else state
    loss = linen_loss if kind == "linen" else sc.nnx_loss_fn(nnx_mse)
    step = sc.make_train_step(loss, accum_steps=accum_steps, rng=rng)
    state, history = sc.fit(step, state, data)
    sc.assert_replicated(state)
    return state, history


@functools.cache
def one_device(kind):
    """``train(kind, 1, batches())``: the one-device run both the device-count sweep and the resume compare with."""
    return train(kind, 1, batches())


def host(tree):
    """Every leaf as NumPy (typed keys as their key data)."""
    as_data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return [np.asarray(jax.device_get(as_data(x))) for x in jax.tree.leaves(tree)]


def assert_close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(host(a), host(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------------
# The key itself


@pytest.mark.parametrize(
    "dtype",
    [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow), pytest.param(jnp.uint8, marks=pytest.mark.slow)],
)
def test_blocks_of_a_global_draw_equal_the_whole_draw(dtype):
    base = jax.random.PRNGKey(3)
    draw = jax.random.bits if dtype == jnp.uint8 else jax.random.uniform
    whole = draw(per_example_key(base, offset=0, rows=12), (12, 5), dtype)
    for offset, rows in [(0, 4), (4, 4), (8, 4), (6, 6), (11, 1)]:
        key = per_example_key(base, offset=offset, rows=rows)
        np.testing.assert_array_equal(draw(key, (rows, 5), dtype), whole[offset : offset + rows])
    # fold_in and split act on the threefry part and keep the row offset.
    normal = lambda offset, rows: jax.random.normal(
        jax.random.fold_in(per_example_key(base, offset=offset, rows=rows), 9), (rows, 2)
    )
    np.testing.assert_array_equal(np.concatenate([normal(0, 6), normal(6, 6)]), normal(0, 12))
    a, b = jax.random.split(per_example_key(base, offset=2, rows=2))
    assert is_per_example_key(a) and int(jax.random.key_data(b)[2]) == 2
    assert not bool(jnp.all(jax.random.bits(a, (2, 3)) == jax.random.bits(b, (2, 3))))


def test_rows_depend_only_on_their_global_index():
    base = jax.random.PRNGKey(0)
    key = per_example_key(base, offset=5, rows=3)
    for r in range(3):
        one = per_example_key(base, offset=5 + r, rows=1)
        np.testing.assert_array_equal(
            jax.random.bernoulli(key, 0.5, (3, 7))[r], jax.random.bernoulli(one, 0.5, (1, 7))[0]
        )
    # Different offsets give different bits; the seed changes everything.
    shifted = per_example_key(base, offset=6, rows=3)
    assert not np.array_equal(jax.random.bits(key, (3, 4)), jax.random.bits(shifted, (3, 4)))
    other = per_example_key(jax.random.PRNGKey(1), offset=5, rows=3)
    assert not np.array_equal(jax.random.bits(key, (3, 4)), jax.random.bits(other, (3, 4)))


@pytest.mark.parametrize("shape", [(), (4,), (1, 4), (6, 4)], ids=str)
def test_a_draw_without_the_examples_in_dimension_0_raises(shape):
    key = per_example_key(jax.random.PRNGKey(0), offset=0, rows=3)
    with pytest.raises(sc.ShapeError, match=r"draw of shape .* block of 3 examples: dimension 0 .*rng='per_device'"):
        jax.random.uniform(key, shape)


def test_stream_key_for_call():
    stream = jax.random.key(11)
    raw = jax.random.PRNGKey(4)
    per_device = stream_key_for_call(stream, raw)
    assert per_device.dtype == stream.dtype and not np.array_equal(
        jax.random.key_data(per_device), jax.random.key_data(stream)
    )
    key = per_example_key(raw, offset=8, rows=2)
    per_example = stream_key_for_call(stream, key)
    assert is_per_example_key(per_example) and int(jax.random.key_data(per_example)[2]) == 8
    # Split streams (a batch of keys) are handled entry by entry.
    assert stream_key_for_call(jax.random.split(stream, 3), key).shape == (3,)
    with pytest.raises(sc.SpmdError, match="threefry"):
        stream_key_for_call(jax.random.key(0, impl="rbg"), key)


# --------------------------------------------------------------------------------------------------
# The step


def test_rng_option_is_checked():
    with pytest.raises(sc.SpmdError, match=r"rng='per_rank' is not one of \('per_device', 'per_example'\)"):
        sc.make_train_step(linen_loss, rng="per_rank")


def test_loss_fn_gets_a_per_example_key_with_global_offsets():
    seen = {}

    def probe(params, batch, *, apply_fn, model_state, rng, mask):
        # Each row's first uniform draw, returned through the (float) loss as a row-indexed code.
        u = jax.random.uniform(rng, (mask.shape[0],))
        seen["per_example"] = is_per_example_key(rng)
        return sc.masked_mean(params["w"] * u * batch, mask)

    data = np.ones(GLOBAL, np.float32)
    out = []
    for n, k in [(1, 1), (4, 1), (2, 2)]:
        mesh = mesh_of(n)
        state = sc.TrainState.create(params={"w": np.float32(1.0)}, tx=optax.sgd(1.0), rng=3, mesh=mesh)
        step = sc.make_train_step(probe, accum_steps=k, rng="per_example")
        _, metrics = step(state, data)
        out.append(float(metrics["loss"]))
    assert seen["per_example"]
    np.testing.assert_allclose(out, out[0], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_same_parameters_on_1_4_8_devices_and_with_accumulation(kind):
    data = batches()
    ref, ref_history = one_device(kind)
    for n, k in [(8, 1), (4, 2)]:
        state, history = train(kind, n, data, accum_steps=k)
        assert_close(state.params, ref.params)
        np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in ref_history], rtol=2e-5)
    # The dropout is real: the model trains differently without it (and the masks are not all-ones).
    assert ref_history[0]["loss"] != pytest.approx(ref_history[1]["loss"])


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_default_per_device_keys_depend_on_the_device_count(kind):
    data = batches(2)
    one, _ = train(kind, 1, data, rng="per_device")
    two, _ = train(kind, 2, data, rng="per_device")
    assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(host(one.params), host(two.params), strict=True))


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_a_draw_broadcast_over_the_batch_raises_when_the_step_compiles():
    class Broadcast(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, broadcast_dims=(0,), deterministic=False)(nn.Dense(1)(x))[:, 0]

    model = Broadcast()
    params = model.init(jax.random.key(0), np.zeros((1, 6), np.float32))["params"]
    state = sc.TrainState.create(params=params, apply_fn=model.apply, tx=optax.sgd(0.1), mesh=mesh_of(2))
    step = sc.make_train_step(linen_loss, rng="per_example")
    with pytest.raises(sc.ShapeError, match=r"draw of shape \(1, 1\) from a per-example key of a block of 8"):
        step(state, batches(1)[0])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_resume_on_another_device_count_continues_the_same_stream(kind, tmp_path):
    data = batches()
    uninterrupted, _ = one_device(kind)
    first, _ = train(kind, 2, data[:2])
    sc.save_checkpoint(tmp_path, first)
    template = make_state(kind, mesh_of(4))
    resumed = sc.restore_checkpoint(tmp_path, template)
    assert int(resumed.step) == 2
    resumed, _ = train(kind, 4, data[2:], state=resumed)
    assert_close(resumed.params, uninterrupted.params)
    # Keys and counts (NNX) are state: identical after the resume.
    for a, b in zip(host(resumed.model_state), host(uninterrupted.model_state), strict=True):
        np.testing.assert_array_equal(a, b)
