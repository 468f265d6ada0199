"""The hyperparameters a train step reports among its metrics: those of ``optax.inject_hyperparams`` states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["injected_hyperparams"]


def injected_hyperparams(opt_state: Any) -> Callable[[Any], dict[str, jax.Array]]:
    """``f(opt_state) -> {name: value}``: the scalar hyperparameters of the ``optax.inject_hyperparams`` states in
    ``opt_state`` (as the update just used them), named as given to ``inject_hyperparams``, prefixed with the state's
    path when several states hold the same name."""

    def is_injected(x: Any) -> bool:
        return isinstance(x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))

    def found(tree: Any) -> list[tuple[str, str, Any]]:
        injected = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_injected)[0]
        return [
            (jax.tree_util.keystr(path), name, value)
            for path, node in injected
            if is_injected(node)
            for name, value in sorted(node.hyperparams.items())
            if np.ndim(value) == 0
        ]

    names = [name for _, name, _ in found(opt_state)]
    label = lambda path, name: f"{path}/{name}" if names.count(name) > 1 else name
    return lambda tree: {label(p, n): jnp.asarray(v, jnp.float32) for p, n, v in found(tree)}
