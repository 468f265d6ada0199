"""Layer 8, explain: what a compiled step communicates and how much device memory it holds, without running it."""

from spmdcomm.explain.report import COLLECTIVE_KINDS, Collective, DeviceMemory, Explanation, PipelineReport, explain

__all__ = ["explain", "Explanation", "Collective", "DeviceMemory", "PipelineReport", "COLLECTIVE_KINDS"]
