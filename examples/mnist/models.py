"""The example's model and loss: a small Flax Linen CNN, cross-entropy and accuracy over real examples."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
import optax

import spmdcomm as sc


class CNN(nn.Module):
    """Two 3x3 convolutions with max-pooling, then two dense layers: about 99% on MNIST in 3 epochs."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = nn.max_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def make_loss_fn() -> Callable:
    """spmdcomm's loss_fn contract: the mean loss over this device's real examples, plus metrics."""

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        loss, accuracy = _per_example(params, batch, apply_fn)
        return sc.masked_mean(loss, mask), {"accuracy": sc.masked_mean(accuracy, mask)}

    return loss_fn


def make_metric_fn() -> Callable:
    """Test loss and accuracy over this device's real examples (the eval step weighs devices exactly)."""

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        loss, accuracy = _per_example(params, batch, apply_fn)
        return {"loss": sc.masked_mean(loss, mask), "accuracy": sc.masked_mean(accuracy, mask)}

    return metric_fn


def _per_example(params, batch, apply_fn) -> tuple[jnp.ndarray, jnp.ndarray]:
    logits = apply_fn({"params": params}, batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return loss, (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
