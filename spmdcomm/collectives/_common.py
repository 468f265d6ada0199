"""Input checks shared by the collectives: axis names, pytree leaves, dimensions, splits, replicated values.

Each check raises an :class:`~spmdcomm.errors.SpmdError` subclass naming the function, the leaf path, the axis
and the sizes, before ``jax.lax`` gets a chance to fail with a bare ``AssertionError`` or ``NameError``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from spmdcomm._jax_compat import check_vma_enabled, varying_axes
from spmdcomm.errors import AxisError, ReplicatedReductionWarning, ShapeError, SpmdError, describe

AxisName = str | tuple[str, ...]


def bound_size(
    fn: str,
    axis: AxisName,
    *,
    argument: str | None = None,
    fix: Callable[[tuple[str, ...]], str] | None = None,
) -> int:
    """The number of devices along ``axis`` (product over a tuple); :class:`AxisError` if an axis is not bound.

    The error names the unknown axis and the axes bound here; with ``argument`` (e.g. ``"axis_name"``) it names the
    argument the axis came from, and ``fix(bound axes)`` words the fix instead of the collectives' one.
    """
    names = axis if isinstance(axis, tuple) else (axis,)
    if not names:
        raise AxisError(describe(fn, "axis is an empty tuple.", fix="name at least one mesh axis."))
    size = 1
    for name in names:
        try:
            size *= lax.axis_size(name)
        except NameError:
            bound = bound_axes()
            where = (
                f"the axes bound here are {bound}"
                if bound
                else "no axis is bound here (not inside spmd, jax.shard_map or jax.pmap)"
            )
            given = f"unknown axis name {name!r}"
            if argument is not None:
                given = f"{argument}={axis!r} " + (
                    f"names axis {name!r}, which is not bound" if isinstance(axis, tuple) else "is not a bound axis"
                )
            if fix is not None:
                wording = fix(bound)
            elif bound:
                wording = f"pass one of the bound axis names {bound}, or run over a mesh with axis {name!r}."
            else:
                wording = "call collectives only inside spmd, jax.shard_map or jax.pmap, over a mesh with that axis."
            raise AxisError(describe(fn, f"{given}: {where}.", fix=wording)) from None
    return size


def bound_axes() -> tuple[str, ...]:
    """The mesh axes bound where this runs (the manual axes of ``spmd``, ``jax.shard_map`` or ``jax.pmap``); empty
    outside them. Only for wording errors: an axis that ``jax.lax.axis_size`` accepts is bound."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        # The manual axes, not every axis of the mesh: a partial-manual shard_map (the train step on a mesh with
        # model axes) binds its data axes only.
        return tuple(getattr(mesh, "manual_axes", mesh.axis_names))
    except Exception:  # noqa: BLE001 - only used to word an error message
        return ()


