"""Cross-process agreement on host input: the shape signatures every process has checked together.

Before host leaves become arrays that span processes, every process reports its leaves' names, shapes and dtypes
(or the error that stops it placing them) at one timed sync point, so that all processes raise the same error
instead of some of them waiting in a collective. :class:`Agreement` remembers the signatures agreed on, so a
signature seen before costs one dictionary lookup; :mod:`spmdcomm.data.placement` holds the rule it checks.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Sharding

from spmdcomm._cache import Cache
from spmdcomm.data.blocks import check_divisible
from spmdcomm.errors import ProcessMismatchError, ShapeError, describe
from spmdcomm.runtime.process import process_index
from spmdcomm.runtime.transport import Channel, exchange

__all__ = ["Agreement", "leaf_name"]


class Agreement:
    """The host-input shape signatures that every process has agreed on, and the sync channel that checks
    a new one.

    The main thread's calls share one (through :func:`spmdcomm.runtime.transport.exchange`); a placing thread keeps its
    own, on a :class:`~spmdcomm.runtime.transport.Channel` named the same on every process, so that its checks never
    pair up with the main thread's sync points. Every process must place the same sequence of signatures
    through an agreement, since each new one is a sync point.
    """

    def __init__(self, channel: Channel | None = None):
        self.channel = channel
        # Every process sees the same sequence of signatures, so all of them hit, miss and evict alike.
        self.known = Cache(limit=4096)

    def global_shapes(
        self,
        fn: str,
        hosts: Sequence[np.ndarray],
        shardings: Sequence[Sharding],
        names: Callable[[], Sequence[str]],
        host_input: str,
        timeout: float,
    ) -> list[tuple[int, ...]]:
        """The global shapes of host leaves on shardings that span processes, agreed by every process."""
        key = (host_input, tuple((s, x.shape, x.dtype) for x, s in zip(hosts, shardings, strict=True)))
        hit = self.known.get(key)
        if hit is not None:
            return hit
        local = host_input == "local"
        problem, shapes = None, []
        try:
            for i, (x, s) in enumerate(zip(hosts, shardings, strict=True)):
                shapes.append(check_divisible(fn, functools.partial(leaf_name, names, i), x.shape, s, local=local))
        except ShapeError as e:
            problem = e
        # Every process reports its problem (if any) and its leaves before anyone moves data, so that all of
        # them raise the same error instead of leaving the others in a collective.
        mine = {
            "error": None if problem is None else str(problem),
            "leaves": [[n, list(x.shape), str(x.dtype)] for n, x in zip(names(), hosts, strict=True)],
        }
        got = self._exchange(fn, mine, timeout)
        if problem is not None:
            raise problem
        for p, other in enumerate(got):
            if other["error"]:
                raise ShapeError(
                    describe(
                        fn,
                        f"process {p} cannot place its host input, so process {process_index()} stops too. "
                        f"Its error: {other['error']}",
                    )
                )
        _check_same_leaves(fn, host_input, got)
        return self.known.put(key, shapes)

    def refuse(self, fn: str, problem: Exception, timeout: float) -> None:
        """Tells the other processes, at the sync point where they check their host input, that this process
        cannot place its own (``problem``), so that they raise too instead of waiting in a collective."""
        self._exchange(fn, {"error": str(problem), "leaves": []}, timeout)

    def _exchange(self, fn: str, report: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        send = self.channel.exchange if self.channel is not None else exchange
        got = send(fn, f"{fn}: host input check", json.dumps(report).encode(), timeout=timeout)
        return [json.loads(b) for b in got]


def leaf_name(names: Callable[[], Sequence[str]], i: int) -> str:
    """``names()[i]``. Bound with ``functools.partial``, it stands for a leaf's name in a message: leaf names are
    built only when an error needs one, so they are passed as this function, not as text."""
    return names()[i]


# ---------------------------------------------------------------------------------------------------------


def _check_same_leaves(fn: str, host_input: str, got: list[dict[str, Any]]) -> None:
    """Raises :class:`ProcessMismatchError` naming the first leaf whose name, shape or dtype differs."""
    first = [g["leaves"] for g in got]
    if all(leaves == first[0] for leaves in first):
        return
    count = max(len(leaves) for leaves in first)
    for j in range(count):
        column = [leaves[j] if j < len(leaves) else None for leaves in first]
        if any(c != column[0] for c in column):
            break
    names = {c[0] for c in column if c is not None}
    if len(names) > 1 or any(c is None for c in column):
        seen = "; ".join(f"process {p}: {'no leaf' if c is None else c[0]}" for p, c in enumerate(column))
        message = f"processes passed trees with different leaves at position {j} ({seen})."
        leaf = None
    else:
        rows = [c for c in column if c is not None]  # all of them: every process has a leaf here (checked above)
        seen = ", ".join(f"process {p} {tuple(c[1])} {c[2]}" for p, c in enumerate(rows))
        rule = (
            "with host_input='local' each process passes its own rows and the global array is their "
            "concatenation, so every process must pass the same local shape"
            if host_input == "local"
            else "with host_input='global' every process passes the same full value"
        )
        message = f"processes passed different shapes or dtypes: {seen}; {rule}."
        leaf = next(iter(names))
    raise ProcessMismatchError(
        describe(
            fn,
            message,
            leaf=leaf,
            fix="give every process batches of the same shapes and dtypes (pad the last, short batch with "
            "spmdcomm.pad_batch, or use ShardedSampler, which gives every process the same batch count and size).",
        )
    )
