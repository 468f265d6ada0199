"""The Flax NNX :class:`SyncBatchNorm`, public as ``spmdcomm.nnx.SyncBatchNorm``.

A module of its own so that ``import spmdcomm`` does not import ``flax.nnx``: :mod:`spmdcomm.nnx` imports it on
first use. What the statistics are: :mod:`spmdcomm.train.batchnorm`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx

from spmdcomm.errors import ShapeError, SpmdError, describe
from spmdcomm.train.batchnorm import batch_stats, check_no_groups, feature_axes, normalize, running_average

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(nnx.BatchNorm):
    """Flax NNX ``BatchNorm`` with exact, count-weighted statistics over ``axis_name``.

    What the statistics are: :mod:`spmdcomm.train.batchnorm`. Same constructor, attributes and variables
    (``Param`` ``scale``/``bias``, ``BatchStat`` ``mean``/``var``) as ``flax.nnx.BatchNorm``; ``model.eval()`` /
    ``model.train()`` and ``nnx.view`` switch it the same way. ``__call__(x, use_running_average=None, *,
    mask=None)``: ``mask`` has ``x``'s rank, each dimension 1 or ``x``'s. With ``axis_name``, training mode must
    run where that axis is bound (``spmd``, ``jax.shard_map``, the train step); otherwise it raises
    :class:`~spmdcomm.errors.AxisError`.

    Args:
      *args: ``flax.nnx.BatchNorm``'s positional arguments: ``num_features``.
      **kwargs: ``flax.nnx.BatchNorm``'s keyword arguments (``use_running_average``, ``axis``, ``momentum``,
        ``epsilon``, ``dtype``, ``axis_name``, ``rngs``, ...); ``axis_index_groups`` must stay ``None``.

    Examples:
      >>> from flax import nnx
      >>> bn = sc.nnx.SyncBatchNorm(1, momentum=0.5, epsilon=0.0, rngs=nnx.Rngs(0))
      >>> x = np.array([[1.0], [3.0], [np.nan]], np.float32)
      >>> y = bn(x, mask=np.array([[True], [True], [False]]))  # the NaN row counts for nothing
      >>> y[:2, 0].tolist(), bn.mean[...].tolist(), bn.var[...].tolist()  # running: (0 + 2) / 2, (1 + 1) / 2
      ([-1.0, 1.0], [1.0], [1.0])
    """

    def __call__(self, x: Any, use_running_average: bool | None = None, *, mask: Any = None) -> jax.Array:
        """Normalizes ``x`` with the batch statistics of its unmasked entries over ``axis_name``, or the running ones.

        In training mode the statistics of the entries where ``mask`` is True, on every device of
        ``axis_name``, normalize ``x`` and update the running ``mean``/``var`` (features with no such entry keep
        theirs); masked entries, NaN included, count for nothing.

        Args:
          x: the input, with ``num_features`` features on the layer's ``axis``.
          use_running_average: True normalizes with the running statistics, False with the batch's and updates
            the running ones; ``None`` (default) takes the layer's setting (the constructor's, as
            ``model.eval()`` / ``model.train()`` switch it).
          mask: a bool array of ``x``'s rank, each dimension 1 or ``x``'s, True for the entries that count;
            ``None`` (default) counts all.

        Returns:
          The normalized input, of ``x``'s shape.

        Raises:
          SpmdError: when ``use_running_average`` is ``None`` both here and in the constructor, or
            ``axis_index_groups`` is set.
          ShapeError: when ``x`` does not have ``num_features`` features on ``axis``, or ``mask``'s shape does not
            broadcast to it.
          AxisError: in training mode, when ``axis_name`` is set but not bound where the layer runs; the message
            names the bound axes (in the train step, the state's data axis ``state.axis``).
        """
        use_running_average = self.use_running_average if use_running_average is None else use_running_average
        if use_running_average is None:
            raise SpmdError(
                describe(
                    "nnx.SyncBatchNorm",
                    "use_running_average is None in both the constructor and the call.",
                    fix="pass use_running_average=True/False to either, or call model.train() / model.eval().",
                )
            )
        check_no_groups("nnx.SyncBatchNorm", self.axis_index_groups)
        features, reduction_axes = feature_axes(x.ndim, self.axis)
        width = math.prod(x.shape[a] for a in features)
        if width != self.num_features:
            raise ShapeError(
                describe(
                    "nnx.SyncBatchNorm",
                    f"the input of shape {x.shape} has {width} features on axis {self.axis}, the layer "
                    f"num_features={self.num_features}.",
                    fix="pass num_features equal to the input's feature dimension, or set axis to the feature axis.",
                )
            )
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
        )
        if not use_running_average:
            mean, var, seen = batch_stats(
                "nnx.SyncBatchNorm",
                x,
                reduction_axes,
                mask=mask,
                dtype=self.dtype,
                axis_name=self.axis_name,
                use_fast_variance=self.use_fast_variance,
            )
            # The running statistics are state, not a function of the parameters.
            update = lambda old, new: jax.lax.stop_gradient(running_average(old, new, seen, self.momentum))
            self.mean[...] = update(self.mean[...], mean)
            self.var[...] = update(self.var[...], var)
        return normalize(x, mean, var, scale, bias, features, dtype=self.dtype, epsilon=self.epsilon)
