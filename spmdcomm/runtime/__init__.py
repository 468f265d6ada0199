"""Layer 1, the runtime: joining a job, meshes and shardings, host-level syncs, replica checks and debug mode."""

from spmdcomm.runtime.debug import enabled as debug_enabled
from spmdcomm.runtime.debug import set_debug
from spmdcomm.runtime.distributed import initialize, is_initialized
from spmdcomm.runtime.host_collectives import (
    all_gather_object,
    broadcast_object,
    host_all_gather,
    host_all_reduce,
    host_broadcast,
)
from spmdcomm.runtime.mesh import data_mesh, data_sharding, default_mesh, make_mesh, replicated_sharding
from spmdcomm.runtime.process import (
    device_count,
    is_main_process,
    local_device_count,
    local_rank,
    process_count,
    process_devices,
    process_index,
    restart_count,
)
from spmdcomm.runtime.replicas import Divergence, assert_replicated, check_replicas_in_sync
from spmdcomm.runtime.sync import barrier, main_process_first, sync_devices

__all__ = [
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
    # replicas that should be identical
    "Divergence",
    "assert_replicated",
    "check_replicas_in_sync",
    # debug mode
    "set_debug",
    "debug_enabled",
]
