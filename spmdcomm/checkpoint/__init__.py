"""Layer 7 (below ``spmdcomm.train``, whose ``fit`` saves checkpoints), checkpoints: saving and restoring a
``TrainState`` with orbax-checkpoint, choosing the newest intact checkpoint, what it holds of a state (read through
its attributes, :class:`~spmdcomm.checkpoint._arrays.CheckpointState`, never its class), and saves written in the
background (:class:`CheckpointSave`)."""

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
