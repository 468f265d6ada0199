"""The example's model and loss: a small ResNet whose BatchNorm statistics are synchronised exactly over the data
axis (``sc.SyncBatchNorm``: every real example of the global batch counts once, padded rows never)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import optax

import spmdcomm as sc


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with synchronised BatchNorm and a projection shortcut when the shape changes."""

    features: int
    strides: int
    norm: Callable[..., nn.Module]
    dtype: Any

    @nn.compact
    def __call__(self, x, mask):
        conv = lambda f, k, s: nn.Conv(f, (k, k), (s, s), padding="SAME", use_bias=False, dtype=self.dtype)
        y = nn.relu(self.norm()(conv(self.features, 3, self.strides)(x), mask=mask))
        y = self.norm(scale_init=nn.initializers.zeros)(conv(self.features, 3, 1)(y), mask=mask)
        if x.shape != y.shape:
            x = self.norm()(conv(self.features, 1, self.strides)(x), mask=mask)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A stem convolution, one residual block per stage (``widths``), global average pooling and a classifier.

    ``axis_name`` is the mesh axis (or axes) the batch is split over: the BatchNorm statistics are those of the
    whole global batch. ``dtype`` is the computation's (float16 or bfloat16 for half precision); parameters and
    BatchNorm statistics stay float32.
    """

    num_classes: int
    widths: Sequence[int] = (16, 32, 64)
    axis_name: str | tuple[str, ...] | None = "data"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, *, train: bool, mask=None):
        mask = None if mask is None else mask[:, None, None, None]  # the train step's row mask, for NHWC inputs
        norm = lambda **kw: sc.SyncBatchNorm(
            use_running_average=not train, momentum=0.9, axis_name=self.axis_name, dtype=self.dtype, **kw
        )
        x = nn.relu(norm()(nn.Conv(self.widths[0], (3, 3), use_bias=False, dtype=self.dtype)(x), mask=mask))
        for i, width in enumerate(self.widths):
            x = ResidualBlock(width, 1 if i == 0 else 2, norm, self.dtype)(x, mask)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


def make_loss_fn() -> Callable:
    """spmdcomm's loss_fn contract: the mean cross-entropy over this device's real examples, accuracy, and the new
    BatchNorm statistics (``model_state``), computed over the real rows of the global batch."""

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        logits, new_state = apply_fn(
            {"params": params, **model_state}, batch["image"], train=True, mask=mask, mutable=["batch_stats"]
        )
        loss, accuracy = _per_example(logits, batch["label"])
        return sc.masked_mean(loss, mask), {"accuracy": sc.masked_mean(accuracy, mask), "model_state": new_state}

    return loss_fn


def make_metric_fn() -> Callable:
    """Test loss and accuracy over this device's real examples, with the running BatchNorm statistics."""

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        logits = apply_fn({"params": params, **model_state}, batch["image"], train=False)
        loss, accuracy = _per_example(logits, batch["label"])
        return {"loss": sc.masked_mean(loss, mask), "accuracy": sc.masked_mean(accuracy, mask)}

    return metric_fn


def _per_example(logits, labels) -> tuple[jnp.ndarray, jnp.ndarray]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