def leaves(fn: str, tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``(path, leaf)`` pairs of ``tree`` and its treedef; :class:`SpmdError` for a leaf that is not an array."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path) or "<root>"
        if not _is_array_like(leaf):
            raise SpmdError(
                describe(
                    fn,
                    f"is a {type(leaf).__name__}, not an array.",
                    leaf=name,
                    fix="pass arrays or numbers; keep other values out of the pytree (e.g. close over them).",
                )
            )
        out.append((name, leaf))
    return out, treedef


def map_leaves(fn: str, one: Callable[[str, Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``one(path, leaf)``, after :func:`leaves` checked them."""
    pairs, treedef = leaves(fn, tree)
    return jax.tree.unflatten(treedef, [one(path, leaf) for path, leaf in pairs])


def check_dim(
    fn: str,
    path: str,
    leaf: jax.Array,
    dim: int,
    *,
    extra: int = 0,
    arg: str = "dim",
    axis: AxisName | None = None,
    n: int | None = None,
) -> int:
    """``dim`` as a non-negative index into a block of rank ``leaf.ndim + extra``; :class:`ShapeError` if none."""
    rank = leaf.ndim + extra
    if rank == 0:
        over = f" over axis {axis!r} of size {n}" if axis is not None else ""
        raise ShapeError(
            describe(
                fn,
                f"the block is 0-d (shape ()), so it has no dimension to split or concatenate{over}.",
                leaf=path,
                fix="give the value at least one dimension, e.g. x[None] (shape (1,)).",
            )
        )
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or not -rank <= dim < rank:
        raise ShapeError(
            describe(
                fn,
                f"{arg}={dim!r} is out of range for a block of shape {tuple(leaf.shape)} (rank {leaf.ndim}).",
                leaf=path,
                fix=f"use a {arg} in [{-rank}, {rank}).",
            )
        )
    return int(dim) % rank


def check_split(
    fn: str, path: str, leaf: jax.Array, d: int, axis: AxisName, n: int, *, exact: bool = False, arg: str = "dim"
) -> None:
    """:class:`ShapeError` unless dimension ``d`` splits into ``n`` equal chunks (is exactly ``n`` if ``exact``)."""
    size = leaf.shape[d]
    if exact and size != n:
        raise ShapeError(
            describe(
                fn,
                f"with tiled=False dimension {d} must equal the size {n} of axis {axis!r}, but the block "
                f"shape is {tuple(leaf.shape)}.",
                leaf=path,
                fix=f"give dimension {d} size {n}, or use tiled=True.",
            )
        )
    if size % n:
        raise ShapeError(
            describe(
                fn,
                f"{arg} {d} of size {size} (block shape {tuple(leaf.shape)}) does not divide by the size {n} "
                f"of axis {axis!r}.",
                leaf=path,
                fix=f"pad dimension {d} to a multiple of {n} (e.g. spmdcomm.pad_batch), or split another dimension.",
            )
        )


def warn_if_replicated(fn: str, pairs: list[tuple[str, Any]], axis: AxisName, op: str) -> None:
    """Warns with :class:`ReplicatedReductionWarning` when a sum/mean reduces a value already identical on ``axis``.

    Only ``shard_map(check_vma=True)`` knows which values vary; elsewhere this checks nothing.
    """
    if not check_vma_enabled():
        return
    names = set(axis if isinstance(axis, tuple) else (axis,))
    for path, leaf in pairs:
        if not isinstance(leaf, jax.core.Tracer):
            continue  # Python numbers and constants: psum(1, axis) counts devices on purpose
        if not names & varying_axes(leaf):
            effect = "multiplies it by the axis size" if op == "sum" else "is a no-op"
            warnings.warn(
                describe(
                    fn,
                    f"the value is already identical on every device of axis {axis!r}, so a {op} {effect}. "
                    "Gradients of replicated parameters taken inside shard_map (check_vma=True) are already "
                    "summed over the axis.",
                    leaf=path,
                    fix="reduce the per-device value before it became replicated, or drop this reduction.",
                ),
                ReplicatedReductionWarning,
                stacklevel=4,
            )
            return


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a leaf of a spec tree: a ``PartitionSpec`` or ``None``."""
    return x is None or isinstance(x, P)


def arg_specs(in_specs: Any, args: Sequence[Any], what: str) -> tuple[Any, ...]:
    """One spec (tree) per argument: ``in_specs`` repeated when it is a single spec; raises when the counts differ."""
    if is_spec(in_specs):
        return (in_specs,) * len(args)
    specs = tuple(in_specs)
    if len(specs) != len(args):
        raise SpmdError(
            describe(
                "spmd",
                f"{what} has {len(specs)} entries but the function got {len(args)} arguments.",
                fix="give one spec per argument, or a single PartitionSpec for all of them.",
            )
        )
    return specs


def hashable_specs(tree: Any) -> Hashable:
    """A spec tree as a hashable key (its structure and its specs)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_spec)
    return (treedef, tuple(leaves))


def _is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) or (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    )
