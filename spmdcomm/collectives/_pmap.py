"""The ``pmap`` backend of :func:`spmdcomm.spmd`: each split dimension moves to pmap's leading device axis and back.

It expresses 1-D meshes only, with at most one split dimension per argument; :func:`check_pmap_spec` says so
before anything is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._cache import Cache
from spmdcomm.collectives._common import arg_specs, hashable_specs, is_spec
from spmdcomm.errors import BackendError, describe

if TYPE_CHECKING:
    from spmdcomm.collectives.spmd import SpmdFunction


def make_pmap(sf: SpmdFunction, mesh: Mesh) -> jax.stages.Wrapped:
    """pmap over the leading device axis, with each split dimension moved there and back."""
    _check_pmap_mesh(sf.__name__, mesh)
    (axis,) = mesh.axis_names
    n = mesh.shape[axis]
    out_axes = jax.tree.map(_pmap_axis, sf.out_specs, is_leaf=is_spec)
    pmapped = Cache(limit=64)  # in_axes -> the pmapped function

    def in_axes_of(args: tuple[Any, ...]) -> Any:
        specs = arg_specs(sf.in_specs, args, "in_specs")
        return tuple(
            jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: _pmap_axis(spec), sub), specs, args, is_leaf=is_spec)
        )

    def split(*args: Any) -> tuple[Any, ...]:
        specs = arg_specs(sf.in_specs, args, "in_specs")
        return tuple(
            jax.tree.map(
                lambda spec, sub: jax.tree.map(lambda x: _to_leading(x, spec, n), sub), specs, args, is_leaf=is_spec
            )
        )

    def merge(out: Any) -> Any:
        return jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda y: _from_leading(y, spec), sub), sf.out_specs, out, is_leaf=is_spec
        )

    def run(in_axes: Any, dummy: Any, parts: tuple[Any, ...]) -> Any:
        # pmap needs one mapped argument to know its size; a dummy one serves when every input is replicated.
        mapped = pmapped.get_or_make(
            hashable_specs(in_axes),
            lambda: jax.pmap(
                lambda _, *a: sf.fn(*a),
                axis_name=axis,
                in_axes=(0, *in_axes),
                out_axes=out_axes,
                devices=list(mesh.devices.flat),
            ),
        )
        return mapped(dummy, *parts)

    if jax.process_count() == 1:
        return jax.jit(
            lambda *args: merge(run(in_axes_of(args), jnp.zeros((n,), jnp.int8), split(*args))),
            donate_argnums=sf.donate_argnums,
        )
    # With several processes pmap cannot run inside jit: it takes global arrays split on the leading axis and
    # returns process-local ones (leading axis = this process's devices), which are reassembled as global arrays.
    split_jit, merge_jit = jax.jit(split), jax.jit(merge)
    dummy = jax.device_put(np.zeros((n,), np.int8), NamedSharding(mesh, P(axis)))

    def globalise(axis_or_none: int | None, y: jax.Array) -> jax.Array:
        shards = [s.data for s in y.addressable_shards]
        if axis_or_none is None:
            return jax.make_array_from_single_device_arrays(y.shape, NamedSharding(mesh, P()), shards)
        shape = (n,) + shards[0].shape[1:]
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P(axis)), shards)

    def call(*args: Any) -> Any:
        out = run(in_axes_of(args), dummy, split_jit(*args))
        out = jax.tree.map(
            lambda a, sub: jax.tree.map(lambda y: globalise(a, y), sub),
            out_axes,
            out,
            is_leaf=lambda v: v is None or isinstance(v, int),
        )
        return merge_jit(out)

    return _MultiProcessPmap(sf.__name__, call)


def check_pmap_spec(fn: str, name: str, spec: P, mesh: Mesh) -> None:
    _check_pmap_mesh(fn, mesh)
    used = [entry for entry in spec if entry is not None and entry != ()]
    if len(used) > 1:
        raise BackendError(
            describe(
                fn,
                f"backend='pmap' can split one dimension per argument, but spec {spec} splits {len(used)}.",
                leaf=name,
                fix=_PMAP_FIX,
            )
        )


# ---------------------------------------------------------------------------------------------------------


_PMAP_FIX = "use backend='shard_map', which expresses any mesh and spec."


class _MultiProcessPmap:
    """The pmap program of a multi-process job: callable, but with no one program to trace or lower (pmap runs
    between two jitted steps that move the data), which ``trace`` and ``lower`` say instead of failing on a
    missing attribute."""

    def __init__(self, fn: str, call: Callable[..., Any]):
        self._fn = fn
        self._call = call

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def trace(self, *args: Any) -> jax.stages.Traced:
        raise self._no_single_program("trace")

    def lower(self, *args: Any) -> jax.stages.Lowered:
        raise self._no_single_program("lower")

    def _no_single_program(self, method: str) -> BackendError:
        return BackendError(
            describe(
                self._fn,
                f"{method}() needs one program, but with backend='pmap' and {jax.process_count()} processes pmap "
                "runs between two jitted steps that split the global arrays into process-local ones and back.",
                fix="use backend='shard_map' (one program on any number of processes), or lower in a one-process run.",
            )
        )


def _check_pmap_mesh(fn: str, mesh: Mesh) -> None:
    if len(mesh.axis_names) != 1:
        raise BackendError(
            describe(fn, f"backend='pmap' needs a 1-D mesh, but the mesh has axes {dict(mesh.shape)}.", fix=_PMAP_FIX)
        )


def _split_dim(spec: P | None) -> int | None:
    if spec is None:
        return None
    dims = [d for d, entry in enumerate(spec) if entry is not None and entry != ()]
    return dims[0] if dims else None


def _pmap_axis(spec: P | None) -> int | None:
    return None if _split_dim(spec) is None else 0


def _to_leading(x: Any, spec: P | None, n: int) -> Any:
    d = _split_dim(spec)
    if d is None:
        return x
    x = jnp.asarray(x)
    return jnp.moveaxis(x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1 :]), d, 0)


def _from_leading(y: Any, spec: P | None) -> Any:
    d = _split_dim(spec)
    if d is None:
        return y
    y = jnp.moveaxis(y, 0, d)
    return y.reshape(y.shape[:d] + (y.shape[d] * y.shape[d + 1],) + y.shape[d + 2 :])
