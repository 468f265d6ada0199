"""The capacity rule of a mixture of experts: how many assignments an expert takes (:func:`expert_capacity`, also
on the devices from a count of real tokens: :func:`capacity_of`) and each assignment's place in the global drop order
(:func:`assignment_slots`), also when every sequence is split over a context axis (:class:`SequenceSplit`)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdcomm.collectives.exchanges import all_gather
from spmdcomm.errors import ShapeError, describe

__all__ = ["Slots", "SequenceSplit", "expert_capacity", "capacity_of", "assignment_slots", "axes_size", "psum_over"]


class Slots(NamedTuple):
    """Each assignment's place: ``global_slot`` ``[T, k]`` among the global batch's assignments to its expert,
    ``group_slot`` among those of the devices of the expert axis that share this device's other coordinates, and
    ``counts`` ``[E]``, the global batch's assignments to each expert (before any drop)."""

    global_slot: jax.Array
    group_slot: jax.Array
    counts: jax.Array


class SequenceSplit(NamedTuple):
    """Where this device's tokens lie when every sequence is split over a context axis
    (:class:`~spmdcomm.ContextParallel`): its ``T`` tokens are ``rows x length x inner`` in row-major order, the
    ``length`` positions it holds of each of ``rows`` sequences, in ``layout`` over ``axis`` (``"contiguous"``: chunk
    ``i`` of ``c`` on device ``i``; ``"zigzag"``: chunks ``i`` and ``2c - 1 - i`` of ``2c``, in that order), and
    ``inner = T / (rows * length)`` tokens at each position (the dimensions between the positions and the
    features)."""

    axis: str
    layout: str
    rows: int
    length: int

    def chunks(self) -> int:
        """The chunks of each sequence one device holds: 2 in the zig-zag layout, 1 in the contiguous one."""
        return 2 if self.layout == "zigzag" else 1

    @classmethod
    def of(cls, fn: str, axis: str, layout: str, shape: tuple[int, ...], capacity_factor: float) -> SequenceSplit:
        """The split of a layer input of ``shape``, ``[rows, tokens, ..., d]`` as a context-parallel step gives it;
        :class:`~spmdcomm.errors.ShapeError` for fewer than 3 dimensions, where no dimension holds the positions."""
        if len(shape) < 3:
            raise ShapeError(
                describe(
                    fn,
                    f"capacity_factor={capacity_factor!r} in a step that splits every sequence over {axis!r}, and an "
                    f"input of shape {shape}: the capacity drops in the sequences' token order, so the layer needs "
                    "each device's positions of every sequence on dimension 1.",
                    fix="give the layer its input as [rows, tokens, ..., d], as the step split the batch (or use "
                    "the dropless layer, capacity_factor=None, which takes any shape).",
                )
            )
        return cls(axis, layout, shape[0], shape[1])


