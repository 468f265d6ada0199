"""Exact data movement shared by the gathers and the rooted collectives.

These helpers move values and never add them, so what arrives is what was sent, bit for bit (``-0.0``,
denormals, infinities and NaN payloads included, for every dtype), and each is differentiable like the
``jax.lax`` movement it wraps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._jax_compat import check_vma_enabled
from spmdcomm.collectives._common import AxisName, bound_size, check_dim, map_leaves
from spmdcomm.errors import ShapeError, describe
from spmdcomm.runtime.mesh import platform


def gather_blocks(x: jax.Array, axis: AxisName, d: int, *, tiled: bool) -> jax.Array:
    """All-gather whose output is identical on every device and whose transpose is right on every backend.

    ``all_gather(to="invarying")`` transposes to a local slice of the cotangent, which is right only when the
    cotangent is identical on every device, as the type system guarantees under ``check_vma=True``. Under
    ``pmap`` and ``check_vma=False`` nothing guarantees it (each device may have its own cotangent), and that
    transpose silently drops the other devices' contributions; the plain all-gather, whose transpose sums them
    (a reduce-scatter), is the right one there. Both compile to the same all-gather.
    """
    return lax.all_gather(x, axis, axis=d, tiled=tiled, to="invarying" if check_vma_enabled() else "varying")


def exact(move: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``move(x)`` for a dtype-agnostic data movement ``move``, delivering the bits of ``x`` unchanged."""
    if x.dtype in _HALF_FLOATS and platform() == "cpu":
        return _move_bits(move, x)
    return move(x)


def select_exact(pred: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``where(pred, a, b)`` that keeps the bits of 2-byte floats on CPU (see :func:`exact`)."""
    if a.dtype in _HALF_FLOATS and platform() == "cpu":
        return _select_bits(pred, a, b)
    return jnp.where(pred, a, b)


def gather_leaves(fn: str, x: Any, axis: AxisName, dim: int, tiled: bool, root: int | None = None) -> Any:
    """all_gather (``root=None``) or gather: zeros on the devices other than ``root``."""
    n = bound_size(fn, axis)

    def one(path: str, leaf: Any) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if tiled and leaf.ndim == 0:
            also = (
                f"pass tiled=False to stack the blocks into a new dimension of size {n}, or "
                if fn == "all_gather"
                else ""
            )
            raise ShapeError(
                describe(
                    fn,
                    f"the block is 0-d (shape ()), so the {n} blocks of axis {axis!r} cannot be concatenated "
                    f"along dim={dim!r}.",
                    leaf=path,
                    fix=f"{also}give the value a dimension, e.g. x[None] (shape (1,)), to receive shape ({n},).",
                )
            )
        d = check_dim(fn, path, leaf, dim, extra=0 if tiled else 1, axis=axis, n=n)
        if root is None:
            return exact(lambda v: gather_blocks(v, axis, d, tiled=tiled), leaf)
        is_root = lax.axis_index(axis) == root
        return exact(lambda v: jnp.where(is_root, gather_blocks(v, axis, d, tiled=tiled), jnp.zeros((), v.dtype)), leaf)

    return map_leaves(fn, one, x)


# XLA:CPU computes on 2-byte floats through float32 (its float-normalisation pass): their all-gather,
# all-to-all, permute and select canonicalise NaN payloads (bf16 0x7FC1 -> 0x7FC0), and so does the f32 ->
# bf16 convert, so neither the values nor a float32 detour arrive exactly. Their bit patterns move instead
# (uint16: exact), with a custom_jvp that moves the tangent the same way. The one cost: jax.linear_transpose
# (which ignores custom_jvp rules) is not available for bf16/f16 leaves of the rooted collectives on CPU.
_HALF_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _move_bits(move: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(move(lax.bitcast_convert_type(x, jnp.uint16)), x.dtype)


@_move_bits.defjvp
def _move_bits_jvp(move: Callable[[jax.Array], jax.Array], primals: tuple[jax.Array], tangents: tuple[jax.Array]):
    (x,), (t,) = primals, tangents
    return _move_bits(move, x), move(t)  # the movement is linear: the tangent moves like the value


@jax.custom_jvp
def _select_bits(pred: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    bits = jnp.where(pred, lax.bitcast_convert_type(a, jnp.uint16), lax.bitcast_convert_type(b, jnp.uint16))
    return lax.bitcast_convert_type(bits, a.dtype)


@_select_bits.defjvp
def _select_bits_jvp(primals: tuple[jax.Array, ...], tangents: tuple[Any, ...]):
    (pred, a, b), (_, ta, tb) = primals, tangents
    return _select_bits(pred, a, b), jnp.where(pred, ta, tb)
