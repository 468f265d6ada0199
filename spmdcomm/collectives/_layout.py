"""Which tokens of a sequence split along a mesh axis each device holds (the layout), for the attention kernels of
:mod:`spmdcomm.collectives.attention` and ``sc.sequence_positions``: the global positions of a device's tokens, and
which layout a call means.

A call names its layout or leaves it out (None). Inside the train or eval step of a state with
``context=sc.ContextParallel(axis, layout)``, the step records its split while it traces (:func:`step_split`): a call
over that axis without a layout takes the step's, and one whose layout differs raises (the step reorders the tokens
of every batch leaf, so another layout's masks and positions would be wrong without any error). Elsewhere, and over
another axis, None means ``"contiguous"``, what ``P(None, axis)`` gives a sequence stored in order.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm.collectives._common import bound_size
from spmdcomm.errors import ShapeError, SpmdError, describe

__all__ = ["LAYOUTS", "Layout", "positions", "resolve", "step_split"]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")

#: ``(axis, layout)`` of the context split of the train or eval step being traced (None outside one): the layout a
#: kernel or ``sequence_positions`` over that axis takes when given none, and the only one it accepts.
_STEP_SPLIT: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("spmdcomm_split", default=None)


@contextlib.contextmanager
def step_split(split: tuple[str, str] | None) -> Iterator[None]:
    """Within the block, the tokens of axis ``split[0]`` are held in layout ``split[1]`` (the steps of a state with
    ``context=sc.ContextParallel(...)`` set it while tracing, through ``spmdcomm.parallel.context.context_split``);
    None: no step's split."""
    token = _STEP_SPLIT.set(split)
    try:
        yield
    finally:
        _STEP_SPLIT.reset(token)


def resolve(fn: str, axis: str, layout: str | None) -> str:
    """The layout of the tokens of ``axis``: ``layout``, or where None the traced step's (if it splits ``axis``),
    else ``"contiguous"``; an explicit layout that contradicts the step's raises."""
    if layout is not None and layout not in LAYOUTS:
        raise SpmdError(
            describe(
                fn,
                f"layout={layout!r} is not a layout.",
                fix='layout=None (the train step\'s layout, else "contiguous"), "contiguous" or "zigzag".',
            )
        )
    split = _STEP_SPLIT.get()
    step = split[1] if split is not None and split[0] == axis else None
    if layout is None:
        return step or "contiguous"
    if step is not None and layout != step:
        raise SpmdError(
            describe(
                fn,
                f"layout={layout!r}, but the train step being traced holds the tokens of axis {axis!r} in the "
                f"{step!r} layout (its sc.ContextParallel): masks and positions in the {layout!r} layout would "
                "be wrong without an error.",
                fix=f"leave layout out (the step's {step!r} is the default inside it), or create the state with "
                f"context=sc.ContextParallel(axis={axis!r}, layout={layout!r}).",
            )
        )
    return layout


def positions(fn: str, length: int, axis: str, layout: str) -> jax.Array:
    """The global positions, int32 ``[length]``, of this device's ``length`` tokens of axis ``axis`` in ``layout``
    (a resolved one)."""
    n = bound_size(fn, axis, argument="axis")
    i = lax.axis_index(axis)
    if layout == "contiguous":
        return (i * length + jnp.arange(length)).astype(jnp.int32)
    if length % 2:
        raise ShapeError(
            describe(
                fn,
                f"the zig-zag layout gives each device two equal chunks, but it holds {length} tokens (odd) of "
                f"axis {axis!r} of size {n}.",
                fix=f"pad the sequence to a multiple of 2 n = {2 * n} tokens (mask the padding with kv_mask).",
            )
        )
    half = length // 2
    return jnp.concatenate([i * half + jnp.arange(half), (2 * n - 1 - i) * half + jnp.arange(half)]).astype(jnp.int32)
