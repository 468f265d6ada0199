"""Meshes and shardings.

spmdcomm builds every mesh with ``AxisType.Auto`` axes. ``jax.make_mesh`` now defaults to ``Explicit`` axes,
under which ``jax.shard_map`` refuses inputs that are not already sharded as its ``in_specs`` say; with Auto
axes, and with :func:`spmdcomm.spmd` placing its inputs itself, users never meet that error.

>>> import spmdcomm as sc
>>> dict(sc.data_mesh().shape)
{'data': 8}
>>> dict(sc.make_mesh({"data": 4, "model": 2}).shape)
{'data': 4, 'model': 2}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from spmdcomm._cache import Cache
from spmdcomm.errors import AxisError, SpmdError, describe

__all__ = [
    "data_mesh",
    "make_mesh",
    "default_mesh",
    "data_sharding",
    "replicated_sharding",
]


def data_mesh(*, axis: str = "data", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with one axis over the given devices.

    Args:
      axis: the name of the mesh's one axis.
      devices: the devices of the mesh, in this order; default every device of every process, laid out by
        ``jax.make_mesh``.

    Returns:
      A ``Mesh`` of shape ``{axis: len(devices)}`` with an ``AxisType.Auto`` axis; the same object for the same
      axis and devices.

    Examples:
      >>> dict(sc.data_mesh(axis="batch").shape)
      {'batch': 8}
    """
    devs = tuple(jax.devices() if devices is None else devices)
    return _cached_mesh(((axis, len(devs)),), devs, devices is not None)


def make_mesh(axes: Mapping[str, int], *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with one axis per ``axes`` entry, in order, e.g. ``make_mesh({"data": 4, "model": 2})``.

    One size may be ``-1``: it takes whatever the other sizes leave. The product of the sizes must equal the
    number of devices. Devices are laid out by ``jax.make_mesh`` (topology-aware on GPU and TPU).

    Args:
      axes: axis name to size, in mesh order; at most one size is ``-1``.
      devices: the devices of the mesh, kept in this order; default every device of every process, laid out
        by ``jax.make_mesh``.

    Returns:
      A ``Mesh`` with ``AxisType.Auto`` axes; the same object for the same axes and devices.

    Raises:
      SpmdError: when ``axes`` is empty, a size is 0 or below -1, more than one size is -1, names repeat, or
        the sizes do not multiply to (or, with -1, divide) the device count.

    Examples:
      >>> dict(sc.make_mesh({"data": -1, "model": 2}).shape)
      {'data': 4, 'model': 2}
    """
    devs = tuple(jax.devices() if devices is None else devices)
    if not axes:
        raise SpmdError(describe("make_mesh", "`axes` is empty.", fix='pass e.g. {"data": -1}.'))
    names = tuple(axes)
    sizes = [int(s) for s in axes.values()]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise SpmdError(
            describe(
                "make_mesh",
                f"axis sizes {dict(axes)} are invalid: each must be positive, at most one -1.",
                fix="give positive sizes, or -1 for the one axis that takes the remaining devices.",
            )
        )
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devs) % rest:
            raise SpmdError(
                describe(
                    "make_mesh",
                    f"{len(devs)} devices do not divide by the fixed axis sizes {dict(axes)} (product {rest}).",
                    fix="choose sizes whose product divides the device count.",
                )
            )
        sizes[sizes.index(-1)] = len(devs) // rest
    if math.prod(sizes) != len(devs):
        raise SpmdError(
            describe(
                "make_mesh",
                f"axis sizes {dict(zip(names, sizes))} multiply to {math.prod(sizes)}, but there "
                f"are {len(devs)} devices.",
                fix="make the sizes multiply to the device count, or use -1 for one.",
            )
        )
    return _cached_mesh(tuple(zip(names, sizes)), devs, devices is not None)


def default_mesh() -> Mesh:
    """The mesh used when a function's ``mesh`` argument is ``None``: :func:`data_mesh` over all devices.

    Returns:
      ``data_mesh()``: one axis ``"data"`` over every device of every process.
    """
    return data_mesh()


def data_sharding(*, mesh: Mesh | None = None, axis: str | tuple[str, ...] = "data") -> NamedSharding:
    """A sharding that splits dimension 0 across ``axis`` and replicates over the other mesh axes.

    Args:
      mesh: the mesh to shard over; default :func:`default_mesh`.
      axis: the mesh axis (or tuple of axes) that dimension 0 is split across.

    Returns:
      ``NamedSharding(mesh, P(axis))``.

    Raises:
      AxisError: when ``axis`` names an axis that ``mesh`` does not have.

    Examples:
      >>> sc.data_sharding().spec
      P('data',)
    """
    mesh = default_mesh() if mesh is None else mesh
    check_mesh_axes("data_sharding", mesh, axis)
    return NamedSharding(mesh, P(axis))


def replicated_sharding(*, mesh: Mesh | None = None) -> NamedSharding:
    """A sharding that holds a full copy of the value on every device of ``mesh``.

    Args:
      mesh: the mesh whose devices hold the copies; default :func:`default_mesh`.

    Returns:
      ``NamedSharding(mesh, P())``.
    """
    return NamedSharding(default_mesh() if mesh is None else mesh, P())


def platform(sharding: Sharding | None = None) -> str:
    """The one answer to "which platform am I on": ``"cpu"``, ``"gpu"`` or ``"tpu"`` for the devices of
    ``sharding``; without one, for the mesh the current trace maps over, else JAX's default backend.

    >>> platform(), platform(sc.data_sharding())
    ('cpu', 'cpu')
    """
    if sharding is not None:
        # jaxlib ships no type stubs, so mypy knows a Device's attributes only through jax.Device (Any)
        first: jax.Device = next(iter(sharding.device_set))
        return first.platform
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def check_mesh_axes(fn: str, mesh: Mesh, axis: str | tuple[str, ...] | None) -> None:
    """Raises :class:`AxisError` when ``axis`` names an axis that ``mesh`` does not have."""
    names = axis if isinstance(axis, tuple) else (axis,)
    for name in names:
        if name is not None and name not in mesh.axis_names:
            raise AxisError(
                describe(
                    fn,
                    f"axis {name!r} is not an axis of the mesh; its axes are {tuple(mesh.axis_names)} "
                    f"with sizes {dict(mesh.shape)}.",
                    fix="use one of the mesh's axis names.",
                )
            )


def _cached_mesh(axes: tuple[tuple[str, int], ...], devices: tuple[jax.Device, ...], keep_order: bool) -> Mesh:
    # One Mesh object per layout, so that caches keyed on the mesh hit.
    return _MESHES.get_or_make((axes, devices, keep_order), lambda: _new_mesh(axes, devices, keep_order))


def _new_mesh(axes: tuple[tuple[str, int], ...], devices: tuple[jax.Device, ...], keep_order: bool) -> Mesh:
    # Devices the caller listed keep their order; otherwise jax.make_mesh picks a topology-aware layout.
    names = tuple(n for n, _ in axes)
    sizes = tuple(s for _, s in axes)
    if len(set(names)) != len(names):
        raise SpmdError(describe("make_mesh", f"axis names {names} repeat.", fix="give distinct names."))
    types = (AxisType.Auto,) * len(names)
    if keep_order:
        return Mesh(np.asarray(devices, dtype=object).reshape(sizes), names, axis_types=types)
    return jax.make_mesh(sizes, names, axis_types=types, devices=list(devices))


_MESHES = Cache(limit=64)  # one Mesh per (axes, devices, order)
