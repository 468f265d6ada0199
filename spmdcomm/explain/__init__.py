"""Layer 10, explain: what a compiled step communicates, how much device memory it holds and how much work it does,
without running it."""

from spmdcomm.explain.flops import Conditional, Work, model_flops
from spmdcomm.explain.report import COLLECTIVE_KINDS, Collective, DeviceMemory, Explanation, PipelineReport, explain

__all__ = [
    "explain",
    "Explanation",
    "Collective",
    "DeviceMemory",
    "PipelineReport",
    "COLLECTIVE_KINDS",
    "Work",
    "Conditional",
    "model_flops",
]
