"""Layer 7 (beside ``spmdcomm.train``), checkpoints: saving and restoring a ``TrainState`` with orbax-checkpoint,
choosing the newest intact checkpoint, what it holds of a state, and saves written in the background
(:class:`CheckpointSave`)."""

from spmdcomm.checkpoint._async import CheckpointSave
from spmdcomm.checkpoint.checkpoint import (
    checkpoint_extra,
    latest_checkpoint_step,
    restore_checkpoint,
    save_checkpoint,
)
from spmdcomm.errors import CheckpointDamagedWarning

__all__ = [
    "latest_checkpoint_step",
    "checkpoint_extra",
    "restore_checkpoint",
    "save_checkpoint",
    "CheckpointDamagedWarning",
    "CheckpointSave",
]
