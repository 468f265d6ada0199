"""Token-weighted losses and metrics: a sum over a block's tokens and its weight, divided by the global weight.

A language model's loss is the sum of its tokens' losses divided by the number of real tokens in the whole global
batch. Rows hold different numbers of real tokens (packed or padded text), so the mean of per-device (or
per-micro-batch) token means is another number: ``(x1 / n1 + x2 / n2) / 2 != (x1 + x2) / (n1 + n2)``. A ``loss_fn``
or ``metric_fn`` that returns :func:`weighted` ``(total, weight)`` instead of a mean says "this is a sum over my
tokens, and this is its weight"; the train and eval steps sum both over every data, stage and context device, every
accumulation micro-batch and every process, and report ``sum(total) / sum(weight)``: one device's
``sum(loss * w) / sum(w)`` over the global batch, for any distribution of real tokens.

The train step differentiates each micro-batch's unnormalised ``total`` (torchtune's fix for the memory of holding
every micro-batch until the total is known), sums the global weight once, in the all-reduce that carries the
gradients, and divides the reduced gradient by it once, before the optimizer (and before clipping, ``skip_nonfinite``
and loss scaling's finiteness test, which therefore see the gradient of the global token mean).

>>> import optax
>>> def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
...     err = (batch["x"] * params["w"] - batch["y"]) ** 2  # [rows, tokens]
...     return sc.weighted(jnp.sum(err * batch["w"]), jnp.sum(batch["w"]))
>>> w = np.zeros((8, 4), np.float32); w[0] = 1.0; w[1, :1] = 1.0  # 5 real tokens, all on the first device
>>> batch = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 4), np.float32), "w": w}
>>> state = sc.TrainState.create(params={"w": np.float32(0.0)}, tx=optax.sgd(0.5))
>>> state, metrics = sc.make_train_step(loss_fn)(state, batch)
>>> float(metrics["loss"]), float(metrics["tokens"]), float(state.params["w"])
(1.0, 5.0, 1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm.errors import ShapeError, describe
from spmdcomm.train.state import TrainState

__all__ = ["Weighted", "weighted"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weighted:
    """A sum over a block's tokens and its weight (:func:`weighted` builds it; annotate with
    ``spmdcomm.train.Weighted``).

    Attributes:
      total: the float sum over this block's tokens (e.g. ``sum(token_loss * weights)``).
      weight: its weight (e.g. ``sum(weights)``, the block's real tokens), float32 at least.
    """

    total: Any
    weight: Any

    def mean(self) -> jax.Array:
        """``total / weight``, 0.0 where the weight is 0 (a block without real tokens).

        Returns:
          The block's own weighted mean (the steps report the global one).
        """
        return jnp.where(self.weight > 0, self.total, jnp.zeros_like(self.total)) / jnp.where(
            self.weight > 0, self.weight, jnp.ones_like(self.weight)
        )


def weighted(total: Any, weight: Any) -> Weighted:
    """A token-weighted loss or metric: ``total`` summed over this block's tokens, with weight ``weight``.

    Return it from ``loss_fn`` (as the loss, or as a metric of ``aux``) or from ``metric_fn``; the step reports
    ``sum(total) / sum(weight)`` over the whole global batch (every device, micro-batch and process) and trains on its
    gradient. The rows a :class:`~spmdcomm.MaskedBatch` masks out reach ``loss_fn`` as zeros, so a weight read from
    the batch (a ``weights`` field, ``targets > 0``) is already 0 there; a weight computed otherwise must leave them out
    (multiply by ``mask[:, None]``).

    Args:
      total: a float scalar: the sum over this block's tokens of the per-token values times their weights.
      weight: a scalar (float, int or bool sum): the sum of the weights, e.g. this block's real tokens.

    Returns:
      A :class:`Weighted` (a pytree of the two scalars, ``weight`` as float32 at least).

    Raises:
      ShapeError: when ``total`` is not a float scalar or ``weight`` not a scalar, naming the shapes and the fix.

    Examples:
      >>> token_loss, w = jnp.array([[1.0, 3.0], [5.0, 0.0]]), jnp.array([[1.0, 1.0], [1.0, 0.0]])
      >>> float(sc.weighted(jnp.sum(token_loss * w), jnp.sum(w)).mean())
      3.0
    """
    total, weight = jnp.asarray(total), jnp.asarray(weight)
    if total.shape != () or not jnp.issubdtype(total.dtype, jnp.floating):
        raise ShapeError(
            describe(
                "weighted",
                f"total has shape {total.shape} and dtype {total.dtype}; it must be a float scalar (the sum over this "
                "block's tokens).",
                fix="sum the per-token values: sc.weighted(jnp.sum(token_loss * weights), jnp.sum(weights)).",
            )
        )
    if weight.shape != ():
        raise ShapeError(
            describe(
                "weighted",
                f"weight has shape {weight.shape}; it must be a scalar (the sum of this block's token weights).",
                fix="sum the weights: sc.weighted(jnp.sum(token_loss * weights), jnp.sum(weights)).",
            )
        )
    return Weighted(total, weight.astype(jnp.promote_types(total.dtype, jnp.float32)))


def loss_weight(
    state: TrainState, mask: jax.Array, masked: bool, k: int, global_sum: Callable[[jax.Array], jax.Array]
) -> Callable[[jax.Array], Any]:
    """``f(count) -> weight``: what a micro-batch's mean loss is multiplied by before differentiating, given its
    real-example ``count`` (``mask`` is this device's block of the step's mask, ``k`` micro-batches of it, one block
    per device of the batch axes; ``global_sum`` sums a value over every device of the step's manual axes).

    Without loss scaling: the count when the batch is masked (the sum over devices is then divided by the total
    count), else 1 (divided by the number of blocks). With loss scaling the weight is the micro-batch's share of the
    global batch (count / global count, or 1 / blocks), so the backward pass runs on the values one device's
    ``scale * global mean`` gives each example: float16 overflows, skipped steps and scales are one device's
    whatever the mask and device count (weighing by the count alone overflowed up to count times sooner)."""
    if state.loss_scale is None:
        return (lambda c: c) if masked else (lambda c: 1.0)
    if not masked:
        return lambda c: 1.0 / (state.roles.blocks * k)
    # The mask is per row: the same on every context device, and summed over them too.
    total = jnp.maximum(global_sum(jnp.sum(mask, dtype=jnp.float32)), 1.0)
    return lambda c: c / total


def token_share(
    state: TrainState, micro: Any, forward: Callable[..., Any], global_sum: Callable[[jax.Array], jax.Array]
) -> Any:
    """What a token-weighted loss's total is multiplied by before differentiating: 1 (the gradients are divided by
    the global weight once, after the reduction) unless the loss is scaled.

    With a loss scale, each token's backward values must be those of one device running ``scale * global token
    mean`` (float16 overflows and skipped steps are that program's), so the share is 1 / the global weight, known
    before any backward pass: a forward-only pass over the micro-batches reads each one's weight first. XLA drops
    whatever that pass computes that the weight does not need (the whole model, when the weight depends on the batch
    alone). ``forward(batch, mask, j)`` returns ``(count, (value, (loss, aux)))`` for micro-batch ``j``;
    ``global_sum`` sums a value over every device of the step's manual axes."""
    if state.loss_scale is None:
        return 1.0
    first = jax.tree.map(lambda x: x[0], micro)
    _, (_, (loss, _)) = jax.eval_shape(lambda: forward(*first, 0))
    if not isinstance(loss, Weighted):
        return 1.0
    k = jax.tree.leaves(micro)[0].shape[0]
    weights = lax.map(lambda xs: forward(*xs[0], xs[1])[1][1][0].weight, (micro, jnp.arange(k)))
    total = global_sum(jnp.sum(weights))
    return 1.0 / jnp.where(total > 0, total, 1.0)
