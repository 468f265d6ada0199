"""Layer 4, collectives: pytree-aware SPMD collectives with torch.distributed names, and the ``spmd`` wrapper.

Call these inside :func:`spmdcomm.spmd`, raw ``jax.shard_map`` or raw ``jax.pmap``. Each takes a pytree of
arrays and an axis name, or a tuple of axis names (the axes then act as one axis whose device index is
row-major over them, as in ``jax.lax.axis_index``). Shapes below are per-device block shapes, and ``n`` is the
size of the axis (the product of the sizes for a tuple).

Every function validates its input before calling ``jax.lax``: an unknown axis, a dimension the axis size does
not divide, a ``root`` out of range, an unknown op, a non-array leaf or a bad permutation raise an
:class:`~spmdcomm.errors.SpmdError` subclass naming the function, the leaf path, the axis and the sizes.

The collectives live in six modules, all re-exported here:

- :mod:`spmdcomm.collectives.reductions`: every device receives the reduction over the axis (``psum``,
  ``pmean``, ``pmax``, ``pmin``, ``all_reduce``), and the axis queries (``axis_index``, ``axis_size``);
- :mod:`spmdcomm.collectives.exchanges`: blocks regrouped along a dimension (``all_gather``,
  ``reduce_scatter``, ``all_to_all``);
- :mod:`spmdcomm.collectives.ragged`: a different number of rows to each device (``ragged_all_to_all``), as
  mixture-of-experts layers send tokens to their experts;
- :mod:`spmdcomm.collectives.rooted`: one device sends or receives (``broadcast``, ``reduce``, ``gather``,
  ``scatter``), built from data movement so that they run on every backend and deliver values exactly;
- :mod:`spmdcomm.collectives.p2p`: point-to-point sends and the prefix scan built on them (``permute``,
  ``shift``, ``scan``);
- :mod:`spmdcomm.collectives.attention`: softmax attention over a sequence split along the axis
  (``ring_attention``, ``all_to_all_attention``), and the positions of each device's tokens
  (``sequence_positions``, ``zigzag_order``).

:mod:`spmdcomm.collectives.spmd` holds :func:`spmdcomm.spmd`, the ``shard_map``/``pmap`` wrapper they run in.

Data and axis are positional, like ``jax.lax``; every other option (``op``, ``root``, ``dim``, ``perm``,
``offset``, ...) is keyword-only: ``all_reduce(x, "data", op="max")``.

Derivatives: every collective differentiates (``jax.grad``, ``jax.jvp``, ``jax.vjp``, and
``jax.linear_transpose`` where it is linear) like the ``jax.lax`` program it replaces, under ``jax.jit``,
``jax.vmap``, ``jax.checkpoint`` and to any order; each docstring states its derivative. As in ``jax.lax``, a
derivative taken *inside* the mapped function follows the backend's rules: under ``shard_map`` with
``check_vma=True`` the cotangent of an output that is identical on every device is not summed over devices,
under ``pmap`` (and ``check_vma=False``) it is. One exception: on CPU, bfloat16/float16 leaves of the rooted
collectives and ``all_gather`` move as bit patterns (XLA:CPU changes their NaN payloads otherwise) with a
custom JVP, so ``jax.linear_transpose`` raises ``NotImplementedError`` for them (``grad``/``vjp`` work).

>>> import jax, jax.numpy as jnp, numpy as np
>>> import spmdcomm as sc
>>> f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
>>> f(np.arange(8.0))
Array([28.], dtype=float32)
"""

from spmdcomm._ops import REDUCE_OPS, SCAN_OPS
from spmdcomm.collectives.attention import all_to_all_attention, ring_attention, sequence_positions, zigzag_order
from spmdcomm.collectives.exchanges import all_gather, all_to_all, reduce_scatter
from spmdcomm.collectives.p2p import permute, scan, shift
from spmdcomm.collectives.ragged import RAGGED_NATIVE_PLATFORMS, ragged_all_to_all
from spmdcomm.collectives.reductions import (
    RS_AG_MIN_BYTES,
    all_reduce,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    psum,
)
from spmdcomm.collectives.rooted import BROADCAST_SPLIT_MIN_BYTES, broadcast, gather, reduce, scatter
from spmdcomm.collectives.spmd import SpmdFunction, spmd

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ragged_all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
    "shift",
    "scan",
    "ring_attention",
    "all_to_all_attention",
    "sequence_positions",
    "zigzag_order",
    "axis_index",
    "axis_size",
    "REDUCE_OPS",
    "SCAN_OPS",
    "RS_AG_MIN_BYTES",
    "BROADCAST_SPLIT_MIN_BYTES",
    "RAGGED_NATIVE_PLATFORMS",
    "SpmdFunction",
    "spmd",
]
