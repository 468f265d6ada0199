"""The time a training loop spent waiting for its batches, as :func:`spmdcomm.prefetch_to_device` records it."""

from __future__ import annotations

import collections
import dataclasses

__all__ = ["PrefetchStats", "WAIT_HISTORY"]

# How many recent per-step waits PrefetchStats.waits keeps.
WAIT_HISTORY = 4096


@dataclasses.dataclass
class PrefetchStats:
    """Time the training loop spent waiting for its next batch (seconds).

    ``total_wait`` and ``max_wait`` cover all ``steps``; ``mean_wait`` is their average.

    Attributes:
      steps: the number of batches handed to the loop so far.
      total_wait: the seconds waited over all ``steps``.
      last_wait: the latest step's wait, in seconds.
      max_wait: the longest wait of any step, in seconds.
      waits: the most recent per-step waits in seconds, oldest first (up to ``WAIT_HISTORY``, 4096).
    """

    steps: int = 0
    total_wait: float = 0.0
    last_wait: float = 0.0
    max_wait: float = 0.0
    waits: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WAIT_HISTORY))

    @property
    def mean_wait(self) -> float:
        """Average wait per step."""
        return self.total_wait / self.steps if self.steps else 0.0

    def record(self, wait: float) -> None:
        """Adds one step's wait.

        Args:
          wait: the seconds the loop waited for this step's batch.
        """
        self.steps += 1
        self.total_wait += wait
        self.last_wait = wait
        self.max_wait = max(self.max_wait, wait)
        self.waits.append(wait)