def expert_capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """The GShard/Switch capacity: ``ceil(capacity_factor * tokens * k / experts)`` assignments per expert, at
    least 1 and at most ``tokens`` (a token chooses an expert once), for ``tokens`` real tokens in the global batch.

    Exact: ``capacity_factor`` is read as the nearest fraction with a denominator of at most 1000 (``1.1`` is
    ``11 / 10``, not the binary float just above it, which would make 1.1 * 100 / 2 round up to 56), and the rest
    is integer arithmetic, so the capacity a masked batch computes on the devices from its count of real tokens
    (:func:`capacity_of`) is this one.

    Examples:
      >>> expert_capacity(64, 8, 2, 1.25), expert_capacity(100, 2, 1, 1.1)
      (20, 55)
    """
    a, b = _factor(capacity_factor)
    return max(1, min(tokens, -(-(a * tokens * k) // (b * experts))))


def capacity_of(real: jax.Array, experts: int, k: int, capacity_factor: float) -> jax.Array:
    """:func:`expert_capacity` of ``real`` tokens (an int32 scalar), on the devices and exactly: a float32 estimate
    of the quotient, corrected by the remainder, computed in wrapping int32 arithmetic, which is exact because the
    true remainder is small."""
    a, b = _factor(capacity_factor)
    num, den = a * k, b * experts
    guess = jnp.floor(real.astype(jnp.float32) * (num / den)).astype(jnp.int32)
    rest = real * num - guess * den  # int32 wraps; the true value is a few `den` at most, so this is it
    quotient = guess + jnp.floor_divide(rest, den)
    ceil = quotient + (jnp.mod(rest, den) > 0)
    return jnp.maximum(1, jnp.minimum(real, ceil))


def assignment_slots(
    experts: jax.Array,
    num_experts: int,
    *,
    token_axes: tuple[str, ...] = (),
    axis_name: str | None = None,
    valid: jax.Array | None = None,
    sequence: SequenceSplit | None = None,
) -> Slots:
    """Each assignment's slot at its expert, in the drop order of the capacity rule.

    The order (GShard's): every token's first choice before any second choice, and within a choice the global
    batch's token order. With a capacity ``C``, an assignment is kept when its ``global_slot`` is below ``C``: one
    device applying the rule to the global batch drops the same ones. Costs two all-gathers of ``k * E`` integers.

    The global batch's token order is the devices' tokens in device order over ``token_axes``. With ``sequence``
    (every sequence split over a context axis, one of ``token_axes``), it is one device's order on the unsplit
    batch instead: the rows (in device order over the other token axes, then each device's rows in order), and
    within a row its positions in the original sequence order, whichever context device holds them and in whatever
    order (a zig-zag device holds two chunks far apart). Each assignment then also counts the same choice's
    assignments to its expert that the other context devices hold at earlier rows and positions: one all-reduce of
    ``rows * chunks * c * k * E`` integers over the context axis (``chunks * c`` the chunks of a sequence).

    Args:
      experts: ``[T, k]`` expert ids of this device's tokens.
      num_experts: ``E``.
      token_axes: the axes that split the tokens, in the global batch's order (empty on one device).
      axis_name: the expert axis (one of ``token_axes``), or ``None``: the group is then this device.
      valid: ``[T]``, the real tokens (``None``: all of them); the others take no slot and are not counted.
      sequence: how this device's tokens lie in sequences split over a context axis (:class:`SequenceSplit`), or
        ``None``: no axis splits the sequences.

    Returns:
      The :class:`Slots`. The ``group_slot`` keeps the device order over the expert axis and each device's own
      token order, which is the global order restricted to the group: each device holds its positions of a
      sequence in increasing order.
    """
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [T, k, E]
    if valid is not None:
        onehot = onehot * valid[:, None, None].astype(jnp.int32)
    local = onehot.sum(0)  # [k, E]
    earlier_tokens = ((jnp.cumsum(onehot, axis=0) - onehot) * onehot).sum(-1)  # [T, k]
    within = None if sequence is None else sequence.axis
    global_before, counts = _earlier(local, token_axes, within=within)
    global_slot = _pick(global_before, experts) + earlier_tokens
    if sequence is not None:
        global_slot = global_slot + _other_positions_before(onehot, experts, sequence)
    group_before, _ = _earlier(local, (axis_name,) if axis_name is not None else ())
    return Slots(global_slot, _pick(group_before, experts) + earlier_tokens, counts)


def axes_size(axes: tuple[str, ...]) -> int:
    """The devices of ``axes`` together (1 for none)."""
    return math.prod(lax.axis_size(a) for a in axes)


def psum_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``lax.psum`` over ``axes``; ``x`` itself for none."""
    return lax.psum(x, axes) if axes else x


def _factor(capacity_factor: float) -> tuple[int, int]:
    """``capacity_factor`` as ``(numerator, denominator)``, the nearest fraction with a denominator of at most 1000."""
    f = Fraction(capacity_factor).limit_denominator(1000)
    return f.numerator, f.denominator


def _earlier(local: jax.Array, axes: tuple[str, ...], *, within: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``(before [k, E], totals [E])``: the assignments that precede this device's choice-``r`` assignments to each
    expert (every earlier choice of every device, then choice ``r`` of the earlier devices), and each expert's
    total over ``axes``. With ``within`` (one of ``axes``: the context axis, whose devices hold the same rows), the
    earlier devices are those of earlier rows: earlier in device order over the other axes."""
    every = all_gather(local, axes, tiled=False) if axes else local[None]  # [devices, k, E], identical everywhere
    per_choice = every.sum(0)
    earlier_choices = jnp.cumsum(per_choice, axis=0) - per_choice
    if within is None or not axes:
        me = lax.axis_index(axes) if axes else 0
        earlier_devices = (jnp.cumsum(every, axis=0) - every)[me]
    else:
        sizes = [lax.axis_size(a) for a in axes]
        coords = np.indices(sizes).reshape(len(sizes), -1)  # each device's coordinates, row-major as the gather
        rest = [j for j, a in enumerate(axes) if a != within]
        block = np.zeros(coords.shape[1], int)  # each device's block of rows: its index over the other axes
        if rest:
            block = np.ravel_multi_index(tuple(coords[rest]), [sizes[j] for j in rest])
        blocks = jnp.asarray(block, jnp.int32)
        earlier = blocks < blocks[lax.axis_index(axes)]  # the devices that hold earlier rows
        earlier_devices = jnp.sum(jnp.where(earlier[:, None, None], every, 0), axis=0)
    return earlier_choices + earlier_devices, per_choice.sum(0)


def _other_positions_before(onehot: jax.Array, experts: jax.Array, sequence: SequenceSplit) -> jax.Array:
    """``[T, k]``: for each assignment ``(t, r)``, the choice-``r`` assignments to its expert that the other devices
    of the context axis hold at earlier places of this device's rows (an earlier row, or an earlier chunk of its
    own row). Each device's chunks are whole, so no other device holds a position inside one of this device's."""
    c, i = lax.axis_size(sequence.axis), lax.axis_index(sequence.axis)
    chunks, rows = sequence.chunks(), sequence.rows
    tokens, k, e = onehot.shape
    per_chunk = onehot.reshape(rows, chunks, tokens // (rows * chunks), k, e).sum(2)  # [rows, chunks, k, E]
    held = jnp.stack([i, 2 * c - 1 - i]) if chunks == 2 else i[None]  # this device's chunks of each sequence
    mine = jnp.zeros((rows, chunks * c, k, e), jnp.int32).at[:, held].set(per_chunk)
    others = (lax.psum(mine, sequence.axis) - mine).reshape(rows * chunks * c, k, e)
    # Exclusive prefix over (row, chunk) in the sequence's order; the other devices hold nothing of this device's.
    before = (jnp.cumsum(others, axis=0) - others).reshape(rows, chunks * c, k, e)[:, held]
    shape = (rows, chunks, tokens // (rows * chunks), k, e)
    per_token = jnp.broadcast_to(before[:, :, None], shape).reshape(tokens, k, e)
    return jnp.take_along_axis(per_token, experts[..., None], axis=-1)[..., 0]


def _pick(before: jax.Array, experts: jax.Array) -> jax.Array:
    """``before[r, experts[t, r]]`` for every ``(t, r)``."""
    return before[jnp.arange(experts.shape[1])[None, :], experts]
