"""Layer 7 (beside ``spmdcomm.train``), checkpoints: saving and restoring a ``TrainState`` with orbax-checkpoint,
choosing the newest intact checkpoint, and what it holds of a state."""

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
]
