"""Layer 8, training: the train state, strategies (DDP, ZeRO, FSDP), train and eval steps, fit; the checkpoint functions
of ``spmdcomm.checkpoint`` (the layer below), re-exported."""

from spmdcomm.checkpoint.checkpoint import (
    CheckpointDamagedWarning,
    checkpoint_extra,
    latest_checkpoint_step,
    restore_checkpoint,
    save_checkpoint,
)
from spmdcomm.parallel.context import ContextParallel, context_attention, context_positions
from spmdcomm.parallel.data.layout import TreeLayout
from spmdcomm.parallel.data.strategies import DDP, FSDP, STRATEGIES, ZeRO1, ZeRO2
from spmdcomm.parallel.data.strategy import ReduceContext, Strategy
from spmdcomm.parallel.pipeline.pipeline import Pipeline
from spmdcomm.parallel.pipeline.schedule import Schedule
from spmdcomm.parallel.pipeline.stack import PipelineStack
from spmdcomm.parallel.roles import MeshRoles
from spmdcomm.train._step import DEFAULT_MAX_IN_FLIGHT
from spmdcomm.train.batchnorm import SyncBatchNorm
from spmdcomm.train.eval_step import EvalStep, evaluate, make_eval_step
from spmdcomm.train.hooks import Hook
from spmdcomm.train.loop import Preempted, fit
from spmdcomm.train.memory import StateMemory, optimizer_state_bytes
from spmdcomm.train.state import TrainState
from spmdcomm.train.train_step import TrainStep, make_train_step, masked_mean
from spmdcomm.train.weighted import Weighted, weighted

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DDP",
    "STRATEGIES",
    "Strategy",
    "ReduceContext",
    "TreeLayout",
    "StateMemory",
    "MeshRoles",
    "Pipeline",
    "PipelineStack",
    "Schedule",
    "ContextParallel",
    "context_attention",
    "context_positions",
    "ZeRO1",
    "ZeRO2",
    "FSDP",
    "EvalStep",
    "TrainState",
    "TrainStep",
    "fit",
    "Hook",
    "Preempted",
    "evaluate",
    "make_eval_step",
    "make_train_step",
    "masked_mean",
    "weighted",
    "Weighted",
    "SyncBatchNorm",
    "optimizer_state_bytes",
    "latest_checkpoint_step",
    "checkpoint_extra",
    "restore_checkpoint",
    "save_checkpoint",
    "CheckpointDamagedWarning",
]
