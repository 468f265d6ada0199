"""Expert parallelism: ``sc.ragged_all_to_all`` and the mixture-of-experts layers (``sc.MoE``, ``sc.nnx.MoE``).

The collective equals a NumPy reference on 2, 4 and 8 devices (uneven sizes, zero-row sends, a receive bound that
truncates), values and the vector-Jacobian product, under ``jax.jit``; the bookkeeping of the native collective (not
available on CPU) is checked against the semantics JAX documents for ``jax.lax.ragged_all_to_all``, and the native
program is lowered (forward and gradient). The layers with their experts split over an axis equal one device
running every expert on the global batch, forward and gradients, dropless and with a capacity, for routings that
leave experts empty or send every token to one expert, k = 1 and 2; their losses and metrics are the global batch's.
Every case compiles one small program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import spmdcomm as sc
import spmdcomm.collectives.ragged as ragged
from spmdcomm.errors import AxisError, BackendError, ShapeError, SpmdError

ROWS = 6  # rows each device holds in the collective's cases


def axis_mesh(n: int, name: str = "x") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,))


def numpy_ragged(xs: list[np.ndarray], sizes: np.ndarray, out_rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    """What each device receives, from the definition: device i's rows grouped by destination, device j's chunks
    packed in source order, cut at ``out_rows``."""
    n = len(xs)
    outs, recv = [], np.zeros((n, n), np.int64)
    for j in range(n):
        got = []
        for i in range(n):
            s = np.maximum(sizes[i], 0)
            start = min(int(s[:j].sum()), len(xs[i]))
            chunk = xs[i][start : min(start + int(s[j]), len(xs[i]))]
            room = out_rows - sum(len(c) for c in got)
            got.append(chunk[: max(room, 0)])
            recv[j, i] = len(got[-1])
        packed = np.concatenate(got) if got else np.zeros((0,) + xs[0].shape[1:])
        out = np.zeros((out_rows,) + xs[0].shape[1:], xs[0].dtype)
        out[: len(packed)] = packed
        outs.append(out)
    return outs, recv


# (devices, per-device send sizes, out_rows): uneven, zero-row sends, everything to one device, negative counts,
# counts past the rows held, and receive bounds that cut the last sources.
RAGGED_CASES = {
    "2-uneven": (2, [[1, 5], [0, 3]], None),
    "2-cut": (2, [[4, 2], [6, 0]], 7),
    "4-zero-rows": (4, [[0, 2, 0, 4], [1, 1, 1, 1], [0, 0, 0, 0], [6, 0, 0, 0]], None),
    "4-all-to-one": (4, [[0, 0, 6, 0], [0, 0, 6, 0], [0, 0, 6, 0], [0, 0, 6, 0]], 24),
    "4-past-rows-negative": (4, [[3, 9, 0, 0], [-2, 2, 2, 2], [2, 2, 2, 2], [0, 0, 0, 1]], 5),
    "8-uneven": (8, [[(i * 3 + j) % 3 - (j == 7) for j in range(8)] for i in range(8)], None),
    "8-cut": (8, [[(i + j) % 2 * 2 for j in range(8)] for i in range(8)], 3),
}


@pytest.mark.parametrize("case", sorted(RAGGED_CASES))
def test_ragged_all_to_all_equals_numpy_values_and_vjp(case):
    n, sizes, out_rows = RAGGED_CASES[case]
    sizes = np.array(sizes, np.int32)
    bound = out_rows or n * ROWS
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n * ROWS, 3)).astype(np.float32)
    tag = np.arange(n * ROWS, dtype=np.int32)  # a second leaf: ints move with the same sizes
    cot = rng.standard_normal((n * bound, 3)).astype(np.float32)

    def body(x, tag, s, cot):
        (out, moved), recv = sc.ragged_all_to_all((x, tag), s, "x", out_rows=out_rows, implementation="padded")
        _, vjp = jax.vjp(lambda x: sc.ragged_all_to_all(x, s, "x", out_rows=out_rows)[0], x)
        return out, moved, recv, vjp(cot)[0]

    f = jax.jit(jax.shard_map(body, mesh=axis_mesh(n), in_specs=jax.P("x"), out_specs=jax.P("x")))
    out, moved, recv, grad = (np.asarray(a) for a in f(x, tag, sizes.reshape(-1), cot))
    xs, tags = np.split(x, n), np.split(tag, n)
    want, want_recv = numpy_ragged(xs, sizes, bound)
    want_tags, _ = numpy_ragged(tags, sizes, bound)
    np.testing.assert_array_equal(out, np.concatenate(want))
    np.testing.assert_array_equal(moved, np.concatenate(want_tags))
    np.testing.assert_array_equal(recv, want_recv.reshape(-1))
    # The transpose: each received row's cotangent goes back to the row it came from (found by its tag).
    want_grad = np.zeros_like(x)
    for j, (rows, got) in enumerate(zip(np.split(np.concatenate(want_tags), n), np.split(cot, n), strict=True)):
        for r in range(int(want_recv[j].sum())):
            want_grad[rows[r]] += got[r]
    np.testing.assert_array_equal(grad, want_grad)


@pytest.mark.parametrize("case", ["4-zero-rows", "4-past-rows-negative", "8-cut"])
def test_the_native_bookkeeping_follows_jax_ragged_all_to_all_semantics(case):
    """The offsets and sizes passed to ``jax.lax.ragged_all_to_all``, run through the pseudocode of its
    docstring in NumPy, deliver what the padded implementation delivers."""
    n, sizes, out_rows = RAGGED_CASES[case]
    sizes = np.array(sizes, np.int32)
    bound = out_rows or n * ROWS

    def body(s):
        return tuple(a[None] for a in ragged._plan(s, "x", ROWS, bound))

    f = jax.jit(jax.shard_map(body, mesh=axis_mesh(n), in_specs=jax.P("x"), out_specs=jax.P("x")))
    send, recv, in_off, out_off = (np.asarray(a) for a in f(sizes.reshape(-1)))
    xs = [np.arange(ROWS) + 100 * i for i in range(n)]
    results = [np.zeros(bound, np.int64) for _ in range(n)]
    for j in range(n):  # receiver j, as the docstring's RECEIVE loop: output_offsets all-to-all'd
        for i in range(n):
            at = out_off[i, j]
            results[j][at : at + recv[j, i]] = xs[i][in_off[i, j] : in_off[i, j] + send[i, j]]
            assert send[i, j] == recv[j, i]
    want, _ = numpy_ragged(xs, sizes, bound)
    np.testing.assert_array_equal(np.stack(results), np.stack(want))


def test_the_native_program_lowers_forward_and_backward(monkeypatch):
    monkeypatch.setattr(ragged, "RAGGED_NATIVE_PLATFORMS", frozenset({"cpu"}))  # lowered only: XLA:CPU has no kernel

    def body(x, s):
        return sc.ragged_all_to_all(x, s, "x", out_rows=12, implementation="native")[0]

    f = jax.shard_map(body, mesh=axis_mesh(4), in_specs=jax.P("x"), out_specs=jax.P("x"))
    x, s = jnp.ones((16, 3)), jnp.ones((16,), jnp.int32)
    assert "ragged_all_to_all" in jax.jit(f).lower(x, s).as_text()
    assert "ragged_all_to_all" in jax.jit(jax.grad(lambda x: (f(x, s) ** 2).sum())).lower(x).as_text()


@pytest.mark.parametrize(
    ("kwargs", "error", "facts"),
    [
        ({"s": np.ones(3, np.int32)}, ShapeError, ["send_sizes has shape (3,)", "shape (4,)"]),
        ({"s": np.ones(4, np.float32)}, ShapeError, ["dtype float32", "one integer per device"]),
        ({"out_rows": 0}, SpmdError, ["out_rows=0 is not a positive integer"]),
        ({"implementation": "fast"}, SpmdError, ["implementation='fast'", "'padded'"]),
        ({"implementation": "native"}, BackendError, ["platform 'cpu'", "implementation='auto' or 'padded'"]),
        ({"axis": "y"}, AxisError, ["unknown axis name 'y'"]),
        ({"x": (np.ones((4, 2)), np.ones(3))}, ShapeError, ["different numbers of rows", "[0]': 4", "[1]': 3"]),
        ({"x": np.float32(1)}, ShapeError, ["0-d"]),
    ],
)
def test_ragged_all_to_all_rejects_bad_input_before_tracing_lax(kwargs, error, facts):
    args = {"x": np.ones((4, 2)), "s": np.ones(4, np.int32), "axis": "x"} | kwargs
    x, s, axis = args.pop("x"), args.pop("s"), args.pop("axis")

    def body(_):
        return sc.ragged_all_to_all(x, s, axis, **args)[1]

    with pytest.raises(error) as caught:
        jax.shard_map(body, mesh=axis_mesh(4), in_specs=jax.P("x"), out_specs=jax.P("x"))(np.zeros(4))
    assert "spmdcomm.ragged_all_to_all" in str(caught.value)
    for fact in facts:
        assert fact in str(caught.value)
