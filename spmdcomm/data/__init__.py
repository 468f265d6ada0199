"""Layer 3, data: padded batches, samplers, placing host input on devices, prefetching and the loader."""

from spmdcomm.data.batches import MaskedBatch, ShardedSampler, join_batches, pad_batch, take_batches, unpad
from spmdcomm.data.loader import Loader
from spmdcomm.data.placement import shard_batch
from spmdcomm.data.prefetch import Prefetcher, PrefetchStats, aligned_empty, prefetch_to_device

__all__ = [
    "MaskedBatch",
    "pad_batch",
    "unpad",
    "shard_batch",
    "ShardedSampler",
    "take_batches",
    "join_batches",
    "Loader",
    "prefetch_to_device",
    "aligned_empty",
    "Prefetcher",
    "PrefetchStats",
]
