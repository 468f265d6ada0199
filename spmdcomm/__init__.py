"""spmdcomm: torch.distributed-style collectives, syncs, a DDP train step and device prefetch for JAX."""

from jax.sharding import PartitionSpec as P

from spmdcomm._version import __version__ as __version__  # written in _version.py only
from spmdcomm.batchnorm import SyncBatchNorm
from spmdcomm.checkpoint import (
    CheckpointDamagedWarning,
    checkpoint_extra,
    latest_checkpoint_step,
    restore_checkpoint,
    save_checkpoint,
)
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
    scan,
    scatter,
    shift,
)
from spmdcomm.data import (
    MaskedBatch,
    ShardedSampler,
    join_batches,
    pad_batch,
    take_batches,
    unpad,
)
from spmdcomm.debug import enabled as debug_enabled
from spmdcomm.debug import set_debug
from spmdcomm.errors import (
    AxisError,
    BackendError,
    BarrierTimeoutError,
    CoordinatorError,
    DeletedArrayError,
    DistributedError,
    ProcessMismatchError,
    RemoteProcessError,
    ReplicaDivergenceError,
    ReplicatedReductionWarning,
    ShapeError,
    SpmdError,
    TracedCallError,
)
from spmdcomm.eval_step import EvalStep, evaluate, make_eval_step
from spmdcomm.explain import COLLECTIVE_KINDS, Collective, DeviceMemory, Explanation, explain
from spmdcomm.loader import Loader
from spmdcomm.loop import Hook, Preempted, fit
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
from spmdcomm.metrics import MetricsWriter
from spmdcomm.nnx import nnx_loss_fn, nnx_metric_fn
from spmdcomm.phases import PHASE_DESCRIPTIONS, PHASES, PhaseTimer
from spmdcomm.placement import shard_batch
from spmdcomm.preemption import PREEMPTED_EXIT_CODE, Preemption
from spmdcomm.prefetch import Prefetcher, PrefetchStats, aligned_empty, prefetch_to_device
from spmdcomm.replicas import Divergence, assert_replicated, check_replicas_in_sync
from spmdcomm.runtime import (
    initialize,
    is_initialized,
    is_main_process,
    local_rank,
    process_devices,
    restart_count,
)
from spmdcomm.spmd import SpmdFunction, spmd
from spmdcomm.strategies import DDP, FSDP, STRATEGIES, Strategy, ZeRO1, ZeRO2
from spmdcomm.sync import (
    all_gather_object,
    barrier,
    broadcast_object,
    host_all_gather,
    host_all_reduce,
    host_broadcast,
    main_process_first,
    sync_devices,
)
from spmdcomm.train_state import TrainState, optimizer_state_bytes
from spmdcomm.train_step import DEFAULT_MAX_IN_FLIGHT, TrainStep, make_train_step, masked_mean
from spmdcomm.watchdog import STUCK_EXIT_CODE, Watchdog

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
    "scan",
    # batches
    "MaskedBatch",
    "pad_batch",
    "unpad",
    "shard_batch",
    "ShardedSampler",
    "take_batches",
    "join_batches",
    "Loader",
    # prefetch
    "prefetch_to_device",
    "aligned_empty",
    "Prefetcher",
    "PrefetchStats",
    # data-parallel training
    "DEFAULT_MAX_IN_FLIGHT",
    "DDP",
    "STRATEGIES",
    "Strategy",
    "ZeRO1",
    "ZeRO2",
    "FSDP",
    "EvalStep",
    "TrainState",
    "TrainStep",
    "fit",
    "Hook",
    "evaluate",
    "make_eval_step",
    "make_train_step",
    "masked_mean",
    "SyncBatchNorm",
    "nnx_loss_fn",
    "nnx_metric_fn",
    "optimizer_state_bytes",
    "Divergence",
    "assert_replicated",
    "check_replicas_in_sync",
    "latest_checkpoint_step",
    "checkpoint_extra",
    "restore_checkpoint",
    "save_checkpoint",
    "CheckpointDamagedWarning",
    # what a compiled step communicates and holds
    "explain",
    "Explanation",
    "Collective",
    "DeviceMemory",
    "COLLECTIVE_KINDS",
    # errors
    "AxisError",
    "BackendError",
    "ReplicaDivergenceError",
    "ReplicatedReductionWarning",
    "ShapeError",
    "SpmdError",
    "TracedCallError",
    "DeletedArrayError",
    "DistributedError",
    "CoordinatorError",
    "BarrierTimeoutError",
    "ProcessMismatchError",
    "RemoteProcessError",
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
    # multi-process runtime
    "initialize",
    "is_initialized",
    "is_main_process",
    "local_rank",
    "process_devices",
    "restart_count",
    # barriers and host-level collectives across processes
    "barrier",
    "sync_devices",
    "main_process_first",
    "host_all_reduce",
    "host_all_gather",
    "host_broadcast",
    "broadcast_object",
    "all_gather_object",
    # failure recovery: stuck steps, preemption, where the time goes
    "Watchdog",
    "STUCK_EXIT_CODE",
    "Preemption",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "PhaseTimer",
    "PHASES",
    "PHASE_DESCRIPTIONS",
    "MetricsWriter",
    # debug mode
    "set_debug",
    "debug_enabled",
    # the wrapper
    "SpmdFunction",
    "spmd",
]
