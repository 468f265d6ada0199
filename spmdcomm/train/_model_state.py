"""How a train step merges the model states its devices end with (BatchNorm's running statistics, NNX RNG counts):
the float leaves averaged over the batch, in the one all-reduce that carries the gradients."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm.parallel.rng import is_key_leaf
from spmdcomm.train._step import sum_dtype

__all__ = ["float_leaves", "merge_model_state"]


def float_leaves(tree: Any) -> Any:
    # The float leaves in the dtype they are summed in; other leaves become empty (not averaged).
    return jax.tree.map(
        lambda x: (
            x.astype(sum_dtype(x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros((0,), jnp.float32)
        ),
        tree,
    )


def merge_model_state(local: Any, averaged: Any, axis: str | tuple[str, ...], stored: Any) -> Any:
    # Float leaves take their weighted average over the axis; integer leaves (counters, e.g. NNX
    # RngCount) must agree on every replica and take the maximum. RNG keys are never averaged: the
    # stored key stays (a model's streams only advance their counts), identical on every replica.
    def merge(x: jax.Array, avg: jax.Array, old: jax.Array) -> jax.Array:
        if is_key_leaf(x):
            return old
        return avg.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else lax.pmax(x, axis)

    return jax.tree.map(merge, local, averaged, stored)
