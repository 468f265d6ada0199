"""Layer 6, parallelisms: what each mesh axis does (``roles``), the random streams that do not depend on how a batch
is split (``rng``), and one folder or module per parallelism: data (DDP, ZeRO, FSDP, hybrid: the per-leaf layout,
under every other), pipeline (schedules and layer stacks), context (the sequence split) and expert (mixture-of-experts
layers over an expert axis). The parallelisms that give a mesh axis a role of its own are entries of the registry
(``registry``), each registered by its one line below; the order of the lines is the order of their axes among the
batch axes. ``spmdcomm.train`` builds its state and steps on them."""

from spmdcomm.parallel import context, expert
from spmdcomm.parallel.context import ContextParallel, context_attention, context_positions
from spmdcomm.parallel.data import DDP, FSDP, STRATEGIES, ReduceContext, Strategy, TreeLayout, ZeRO1, ZeRO2
from spmdcomm.parallel.expert import ExpertParallel, MoE
from spmdcomm.parallel.pipeline import Pipeline, PipelineStack, Schedule
from spmdcomm.parallel.pipeline import pipeline as pipeline_schedules
from spmdcomm.parallel.registry import register
from spmdcomm.parallel.roles import MeshRoles

register(pipeline_schedules.PARALLELISM)
register(context.PARALLELISM)
register(expert.layer.PARALLELISM)

__all__ = [
    "MeshRoles",
    "DDP",
    "ZeRO1",
    "ZeRO2",
    "FSDP",
    "STRATEGIES",
    "Strategy",
    "ReduceContext",
    "TreeLayout",
    "Pipeline",
    "PipelineStack",
    "Schedule",
    "ContextParallel",
    "context_attention",
    "context_positions",
    "ExpertParallel",
    "MoE",
]
