"""Synchronised BatchNorm whose statistics are those of every real row on every device (torch ``SyncBatchNorm``).

Flax's ``BatchNorm(axis_name=...)`` averages the per-device means with ``pmean``: with a padded batch and a mask,
each device's mean counts as much as any other, however many real rows it holds, and a device without a real row
contributes 0/0 = NaN to every device's statistics. :class:`SyncBatchNorm` (Linen) and
:class:`spmdcomm.nnx.SyncBatchNorm <spmdcomm.nnx.batchnorm.SyncBatchNorm>` (NNX) instead sum, over the devices of
``axis_name``, each device's sums over its real entries and their counts, so the mean and variance are exactly
those one device computes on the real rows alone, padded or not:

* ``mean = psum(sum of x) / psum(count)``; with ``use_fast_variance=True`` (Flax's default)
  ``var = max(0, psum(sum of |x|^2) / psum(count) - |mean|^2)``, all in one all-reduce, otherwise the two-pass
  ``var = psum(sum of |x - mean|^2) / psum(count)`` (a second all-reduce), as Flax computes them on one device;
* entries where ``mask`` is False are replaced by zeros before anything is summed, so they never count and a NaN
  in them reaches neither the statistics nor their gradient; a device without real rows is fine (the output there
  is normalised like any other entry, as in Flax, so a NaN input stays NaN in its own output);
* the running averages are updated as Flax updates them (``momentum * old + (1 - momentum) * batch``), except that
  a feature no device saw a real entry of keeps its running statistics (Flax would store NaN), and is normalised
  with mean 0 and variance 0;
* the derivative is that of the exact statistics: the transpose of the all-reduce sends each device's cotangent
  to every device, so the gradient of a loss over all devices (e.g. the sum of each device's real-row count times
  its mean loss) is the one-device gradient on the real rows, which is what :func:`~spmdcomm.make_train_step`
  differentiates under every strategy.

The layers subclass Flax's: constructor options, variable names and collections (``params`` ``scale``/``bias``,
``batch_stats`` ``mean``/``var``; NNX ``Param`` and ``BatchStat``) are Flax's, so checkpoints and model code carry
over (an unnamed Linen ``SyncBatchNorm`` is auto-named ``BatchNorm_0``, ``BatchNorm_1``, ... like the layer it
replaces), and ``isinstance(layer, nn.BatchNorm)`` holds. ``axis_name`` may be a mesh axis name or a tuple of them (e.g.
a train state's ``axis=("replica", "shard")``). ``axis_index_groups`` is not supported: name a mesh axis that
spans the devices that share statistics instead.

>>> x = np.array([[1.0], [3.0], [np.nan]], np.float32)
>>> y, _ = sc.SyncBatchNorm(use_running_average=False, epsilon=0.0).init_with_output(
...     jax.random.PRNGKey(0), x, mask=np.array([[True], [True], [False]]))
>>> y[:2, 0].tolist()
[-1.0, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes
from jax import lax

from spmdcomm.collectives._common import AxisName, bound_size
from spmdcomm.errors import ShapeError, SpmdError, describe

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(nn.BatchNorm):
    """Flax Linen ``BatchNorm`` with exact, count-weighted statistics over ``axis_name`` (see the module docs).

    Same fields, defaults and variables as ``flax.linen.BatchNorm``; replace ``nn.BatchNorm(...)`` by
    ``sc.SyncBatchNorm(...)``. ``__call__(x, use_running_average=None, *, mask=None)``: ``mask`` has ``x``'s rank,
    each dimension 1 or ``x``'s, and marks the entries that count (e.g. ``mask[:, None, None, None]`` for the train
    step's row mask and an NHWC ``x``). While initialising, the statistics are this device's (no axis is needed).

    Attributes:
      use_running_average: True normalizes with the running statistics, False with the batch's (updating the
        running ones); ``None`` (default): given to ``__call__`` instead.
      axis: the feature axis (or axes) of the input; ``-1`` by default.
      momentum: the running averages' decay: ``momentum * old + (1 - momentum) * batch``; 0.99 by default.
      epsilon: added to the variance before its inverse square root; 1e-5 by default.
      dtype: the dtype of the computation and the output; ``None`` (default): inferred from the input and the
        parameters (Flax's rule).
      param_dtype: the dtype of ``scale`` and ``bias`` (and of the running statistics without
        ``force_float32_reductions``); float32 by default.
      use_bias: whether to add the learned ``bias``; True by default.
      use_scale: whether to multiply by the learned ``scale``; True by default.
      bias_init: the initializer of ``bias``; zeros by default.
      scale_init: the initializer of ``scale``; ones by default.
      axis_name: the mesh axis name (or tuple of them) the statistics are taken over; ``None`` (default): this
        device's only.
      axis_index_groups: not supported: must stay ``None``.
      use_fast_variance: True (default): the variance from the sums of ``x`` and ``|x|^2`` in one all-reduce;
        False: the two-pass variance (a second all-reduce).
      force_float32_reductions: True (default): the statistics are computed in float32 at least and the running
        ones stored in float32.
      parent: Flax's module parent.
      name: Flax's module name (unnamed, it is auto-named ``BatchNorm_0``, ``BatchNorm_1``, ...).

    Examples:
      >>> bn = sc.SyncBatchNorm(use_running_average=False, momentum=0.9)
      >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
      >>> variables = bn.init(jax.random.PRNGKey(0), x)
      >>> y, updated = bn.apply(variables, x, mutable=["batch_stats"])
      >>> updated["batch_stats"]["mean"].tolist(), y.mean(0).round(6).tolist()
      ([0.30000001192092896, 0.4000000059604645], [0.0, 0.0])
    """

    @nn.compact
    def __call__(self, x: Any, use_running_average: bool | None = None, *, mask: Any = None) -> jax.Array:
        """Normalizes ``x`` with the batch statistics of its unmasked entries over ``axis_name``, or the running ones.

        In training mode the statistics of the entries where ``mask`` is True, on every device of ``axis_name``,
        normalize ``x`` and update the running ``mean``/``var`` (features with no such entry keep theirs); masked
        entries, NaN included, count for nothing.

        Args:
          x: the input, with the features on the layer's ``axis``.
          use_running_average: True normalizes with the running statistics, False with the batch's and updates
            the running ones; give it here or in the constructor, not both.
          mask: a bool array of ``x``'s rank, each dimension 1 or ``x``'s, True for the entries that count;
            ``None`` (default) counts all.

        Returns:
          The normalized input, of ``x``'s shape.

        Raises:
          ValueError: when ``use_running_average`` is given both here and in the constructor, or in neither
            (Flax's ``merge_param``).
          SpmdError: when ``axis_index_groups`` is set.
          ShapeError: when ``mask``'s shape does not broadcast to ``x``'s.
          AxisError: in training mode (not while initialising), when ``axis_name`` is set but not bound where the
            layer runs; the message names the bound axes (in the train step, the state's data axis ``state.axis``).
        """
        use_running_average = nn.merge_param("use_running_average", self.use_running_average, use_running_average)
        check_no_groups("SyncBatchNorm", self.axis_index_groups)
        features, reduction_axes = feature_axes(x.ndim, self.axis)
        feature_shape = tuple(x.shape[a] for a in features)
        stored = jnp.float32 if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stored), feature_shape)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, stored), feature_shape)

        if use_running_average:
            mean, var = ra_mean.value, ra_var.value
            if not self.force_float32_reductions:
                mean, var = jnp.asarray(mean, self.param_dtype), jnp.asarray(var, self.param_dtype)
        else:
            initializing = self.is_initializing()
            mean, var, seen = batch_stats(
                "SyncBatchNorm",
                x,
                reduction_axes,
                mask=mask,
                dtype=self.dtype,
                axis_name=None if initializing else self.axis_name,
                use_fast_variance=self.use_fast_variance,
                promote=self.force_float32_reductions,
            )
            if not initializing:
                ra_mean.value = running_average(ra_mean.value, mean, seen, self.momentum)
                ra_var.value = running_average(ra_var.value, var, seen, self.momentum)

        def param(name: str, init: Callable[..., Any]) -> jax.Array:
            value = self.param(name, init, feature_shape, self.param_dtype)
            return value if self.force_float32_reductions else jnp.asarray(value, self.param_dtype)

        # Created in Flax's order (scale, then bias) so that random initialisers draw the same keys.
        scale = param("scale", self.scale_init) if self.use_scale else None
        bias = param("bias", self.bias_init) if self.use_bias else None
        return normalize(x, mean, var, scale, bias, features, dtype=self.dtype, epsilon=self.epsilon)


# Linen names unnamed submodules after their class: named as the layer it replaces, an unnamed SyncBatchNorm is
# "BatchNorm_0", ..., so the variable paths (and checkpoints) of a model that swaps one for the other stay the same.
SyncBatchNorm.__name__ = "BatchNorm"


# --------------------------------------------------------------------------------------------------
# Shared by the Linen and NNX layers


def feature_axes(rank: int, axis: int | Iterable[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(feature axes, reduction axes)`` of an input of ``rank`` dimensions whose features are ``axis``."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    features = tuple(sorted({a + rank if a < 0 else a for a in axes}))
    return features, tuple(a for a in range(rank) if a not in features)


def check_no_groups(fn: str, groups: Any) -> None:
    """Raises :class:`SpmdError` for ``axis_index_groups``, which ``shard_map`` cannot all-reduce over."""
    if groups is not None:
        raise SpmdError(
            describe(
                fn,
                f"axis_index_groups={groups!r} is not supported (shard_map has no grouped all-reduce).",
                fix="build a mesh with an axis that spans the devices sharing statistics (e.g. a 2-D mesh) and pass "
                "that axis as axis_name; or drop axis_index_groups.",
            )
        )


def batch_stats(
    fn: str,
    x: Any,
    reduction_axes: tuple[int, ...],
    *,
    mask: Any,
    dtype: Any,
    axis_name: AxisName | None,
    use_fast_variance: bool,
    promote: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(mean, var, seen)`` over ``reduction_axes`` of the entries of ``x`` where ``mask`` is True, on every device
    of ``axis_name``; ``seen`` is True for the features with at least one such entry (mean and var are 0 elsewhere).

    The statistics are computed in ``dtype`` (default ``x``'s), promoted to at least float32 when ``promote``.
    """
    dtype = jnp.result_type(x) if dtype is None else dtype
    dtype = jnp.promote_types(dtype, jnp.float32) if promote else dtype
    x = jnp.asarray(x, dtype)
    size = 1 if axis_name is None else bound_size(fn, axis_name, argument="axis_name", fix=_unbound_axis_fix(fn))
    m = None if mask is None else _broadcast_mask(fn, mask, x.shape)
    if m is not None:
        # Zeros, not x, where the mask is False: a NaN there must reach neither a sum nor its gradient.
        x = jnp.where(m, x, jnp.zeros_like(x))
    local = [jnp.sum(x, axis=reduction_axes)]
    if use_fast_variance:
        local.append(jnp.sum(_abs_sq(x), axis=reduction_axes))
    if m is None:
        # Every device's block has the same shape: the count is static.
        sums = _psum(jnp.stack(local), axis_name)
        n: jax.Array | int = math.prod(x.shape[a] for a in reduction_axes) * size
        seen = jnp.ones(sums.shape[1:], bool)
    else:
        # One all-reduce for the sums and the counts (int32, so that they stay exact).
        sums, count = _psum((jnp.stack(local), jnp.sum(m, axis=reduction_axes, dtype=jnp.int32)), axis_name)
        n, seen = jnp.maximum(count, 1).astype(dtype), count > 0
    mean = sums[0] / n
    if use_fast_variance:
        return mean, jnp.maximum(0.0, sums[1] / n - _abs_sq(mean)), seen
    deviation = _abs_sq(x - jnp.expand_dims(mean, reduction_axes))
    if m is not None:
        deviation = jnp.where(m, deviation, jnp.zeros_like(deviation))
    return mean, _psum(jnp.sum(deviation, axis=reduction_axes), axis_name) / n, seen


def running_average(old: jax.Array, batch: jax.Array, seen: jax.Array, momentum: float) -> jax.Array:
    """Flax's running-average update, kept at ``old`` for the features without a real entry (``seen`` False)."""
    return jnp.where(seen, momentum * old + (1 - momentum) * batch, old)


def normalize(
    x: Any,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    features: tuple[int, ...],
    *,
    dtype: Any,
    epsilon: float,
) -> jax.Array:
    """``(x - mean) * rsqrt(var + epsilon) * scale + bias`` with the statistics and parameters (shaped as ``x``'s
    ``features`` axes) broadcast over the other axes, in Flax's order of operations and output dtype."""
    shape = [x.shape[a] if a in features else 1 for a in range(x.ndim)]
    y = x - mean.reshape(shape)
    mul = lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        mul = mul * scale.reshape(shape)
    y = y * mul
    if bias is not None:
        y = y + bias.reshape(shape)
    return jnp.asarray(y, dtypes.canonicalize_dtype(x, scale, bias, dtype=dtype))


# --------------------------------------------------------------------------------------------------
# Private helpers


def _unbound_axis_fix(fn: str) -> Callable[[tuple[str, ...]], str]:
    """The fix for a layer whose ``axis_name`` is not bound, given the axes that are (as Flax's ``BatchNorm`` error in
    the train step names the state's data axis)."""

    def fix(bound: tuple[str, ...]) -> str:
        if bound:
            suggested = bound[0] if len(bound) == 1 else bound
            return (
                "build the layer with axis_name set to the mesh axis the batch is split over: inside "
                "sc.make_train_step or sc.make_eval_step, the state's data axis (state.axis), here "
                f"{fn}(..., axis_name={suggested!r})."
            )
        return (
            "run the layer in training mode where its axis is bound: inside sc.make_train_step or sc.make_eval_step "
            "with axis_name set to the state's data axis (state.axis, e.g. axis_name='data'), or inside spmd or "
            "jax.shard_map over that axis; or pass axis_name=None for statistics of each device's batch alone."
        )

    return fix


def _psum(tree: Any, axis_name: AxisName | None) -> Any:
    return tree if axis_name is None else lax.psum(tree, axis_name)


def _broadcast_mask(fn: str, mask: Any, shape: tuple[int, ...]) -> jax.Array:
    """``mask`` as bools of ``shape``; :class:`ShapeError` unless it has that rank and each dimension is 1 or equal."""
    mask = jnp.asarray(mask)
    if mask.ndim != len(shape) or any(m not in (1, s) for m, s in zip(mask.shape, shape)):
        raise ShapeError(
            describe(
                fn,
                f"mask of shape {mask.shape} does not fit the input of shape {shape}: it needs the input's rank "
                f"({len(shape)}), each dimension 1 or the input's (a lower-rank mask would broadcast against the "
                "trailing, feature, dimensions).",
                fix=f"mark rows with mask.reshape((-1,) + (1,) * {len(shape) - 1}), e.g. the train step's row "
                "mask as mask[:, None] for a 2-D input or mask[:, None, None, None] for NHWC images.",
            )
        )
    return jnp.broadcast_to(mask.astype(bool), shape)


def _abs_sq(x: jax.Array) -> jax.Array:
    # |x|^2, real for complex inputs as in Flax.
    return lax.square(lax.real(x)) + lax.square(lax.imag(x)) if jnp.iscomplexobj(x) else lax.square(x)
