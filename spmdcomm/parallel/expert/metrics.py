"""Step metrics from what MoE layers sow (:func:`moe_metrics`): float32 scalars a ``loss_fn`` can return in its aux
dict, with each expert's count as a metric of its own (the steps report scalars only)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.expert.routing import MoEStats

__all__ = ["moe_metrics"]


def moe_metrics(sown: Any, *, prefix: str = "moe/") -> dict[str, jax.Array]:
    """Float32 scalar metrics of every MoE layer in ``sown``, to return in a ``loss_fn``'s aux or a ``metric_fn``.

    For each layer (named by its path in ``sown``, ``/``-joined): ``{prefix}{layer}/load_balancing_loss``,
    ``.../router_z_loss`` and ``.../dropped_fraction``, each the mean over the layer's calls (and, in a
    :class:`~spmdcomm.PipelineStack`, its layers and micro-batches), and ``.../expert_counts/{j}`` for each expert
    ``j``: the assignments it got, summed over them. Every value is the global batch's (the layers' statistics are),
    so the step's averaging over devices keeps it; over accumulation micro-batches it is their mean weighted by
    real examples, as every metric.

    Args:
      sown: what the layers sowed: the Linen ``"moe"`` collection (``model.apply(..., mutable=["moe"])[1]["moe"]``)
        or the NNX capture (``nnx.capture(..., nnx.Intermediate)``'s second result), or any part of either.
      prefix: put before every name.

    Returns:
      ``{name: float32 scalar}``, names sorted.

    Raises:
      SpmdError: when ``sown`` holds no MoE statistics.

    Examples:
      >>> import flax.linen as nn
      >>> layer = sc.MoE(nn.Dense(4), experts=2, k=1)
      >>> variables = jax.jit(layer.init)(jax.random.key(0), jnp.ones((3, 4)))
      >>> _, sown = jax.jit(lambda v, x: layer.apply(v, x, mutable=["moe"]))(variables, jnp.ones((3, 4)))
      >>> sorted(sc.moe_metrics(sown["moe"], prefix=""))
      ['dropped_fraction', 'expert_counts/0', 'expert_counts/1', 'load_balancing_loss', 'router_z_loss']
    """
    fields = set(MoEStats._fields)
    found: dict[tuple[str, str], list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown)[0]:
        names = [_name(k) for k in path]
        at = max((i for i, n in enumerate(names) if n in fields), default=None)
        if at is not None:
            layer = "/".join(n for n in names[:at] if n is not None)
            found.setdefault((layer, str(names[at])), []).append(jnp.asarray(leaf))
    if not found:
        raise SpmdError(
            describe(
                "moe_metrics",
                f"no MoE statistics in the tree given (leaves named {sorted(fields)} expected).",
                fix='pass what the layers sowed: model.apply(..., mutable=["moe"])[1]["moe"], or the second result '
                "of nnx.capture(..., nnx.Intermediate).",
            )
        )
    metrics: dict[str, jax.Array] = {}
    for (layer, field), values in found.items():
        name = f"{prefix}{layer}/{field}" if layer else f"{prefix}{field}"
        if field == "expert_counts":
            counts = jnp.concatenate([v.reshape(-1, v.shape[-1]) for v in values]).sum(0)
            metrics.update({f"{name}/{j}": c.astype(jnp.float32) for j, c in enumerate(counts)})
        else:
            metrics[name] = jnp.mean(jnp.stack([v.astype(jnp.float32).mean() for v in values]))
    return dict(sorted(metrics.items()))


def _name(key: Any) -> str | None:
    """A path entry's name: a dict key or attribute name; None for a sequence index or an NNX variable's value."""
    if isinstance(key, jax.tree_util.SequenceKey):
        return None
    name = str(getattr(key, "key", getattr(key, "name", key)))
    return None if isinstance(key, jax.tree_util.GetAttrKey) and name == "value" else name
