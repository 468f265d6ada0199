"""spmdcomm: torch.distributed-style collectives, syncs, a DDP train step and device prefetch for JAX.

``__all__`` holds what ordinary use needs (docs/api.md says why each name is there). Types that the library builds
for you and tables of its constants stay in their layer, for annotations and tools: e.g.
``spmdcomm.train.TrainStep`` (what ``make_train_step`` returns), ``spmdcomm.data.Prefetcher``,
``spmdcomm.collectives.SpmdFunction``, ``spmdcomm.collectives.REDUCE_OPS``.
"""

from typing import TYPE_CHECKING, Any

from spmdcomm._version import __version__ as __version__  # written in _version.py only

# The layers load on the first use of a public name (``__getattr__`` below), not at ``import spmdcomm``: the launcher
# (``python -m spmdcomm.launch``, which imports this package first) then starts no JAX. For type checkers and
# readers, the names and where they come from:
if TYPE_CHECKING:
    from jax.sharding import PartitionSpec as P

    from spmdcomm.collectives import (
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
        spmd,
    )
    from spmdcomm.data import (
        Loader,
        MaskedBatch,
        ShardedSampler,
        join_batches,
        pad_batch,
        prefetch_to_device,
        shard_batch,
        take_batches,
        unpad,
    )
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
    from spmdcomm.explain import explain
    from spmdcomm.nnx import nnx_loss_fn, nnx_metric_fn
    from spmdcomm.reliability import (
        PREEMPTED_EXIT_CODE,
        STUCK_EXIT_CODE,
        MetricsWriter,
        PhaseTimer,
        Preemption,
        StuckStepError,
        Watchdog,
    )
    from spmdcomm.runtime import (
        all_gather_object,
        assert_replicated,
        barrier,
        broadcast_object,
        check_replicas_in_sync,
        data_mesh,
        data_sharding,
        default_mesh,
        device_count,
        host_all_gather,
        host_all_reduce,
        host_broadcast,
        initialize,
        is_initialized,
        is_main_process,
        local_device_count,
        local_rank,
        main_process_first,
        make_mesh,
        process_count,
        process_devices,
        process_index,
        replicated_sharding,
        restart_count,
        set_debug,
        sync_devices,
    )
    from spmdcomm.train import (
        DDP,
        FSDP,
        CheckpointDamagedWarning,
        Hook,
        Preempted,
        SyncBatchNorm,
        TrainState,
        ZeRO1,
        ZeRO2,
        checkpoint_extra,
        evaluate,
        fit,
        latest_checkpoint_step,
        make_eval_step,
        make_train_step,
        masked_mean,
        optimizer_state_bytes,
        restore_checkpoint,
        save_checkpoint,
    )

__all__ = [
    # the SPMD wrapper and partition specs
    "spmd",
    "P",
    # device collectives, inside spmd or shard_map
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
    # batches and the input pipeline
    "MaskedBatch",
    "pad_batch",
    "unpad",
    "shard_batch",
    "ShardedSampler",
    "take_batches",
    "join_batches",
    "Loader",
    "prefetch_to_device",
    # data-parallel training
    "DDP",
    "ZeRO1",
    "ZeRO2",
    "FSDP",
    "TrainState",
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
    "assert_replicated",
    "check_replicas_in_sync",
    "latest_checkpoint_step",
    "checkpoint_extra",
    "restore_checkpoint",
    "save_checkpoint",
    "CheckpointDamagedWarning",
    # what a compiled step communicates and holds
    "explain",
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
    "StuckStepError",
    "STUCK_EXIT_CODE",
    "Preemption",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "PhaseTimer",
    "MetricsWriter",
    # debug mode
    "set_debug",
]

# The layers that hold the public names, loaded together on the first use of one.
_LAYERS = ("errors", "collectives", "data", "explain", "nnx", "reliability", "runtime", "train")
# Subpackages reachable as attributes before anything imported them (``sc.nnx.SyncBatchNorm``).
_SUBPACKAGES = ("collectives", "data", "explain", "launch", "nnx", "reliability", "runtime", "train")

if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt ``sc.name`` stays an error there

    def __getattr__(name: str) -> Any:
        """Imports the layers on the first use of a public name (PEP 562), then answers as a plain attribute."""
        import importlib

        if name in _SUBPACKAGES:
            return importlib.import_module(f"spmdcomm.{name}")
        if name not in __all__:
            raise AttributeError(f"module 'spmdcomm' has no attribute {name!r}")
        from jax.sharding import PartitionSpec

        layers = [importlib.import_module(f"spmdcomm.{layer}") for layer in _LAYERS]
        found = {"P": PartitionSpec}
        found.update({n: getattr(layer, n) for layer in layers for n in getattr(layer, "__all__", ()) if n in __all__})
        globals().update(found)
        return found[name]

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))
