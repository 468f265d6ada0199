"""Layer 7, Flax NNX: ``nnx_loss_fn``/``nnx_metric_fn`` adapters and ``SyncBatchNorm``; loads ``flax.nnx`` on use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spmdcomm.nnx.adapters import nnx_loss_fn, nnx_metric_fn

if TYPE_CHECKING:
    from spmdcomm.nnx.batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "nnx_loss_fn", "nnx_metric_fn"]


def __getattr__(name: str) -> Any:
    # SyncBatchNorm subclasses flax.nnx.BatchNorm: defining it imports flax.nnx, so it is loaded on first access.
    if name == "SyncBatchNorm":
        from spmdcomm.nnx.batchnorm import SyncBatchNorm

        globals()[name] = SyncBatchNorm
        return SyncBatchNorm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
