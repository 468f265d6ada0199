"""Block arithmetic for leaves split over one mesh axis: padding a leaf to a multiple of the axis size and cutting
it back, its blocks as rows of one buffer, and the all-gather of a leaf whose derivative reduce-scatters. Used inside
``shard_map`` by :class:`spmdcomm.parallel.data.layout.TreeLayout` (and its padding in the global view)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["padded", "pad_to", "cut", "local_shape", "to_blocks", "from_blocks", "split", "gather_leaf"]


def padded(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` rounded up to a multiple of ``n``."""
    return shape[:dim] + (-(-shape[dim] // n) * n,) + shape[dim + 1 :]


def pad_to(x: jax.Array, dim: int | None, shape: tuple[int, ...]) -> jax.Array:
    """``x`` padded with zeros at the end of ``dim`` to ``shape``."""
    if dim is None or x.shape[dim] == shape[dim]:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, shape[dim] - x.shape[dim])
    return jnp.pad(x, widths)


def cut(x: jax.Array, dim: int | None, shape: tuple[int, ...]) -> jax.Array:
    """``x`` cut at the end of ``dim`` to ``shape``."""
    if dim is None or x.shape[dim] == shape[dim]:
        return x
    return lax.slice_in_dim(x, 0, shape[dim], axis=dim)


def local_shape(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return shape[:dim] + (shape[dim] // n,) + shape[dim + 1 :]


def to_blocks(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``(n, block size)``: row ``i`` is the ``i``-th block of ``x`` along ``dim``, flattened."""
    s = x.shape
    x = x.reshape(s[:dim] + (n, s[dim] // n) + s[dim + 1 :])
    return jnp.moveaxis(x, dim, 0).reshape(n, -1)


def from_blocks(rows: jax.Array, shape: tuple[int, ...], dim: int, n: int) -> jax.Array:
    """The inverse of :func:`to_blocks`: the whole leaf of ``shape`` from its ``n`` flattened blocks."""
    x = rows.reshape((n,) + local_shape(shape, dim, n))
    return jnp.moveaxis(x, 0, dim).reshape(shape)


def split(x: jax.Array, sizes: list[int]) -> list[jax.Array]:
    """``x`` cut along its last dimension into pieces of ``sizes``."""
    offsets = np.cumsum([0, *sizes])
    return [x[..., int(a) : int(b)] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def gather_leaf(block: jax.Array, axis: str, dim: int, compute: Any, reduce: Any, size: int) -> jax.Array:
    """The whole leaf from every device's ``block`` along ``dim``, gathered in ``compute`` and cut to ``size``
    along ``dim`` (a padded leaf); its derivative pads the cotangent back and reduce-scatters it in ``reduce``."""
    whole = lax.all_gather(block.astype(compute), axis, axis=dim, tiled=True)
    return lax.slice_in_dim(whole, 0, size, axis=dim) if whole.shape[dim] != size else whole


def gather_leaf_fwd(
    block: jax.Array, axis: str, dim: int, compute: Any, reduce: Any, size: int
) -> tuple[jax.Array, Any]:
    return gather_leaf(block, axis, dim, compute, reduce, size), jnp.zeros((), block.dtype)


def gather_leaf_bwd(
    axis: str, dim: int, compute: Any, reduce: Any, size: int, like: jax.Array, ct: jax.Array
) -> tuple[Any]:
    ct = pad_to(ct.astype(reduce), dim, padded(ct.shape, dim, lax.axis_size(axis)))
    return (lax.psum_scatter(ct, axis, scatter_dimension=dim, tiled=True).astype(like.dtype),)


gather_leaf.defvjp(gather_leaf_fwd, gather_leaf_bwd)
