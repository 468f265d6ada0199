"""Layer 9, Flax NNX: ``nnx_loss_fn``/``nnx_metric_fn`` adapters, ``SyncBatchNorm``, ``PipelineStack`` and ``MoE``;
loads ``flax.nnx`` on use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spmdcomm.nnx.adapters import nnx_loss_fn, nnx_metric_fn

if TYPE_CHECKING:
    from spmdcomm.nnx.batchnorm import SyncBatchNorm
    from spmdcomm.parallel.expert.nnx import MoE
    from spmdcomm.parallel.pipeline.nnx_stack import PipelineStack

__all__ = ["SyncBatchNorm", "PipelineStack", "MoE", "nnx_loss_fn", "nnx_metric_fn"]


def __getattr__(name: str) -> Any:
    # SyncBatchNorm, PipelineStack and MoE subclass flax.nnx classes: defining them imports flax.nnx, so they are loaded
    # on first access.
    if name == "SyncBatchNorm":
        from spmdcomm.nnx.batchnorm import SyncBatchNorm

        globals()[name] = SyncBatchNorm
        return SyncBatchNorm
    if name == "PipelineStack":
        from spmdcomm.parallel.pipeline.nnx_stack import PipelineStack

        globals()[name] = PipelineStack
        return PipelineStack
    if name == "MoE":
        from spmdcomm.parallel.expert.nnx import MoE

        globals()[name] = MoE
        return MoE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
