"""spmdcomm: torch.distributed-style collectives, syncs, a DDP train step and device prefetch for JAX."""

from jax.sharding import PartitionSpec as P

from spmdcomm.collectives import (
    REDUCE_OPS,
    all_gather,
    all_reduce,
    all_to_all,
    axis_index,
    axis_size,
    broadcast,
    gather,
    permute,
    pmax,
    pmean,
    pmin,
    psum,
    reduce,
    reduce_scatter,
    scatter,
    shift,
)
from spmdcomm.checkpoint import latest_checkpoint_step, restore_checkpoint, save_checkpoint
from spmdcomm.data import MaskedBatch, pad_batch, unpad
from spmdcomm.ddp import (
    DEFAULT_MAX_IN_FLIGHT,
    EvalStep,
    TrainState,
    TrainStep,
    fit,
    make_eval_step,
    make_train_step,
    masked_mean,
    nnx_loss_fn,
    optimizer_state_bytes,
)
from spmdcomm.errors import (
    AxisError,
    BackendError,
    ReplicaDivergenceError,
    ReplicatedReductionWarning,
    ShapeError,
    SpmdError,
)
from spmdcomm.mesh import (
    data_mesh,
    data_sharding,
    default_mesh,
    device_count,
    local_device_count,
    make_mesh,
    process_count,
    process_index,
    replicated_sharding,
)
from spmdcomm.replicas import Divergence, assert_replicated, check_replicas_in_sync
from spmdcomm.spmd import SpmdFunction, spmd

__version__ = "0.1.0"

__all__ = [
    "P",
    # collectives
    "REDUCE_OPS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_index",
    "axis_size",
    "broadcast",
    "gather",
    "permute",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "reduce",
    "reduce_scatter",
    "scatter",
    "shift",
    # batches
    "MaskedBatch",
    "pad_batch",
    "unpad",
    # data-parallel training
    "DEFAULT_MAX_IN_FLIGHT",
    "EvalStep",
    "TrainState",
    "TrainStep",
    "fit",
    "make_eval_step",
    "make_train_step",
    "masked_mean",
    "nnx_loss_fn",
    "optimizer_state_bytes",
    "Divergence",
    "assert_replicated",
    "check_replicas_in_sync",
    "latest_checkpoint_step",
    "restore_checkpoint",
    "save_checkpoint",
    # errors
    "AxisError",
    "BackendError",
    "ReplicaDivergenceError",
    "ReplicatedReductionWarning",
    "ShapeError",
    "SpmdError",
    # meshes and topology
    "data_mesh",
    "data_sharding",
    "default_mesh",
    "device_count",
    "local_device_count",
    "make_mesh",
    "process_count",
    "process_index",
    "replicated_sharding",
    # the wrapper
    "SpmdFunction",
    "spmd",
]
