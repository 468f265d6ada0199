"""Layer 3, data: padded batches, samplers, placing host input on devices, prefetching and the loader."""

from spmdcomm.data.batches import MaskedBatch, join_batches, pad_batch, take_batches, unpad
from spmdcomm.data.iterators import IteratorLoader
from spmdcomm.data.loader import Loader
from spmdcomm.data.placement import shard_batch
from spmdcomm.data.prefetch import Prefetcher, prefetch_to_device
from spmdcomm.data.sampler import ShardedSampler
from spmdcomm.data.staging import aligned_empty
from spmdcomm.data.stats import PrefetchStats

__all__ = [
    "MaskedBatch",
    "pad_batch",
    "unpad",
    "shard_batch",
    "ShardedSampler",
    "take_batches",
    "join_batches",
    "Loader",
    "IteratorLoader",
    "prefetch_to_device",
    "aligned_empty",
    "Prefetcher",
    "PrefetchStats",
]
