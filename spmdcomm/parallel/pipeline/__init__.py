"""Pipeline parallelism: a step's loop over micro-batches (``schedule``: the sequential schedule, gradient
accumulation), the pipeline schedule over a stage axis (``pipeline``) and the layer stacks it runs, Linen
(``stack``) and Flax NNX (``nnx_stack``, loaded by ``sc.nnx.PipelineStack`` on first use, so that ``flax.nnx`` loads
only when it is used). What a pipelined step communicates is its section of ``sc.explain``
(``report``, which reads the compiled step)."""

from spmdcomm.parallel.pipeline.pipeline import Pipeline
from spmdcomm.parallel.pipeline.schedule import Schedule
from spmdcomm.parallel.pipeline.stack import PipelineStack

__all__ = ["Pipeline", "PipelineStack", "Schedule"]
