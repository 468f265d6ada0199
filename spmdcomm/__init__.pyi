"""The public names of ``import spmdcomm as sc``, each on one line: the one list of them.

Type checkers read this stub instead of ``__init__.py``; ``__init__.py`` reads it at import (with ``ast``) to build
``__all__`` (every ``from MODULE import NAME as NAME`` line, in this order), ``dir(spmdcomm)`` and the lazy
``__getattr__`` that imports each name's module on the first use of a public name (``import spmdcomm`` itself starts
no JAX). The ``# comment`` above each group is its heading in docs/api.md, which says why each name is public.

Each line imports a name from the public module that defines it. The ``from spmdcomm import LAYER as LAYER`` lines
at the end are the subpackages reachable as attributes before anything imported them (``sc.nnx.SyncBatchNorm``);
they are not in ``__all__``.
"""

# The groups below are in docs/api.md's order, not sorted: import sorting is off for this file.
# ruff: noqa: I001

from spmdcomm._version import __version__ as __version__

# the SPMD wrapper and partition specs
from spmdcomm.collectives.spmd import spmd as spmd
from jax import P as P

# device collectives, inside spmd or shard_map
from spmdcomm.collectives.exchanges import all_gather as all_gather
from spmdcomm.collectives.reductions import all_reduce as all_reduce
from spmdcomm.collectives.exchanges import all_to_all as all_to_all
from spmdcomm.collectives.attention import all_to_all_attention as all_to_all_attention
from spmdcomm.collectives.reductions import axis_index as axis_index
from spmdcomm.collectives.reductions import axis_size as axis_size
from spmdcomm.collectives.rooted import broadcast as broadcast
from spmdcomm.collectives.rooted import gather as gather
from spmdcomm.collectives.p2p import permute as permute
from spmdcomm.collectives.reductions import pmax as pmax
from spmdcomm.collectives.reductions import pmean as pmean
from spmdcomm.collectives.reductions import pmin as pmin
from spmdcomm.collectives.reductions import psum as psum
from spmdcomm.collectives.ragged import ragged_all_to_all as ragged_all_to_all
from spmdcomm.collectives.rooted import reduce as reduce
from spmdcomm.collectives.exchanges import reduce_scatter as reduce_scatter
from spmdcomm.collectives.attention import ring_attention as ring_attention
from spmdcomm.collectives.rooted import scatter as scatter
from spmdcomm.collectives.p2p import shift as shift
from spmdcomm.collectives.p2p import scan as scan

# batches and the input pipeline
from spmdcomm.data.batches import MaskedBatch as MaskedBatch
from spmdcomm.data.batches import pad_batch as pad_batch
from spmdcomm.data.batches import unpad as unpad
from spmdcomm.data.placement import shard_batch as shard_batch
from spmdcomm.data.sampler import ShardedSampler as ShardedSampler
from spmdcomm.data.batches import take_batches as take_batches
from spmdcomm.data.batches import join_batches as join_batches
from spmdcomm.data.loader import Loader as Loader
from spmdcomm.data.iterators import IteratorLoader as IteratorLoader
from spmdcomm.data.prefetch import prefetch_to_device as prefetch_to_device

# data-parallel training
from spmdcomm.parallel.data.strategies import DDP as DDP
from spmdcomm.parallel.data.strategies import ZeRO1 as ZeRO1
from spmdcomm.parallel.data.strategies import ZeRO2 as ZeRO2
from spmdcomm.parallel.data.fsdp import FSDP as FSDP
from spmdcomm.train.state import TrainState as TrainState
from spmdcomm.train.loop import fit as fit
from spmdcomm.train.hooks import Hook as Hook
from spmdcomm.train.eval_step import evaluate as evaluate
from spmdcomm.train.eval_step import make_eval_step as make_eval_step
from spmdcomm.train.train_step import make_train_step as make_train_step
from spmdcomm.train.train_step import masked_mean as masked_mean
from spmdcomm.train.weighted import weighted as weighted
from spmdcomm.train.batchnorm import SyncBatchNorm as SyncBatchNorm
from spmdcomm.nnx.adapters import nnx_loss_fn as nnx_loss_fn
from spmdcomm.nnx.adapters import nnx_metric_fn as nnx_metric_fn
from spmdcomm.train.memory import optimizer_state_bytes as optimizer_state_bytes
from spmdcomm.runtime.replicas import assert_replicated as assert_replicated
from spmdcomm.runtime.replicas import check_replicas_in_sync as check_replicas_in_sync
from spmdcomm.checkpoint.checkpoint import latest_checkpoint_step as latest_checkpoint_step
from spmdcomm.checkpoint.checkpoint import checkpoint_extra as checkpoint_extra
from spmdcomm.checkpoint.checkpoint import restore_checkpoint as restore_checkpoint
from spmdcomm.checkpoint.checkpoint import save_checkpoint as save_checkpoint
from spmdcomm.errors import CheckpointDamagedWarning as CheckpointDamagedWarning

