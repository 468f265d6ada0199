"""Experts that run on the rows they received, and no others: a grouped computation over tiles of rows sorted by
expert (:func:`grouped_apply`).

A device holding ``L`` experts gets a variable number of rows for each (the routing decides), within a static bound
of ``R`` rows. :func:`grouped_apply` sorts the rows by expert, pads each expert's group to whole tiles of ``b`` rows
(at most ``R / b + L`` tiles), and runs a ``lax.scan`` over the tiles, each tile through its one expert (the expert's
parameters picked by index, never copied per row or per tile), skipping the tiles no row reached. The work done is
the received rows' plus at most ``b - 1`` padding rows per expert (MegaBlocks' and megablox's block-sparse form, in
plain JAX), against ``L * B`` rows for a static buffer of ``B`` rows per expert.

``jax.lax.ragged_dot`` expresses the same for a matmul, but XLA:CPU runs it as a dense matmul against every group
(``L`` times the work: measured with jax 0.10.2), and it covers a matmul, not an expert module; here the expert is
any row-wise function of its parameters. The derivative is written by hand (``jax.custom_vjp``): each tile's
backward pass reads the residuals its forward pass saved and adds its parameter gradient into its expert's rows of
the accumulated gradient, in place (autodiff of the scan would add a full-size zero-padded gradient at every tile).
Reverse mode only: ``jax.jvp`` raises (the layers' ``grouped=False`` runs a static buffer that forward mode takes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdcomm._jax_compat import vary, varying_axes
from spmdcomm.errors import SpmdError

__all__ = ["grouped_apply", "tile_rows"]

#: The tile is the largest power of two that keeps the padding of ``L`` groups within 1 / PADDING_SHARE of the rows.
PADDING_SHARE = 16
MAX_TILE = 256


def tile_rows(rows: int, experts: int) -> int:
    """The rows of a tile for ``rows`` rows over ``experts`` groups: the largest power of two at most
    ``rows / (16 * experts)`` (so that the padding, less than a tile per group, stays within a sixteenth of the rows),
    and at most 256.

    Examples:
      >>> tile_rows(1024, 8), tile_rows(64, 8), tile_rows(1 << 20, 2)
      (8, 1, 256)
    """
    bound = max(1, min(MAX_TILE, rows // (PADDING_SHARE * experts)))
    return 1 << (bound.bit_length() - 1)


def grouped_apply(
    apply: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    rows: jax.Array,
    expert: jax.Array,
    valid: jax.Array,
    *,
    tile: int | None = None,
) -> jax.Array:
    """``apply(params_e, rows[i])`` for each valid row ``i`` with ``e = expert[i]``; zeros at the other rows.

    Args:
      apply: ``apply(one_expert_params, rows [b, d]) -> [b, d_out]``, row by row (rows that hold no token are
        zeros, and their results are discarded).
      params: the local experts' parameters, every leaf ``[L, ...]``.
      rows: ``[R, d]``.
      expert: ``[R]`` int, each row's local expert (read where ``valid``).
      valid: ``[R]`` bool, the rows to compute.
      tile: rows per tile (default: :func:`tile_rows` of ``R``; :func:`moe` passes that of the rows a device
        receives on average, ``T k``, where ``R`` is a bound for any routing).

    Returns:
      ``[R, d_out]``, in ``apply``'s dtype.
    """
    local = jax.tree.leaves(params)[0].shape[0]
    count, width = rows.shape
    b = tile_rows(count, local) if tile is None else tile
    tiles = -(-count // b) + local  # each group wastes less than a tile
    key = jnp.where(valid, expert, local)  # invalid rows sort last, into no group
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    sizes = jnp.bincount(key, length=local + 1)[:local]
    group_tiles = -(-sizes // b)
    first_tile = jnp.cumsum(group_tiles) - group_tiles
    first_row = jnp.cumsum(sizes) - sizes
    group = jnp.minimum(sorted_key, local - 1)
    rank = jnp.arange(count) - first_row[group]
    place = jnp.where(sorted_key < local, first_tile[group] * b + rank, tiles * b)  # invalid rows: out of range
    padded = jnp.zeros((tiles * b, width), rows.dtype).at[place].set(rows[order], mode="drop")
    # Each tile's expert; `local` for the tiles past the last group's (skipped).
    # (A comparison, not jnp.searchsorted, which fails to trace in a shard_map with auto axes on jax 0.10.)
    ends = jnp.cumsum(group_tiles)
    which = jnp.sum(ends[None, :] <= jnp.arange(tiles)[:, None], axis=1, dtype=jnp.int32)
    out = _tiles(apply, params, padded.reshape(tiles, b, width), which)
    out = out.reshape((tiles * b,) + out.shape[2:])
    done = out.at[place].get(mode="fill", fill_value=0)
    return jnp.zeros_like(done).at[order].set(done)


def _tiles(apply: Callable[[Any, jax.Array], jax.Array], params: Any, tiles: jax.Array, which: jax.Array) -> jax.Array:
    """``out[t] = apply(params[which[t]], tiles[t])`` for ``which[t] < L``, zeros for the rest, with the vjp above."""
    local = jax.tree.leaves(params)[0].shape[0]
    tile = jax.ShapeDtypeStruct(tiles.shape[1:], tiles.dtype)
    tiles_axes = varying_axes(tiles)

    # Every tile's output typed as varying over all the inputs' manual axes, so the cotangent's type is known.
    out_axes = frozenset().union(tiles_axes, varying_axes(which), *map(varying_axes, jax.tree.leaves(params)))
    typed_apply = lambda p, rows: vary(apply(p, rows), tuple(sorted(out_axes)))

    def pick(params: Any, e: jax.Array) -> Any:
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, e, keepdims=False), params)

    def one(params: Any, rows: jax.Array, e: jax.Array) -> tuple[jax.Array, Any, list[jax.Array], tuple[int, ...]]:
        """A tile's output, its vjp, the vjp's leaves to save and where the expert's own parameters sit among the
        leaves (``j`` for parameter leaf ``j``, -1 for a saved one): those are taken again from ``params`` in the
        backward pass, not saved per tile (a copy of the expert's weights for every tile)."""
        mine = pick(params, e)
        out, vjp = jax.vjp(typed_apply, mine, rows)
        index = {id(leaf): j for j, leaf in enumerate(jax.tree.leaves(mine))}
        leaves = jax.tree.leaves(vjp)
        where = tuple(index.get(id(leaf), -1) for leaf in leaves)
        return out, vjp, [leaf for leaf, j in zip(leaves, where, strict=True) if j < 0], where

    # The tile's vjp structure (its static part holds the inputs' manual-axis types) and the parameters' places in
    # it, traced once from real inputs; every tile's trace is the same program.
    traced: dict[str, Any] = {}

    def probe(params: Any, tiles: jax.Array, which: jax.Array) -> jax.Array:
        out, vjp, _, traced["where"] = one(params, tiles[0], which[0])
        traced["def"] = jax.tree.structure(vjp)
        return out

    jax.eval_shape(probe, params, tiles, which)
    vjp_def, where = traced["def"], traced["where"]

    @jax.custom_vjp
    def run(params: Any, tiles: jax.Array, which: jax.Array) -> jax.Array:
        return forward(params, tiles, which)[0]

    def forward(params: Any, tiles: jax.Array, which: jax.Array) -> tuple[jax.Array, Any]:
        def body(_: None, inputs: tuple[jax.Array, jax.Array]) -> tuple[None, Any]:
            rows, e = inputs

            def compute(rows: jax.Array) -> Any:
                out, _, saved, places = one(params, rows, e)
                if places != where:
                    raise SpmdError(f"grouped experts: a tile traced its vjp differently ({places} != {where}).")
                return out, saved

            return None, lax.cond(e < local, compute, lambda rows: _zeros(jax.eval_shape(compute, rows)), rows)

        _, (out, residuals) = lax.scan(body, None, (tiles, which))
        return out, (params, residuals, which)

    def backward(res: Any, cotangent: jax.Array) -> tuple[Any, jax.Array, None]:
        params, residuals, which = res
        cotangent = _typed_as(cotangent, out_axes)

        def tile_grads(saved: Any, ct: jax.Array, e: jax.Array) -> tuple[Any, jax.Array]:
            mine, rest = jax.tree.leaves(pick(params, e)), iter(saved)
            leaves = [mine[j] if j >= 0 else next(rest) for j in where]
            d_params, d_rows = jax.tree.unflatten(vjp_def, leaves)(ct)
            return d_params, d_rows.astype(tile.dtype)

        def accumulate(grads: Any, d_params: Any, e: jax.Array) -> Any:
            # In place: only this expert's rows of the accumulated gradient change.
            return jax.tree.map(lambda g, d: g.at[e].add(d.astype(g.dtype)), grads, d_params)

        # The carry typed as the accumulation leaves it (varying over the axes the experts' gradients vary over).
        first = (jax.tree.map(lambda r: r[0], residuals), cotangent[0], which[0])
        tile_shapes = jax.eval_shape(tile_grads, *first)
        # (Arrays, not eval_shape's structs, go back into eval_shape: a struct with a mesh of auto axes fails there.)
        nothing = _zeros(tile_shapes)
        grads = _zeros(jax.eval_shape(accumulate, jax.tree.map(jnp.zeros_like, params), nothing[0], which[0]))

        def body(grads: Any, inputs: Any) -> tuple[Any, jax.Array]:
            saved, ct, e = inputs
            # Only the tile's own gradients inside the branch: a branch that passed the accumulated gradient through
            # would copy all of it at every tile (measured: 1.6x the backward pass's time on XLA:CPU).
            d_params, d_rows = lax.cond(e < local, tile_grads, lambda *_: nothing, saved, ct, e)
            return accumulate(grads, d_params, jnp.minimum(e, local - 1)), d_rows

        grads, d_tiles = lax.scan(body, grads, (residuals, cotangent, which))
        grads = jax.tree.map(lambda g, p: _typed_as(g, varying_axes(p)), grads, params)
        return grads, _typed_as(d_tiles, tiles_axes), None

    run.defvjp(forward, backward)
    return run(params, tiles, which)


def _typed_as(cotangent: jax.Array, want: frozenset[str]) -> jax.Array:
    """``cotangent`` typed as varying over the manual axes ``want``, as autodiff gives it: summed over the axes it
    varies over and ``want`` does not hold (the transpose of an implicit broadcast), marked varying over the rest."""
    axes = varying_axes(cotangent)
    extra = tuple(sorted(axes - want))
    summed = lax.psum(cotangent, extra) if extra else cotangent
    return vary(summed, tuple(sorted(want)))


def _zeros(structs: Any) -> Any:
    """Zeros of the shapes, dtypes and manual-axis types (``check_vma``) of ``structs`` (``jax.eval_shape``'s)."""
    return jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), tuple(sorted(varying_axes(s)))), structs)
