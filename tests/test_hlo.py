"""spmdcomm's collectives compile to the same XLA collectives as the hand-written jax.lax code."""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import spmdcomm as sc
from spmdcomm import P

_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
RING = [(i, (i + 1) % 8) for i in range(8)]


def collectives(fn, x) -> collections.Counter:
    """The collective operations in the compiled (optimised) HLO of ``fn`` run over 8 devices."""
    text = sc.spmd(fn, in_specs=P("data"), out_specs=P("data")).lower(x).compile().as_text()
    return collections.Counter(_COLLECTIVE.findall(text))


PAIRS = [
    ("psum", lambda x: sc.psum(x, "data", algorithm="native"), lambda x: lax.psum(x, "data")),
    ("pmean", lambda x: sc.pmean(x, "data", algorithm="native"), lambda x: lax.pmean(x, "data")),
    ("pmax", lambda x: sc.pmax(x, "data"), lambda x: lax.pmax(x, "data")),
    ("all_gather", lambda x: sc.all_gather(x, "data"), lambda x: lax.all_gather(x, "data", tiled=True)),
    ("reduce_scatter", lambda x: sc.reduce_scatter(x, "data"), lambda x: lax.psum_scatter(x, "data", tiled=True)),
    (
        "all_to_all",
        lambda x: sc.all_to_all(x, "data", split_dim=0, concat_dim=1),
        lambda x: lax.all_to_all(x, "data", 0, 1, tiled=True),
    ),
    ("shift", lambda x: sc.shift(x, "data", offset=1), lambda x: lax.ppermute(x, "data", RING)),
    ("permute", lambda x: sc.permute(x, "data", perm=RING), lambda x: lax.ppermute(x, "data", RING)),
    (
        "psum_rs_ag",
        lambda x: sc.psum(x, "data", algorithm="rs_ag"),
        lambda x: lax.all_gather(lax.psum_scatter(x.reshape(-1), "data", tiled=True), "data", tiled=True).reshape(
            x.shape
        ),
    ),
    (
        "pytree_psum",
        lambda x: sc.psum({"a": x, "b": (x * 2, x + 1)}, "data", algorithm="native"),
        lambda x: lax.psum({"a": x, "b": (x * 2, x + 1)}, "data"),
    ),
]


@pytest.mark.parametrize("ours, theirs", [p[1:] for p in PAIRS], ids=[p[0] for p in PAIRS])
def test_same_collectives_as_lax(ours, theirs):
    x = np.ones((8 * 16, 32), np.float32)
    got, want = collectives(ours, x), collectives(theirs, x)
    assert got == want and sum(want.values()) >= 1, (got, want)


def test_reduce_scatter_moves_no_gathered_data():
    ops = collectives(lambda x: sc.reduce_scatter(x, "data"), np.ones((8 * 16, 32), np.float32))
    assert ops == {"reduce-scatter": 1}


@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda x: sc.broadcast(x, "data", root=3), {"all-gather": 1}),
        (lambda x: sc.scatter(x, "data", root=3), {"all-to-all": 1}),
        (lambda x: sc.gather(x, "data", root=3), {"all-gather": 1}),
        (lambda x: sc.reduce_scatter(x, "data", op="max"), {"all-to-all": 1}),
        (lambda x: sc.all_reduce(x, "data", op="prod"), {"all-gather": 1}),
    ],
)
def test_composed_collectives_use_one_collective(fn, want):
    assert collectives(fn, np.ones((8 * 16, 32), np.float32)) == want


def test_auto_picks_native_for_small_leaves():
    x = np.ones((8 * 16, 32), np.float32)
    assert collectives(lambda v: sc.psum(v, "data"), x) == {"all-reduce": 1}
    assert collectives(lambda v: sc.psum(jnp.asarray(v), "data", algorithm="rs_ag"), x) == {
        "reduce-scatter": 1,
        "all-gather": 1,
    }


def test_large_broadcast_uses_all_to_all_and_all_gather():
    x = np.zeros((8 * sc.collectives.BROADCAST_SPLIT_MIN_BYTES["cpu"] // 4,), np.float32)  # the CPU threshold
    assert collectives(lambda v: sc.broadcast(v, "data", root=1), x) == {"all-to-all": 1, "all-gather": 1}
    small = np.zeros((8 * (sc.collectives.BROADCAST_SPLIT_MIN_BYTES["cpu"] // 4 - 8),), np.float32)
    assert collectives(lambda v: sc.broadcast(v, "data", root=1), small) == {"all-gather": 1}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("inclusive", [True, False])
def test_scan_uses_log2_collective_permutes(n, inclusive):
    """Hillis-Steele: ceil(log2 n) rounds of collective-permute, one more to shift for the exclusive scan."""
    mesh = sc.data_mesh(devices=jax.devices()[:n])
    text = (
        sc.spmd(lambda v: sc.scan(v, "data", inclusive=inclusive), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        .lower(np.ones((n, 4), np.float32))
        .compile()
        .as_text()
    )
    want = math.ceil(math.log2(n)) + (0 if inclusive or n == 1 else 1)
    assert collections.Counter(_COLLECTIVE.findall(text)) == ({"collective-permute": want} if want else {})


@pytest.mark.parametrize(
    "fn, want",
    [
        # pmax keeps lax.pmax's forward; its gradient adds one all-reduce (the tie count): under check_vma the
        # transpose of the tangent's psum over an invariant cotangent needs no communication.
        (lambda x: sc.pmax(x, "data"), {"all-reduce": 1}),
        (lambda x: jax.grad(lambda v: (sc.pmax(v, "data") ** 2).sum())(x), {"all-reduce": 2}),
        # broadcast's gradient: the forward all-gather, then the one all-reduce that the gradient of the lax
        # reference psum(where(i == root, x, 0)) also does (summing the varying cotangent of the invariant output).
        (
            lambda x: jax.grad(lambda v: (sc.broadcast(v, "data", root=3) * v).sum())(x),
            {"all-gather": 1, "all-reduce": 1},
        ),
    ],
)
def test_derivative_collectives(fn, want):
    assert collectives(fn, np.ones((8 * 16, 32), np.float32)) == want


def test_pmax_forward_is_lax_pmax():
    x = np.ones((8 * 16, 32), np.float32)
    ours = sc.spmd(lambda v: sc.pmax(v, "data"), in_specs=P("data"), out_specs=P()).lower(x).as_text()
    theirs = sc.spmd(lambda v: lax.pmax(v, "data"), in_specs=P("data"), out_specs=P()).lower(x).as_text()
    body = lambda t: [ln for ln in t.splitlines() if "all_reduce" in ln or "maximum" in ln]  # noqa: E731
    assert body(ours) == body(theirs)