# pipeline parallelism
from spmdcomm.parallel.pipeline.pipeline import Pipeline as Pipeline
from spmdcomm.parallel.pipeline.stack import PipelineStack as PipelineStack

# context parallelism
from spmdcomm.parallel.context import ContextParallel as ContextParallel
from spmdcomm.parallel.context import context_attention as context_attention
from spmdcomm.parallel.context import context_positions as context_positions
from spmdcomm.collectives.attention import sequence_positions as sequence_positions
from spmdcomm.collectives.attention import zigzag_order as zigzag_order

# expert parallelism
from spmdcomm.parallel.expert.layer import MoE as MoE
from spmdcomm.parallel.expert.layer import ExpertParallel as ExpertParallel
from spmdcomm.parallel.expert.metrics import moe_metrics as moe_metrics

# what a compiled step communicates and holds
from spmdcomm.explain.report import explain as explain

# errors
from spmdcomm.errors import AxisError as AxisError
from spmdcomm.errors import BackendError as BackendError
from spmdcomm.errors import ReplicaDivergenceError as ReplicaDivergenceError
from spmdcomm.errors import ReplicatedReductionWarning as ReplicatedReductionWarning
from spmdcomm.errors import MissingLogicalRuleWarning as MissingLogicalRuleWarning
from spmdcomm.errors import ShapeError as ShapeError
from spmdcomm.errors import SpmdError as SpmdError
from spmdcomm.errors import TracedCallError as TracedCallError
from spmdcomm.errors import DeletedArrayError as DeletedArrayError
from spmdcomm.errors import DistributedError as DistributedError
from spmdcomm.errors import CoordinatorError as CoordinatorError
from spmdcomm.errors import BarrierTimeoutError as BarrierTimeoutError
from spmdcomm.errors import ProcessMismatchError as ProcessMismatchError
from spmdcomm.errors import RemoteProcessError as RemoteProcessError

# meshes and topology
from spmdcomm.runtime.mesh import data_mesh as data_mesh
from spmdcomm.runtime.mesh import data_sharding as data_sharding
from spmdcomm.runtime.mesh import default_mesh as default_mesh
from spmdcomm.runtime.process import device_count as device_count
from spmdcomm.runtime.process import local_device_count as local_device_count
from spmdcomm.runtime.mesh import make_mesh as make_mesh
from spmdcomm.runtime.process import process_count as process_count
from spmdcomm.runtime.process import process_index as process_index
from spmdcomm.runtime.mesh import replicated_sharding as replicated_sharding

# multi-process runtime
from spmdcomm.runtime.distributed import initialize as initialize
from spmdcomm.runtime.distributed import is_initialized as is_initialized
from spmdcomm.runtime.process import is_main_process as is_main_process
from spmdcomm.runtime.process import local_rank as local_rank
from spmdcomm.runtime.process import process_devices as process_devices
from spmdcomm.runtime.process import restart_count as restart_count

# barriers and host-level collectives across processes
from spmdcomm.runtime.sync import barrier as barrier
from spmdcomm.runtime.sync import sync_devices as sync_devices
from spmdcomm.runtime.sync import main_process_first as main_process_first
from spmdcomm.runtime.host_collectives import host_all_reduce as host_all_reduce
from spmdcomm.runtime.host_collectives import host_all_gather as host_all_gather
from spmdcomm.runtime.host_collectives import host_broadcast as host_broadcast
from spmdcomm.runtime.host_collectives import broadcast_object as broadcast_object
from spmdcomm.runtime.host_collectives import all_gather_object as all_gather_object

# failure recovery: stuck steps, preemption, where the time goes
from spmdcomm.reliability.watchdog import Watchdog as Watchdog
from spmdcomm.reliability.watchdog import StuckStepError as StuckStepError
from spmdcomm.reliability.watchdog import STUCK_EXIT_CODE as STUCK_EXIT_CODE
from spmdcomm.reliability.preemption import Preemption as Preemption
from spmdcomm.reliability.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from spmdcomm.train.loop import Preempted as Preempted
from spmdcomm.reliability.phases import PhaseTimer as PhaseTimer
from spmdcomm.reliability.metrics import MetricsWriter as MetricsWriter

# debug mode
from spmdcomm.runtime.debug import set_debug as set_debug

# subpackages
from spmdcomm import checkpoint as checkpoint
from spmdcomm import collectives as collectives
from spmdcomm import data as data
from spmdcomm import launch as launch
from spmdcomm import nnx as nnx
from spmdcomm import parallel as parallel
from spmdcomm import reliability as reliability
from spmdcomm import runtime as runtime
from spmdcomm import train as train
