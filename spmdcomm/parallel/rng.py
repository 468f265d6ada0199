"""Random keys for data-parallel steps, and moving typed key arrays to and from the host.

The train step hands ``loss_fn`` one of two kinds of key (``make_train_step(..., rng=...)``):

* ``"per_device"`` (default): a raw ``uint32[2]`` threefry key,
  ``fold_in(fold_in(fold_in(state.rng, step), device), micro_batch)``. Every device and micro-batch
  draws different bits, as torch DDP's per-rank generators do, so the bits an example sees depend
  on how many devices (and micro-batches) the global batch is split over.
* ``"per_example"``: a :func:`per_example_key`. Row ``r`` of every draw is generated from
  ``fold_in(k, g)`` where ``k`` is ``fold_in(state.rng, step)`` (after any ``fold_in``/``split`` the
  model applies, e.g. Flax's per-layer folding) and ``g`` is the row's GLOBAL index in the batch. So
  the bits each example sees depend only on the seed, the step, the draw and the example, and a
  model trains the same on 1 or 8 devices, with or without ``accum_steps``, and after resuming on
  another device count.

A per-example key's contract: **dimension 0 of every draw is the example index**, and equals the
block's number of rows. A draw of any other shape (a scalar, a ``(features,)`` mask broadcast over
the batch, a flattened ``(batch * time, ...)`` array, per-example keys made by ``split`` and drawn
under ``vmap``) raises :class:`~spmdcomm.ShapeError` when the step is compiled, instead of silently
depending on the device count.

>>> key = per_example_key(jax.random.PRNGKey(0), offset=4, rows=2)   # global rows 4 and 5
>>> whole = per_example_key(jax.random.PRNGKey(0), offset=0, rows=6)
>>> bool((jax.random.uniform(key, (2, 3)) == jax.random.uniform(whole, (6, 3))[4:]).all())
True
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jex_random

from spmdcomm.errors import ShapeError, SpmdError, describe

__all__ = ["per_example_key", "sub_block_key", "raw_key", "is_per_example_key", "stream_key_for_call", "RNG_MODES"]

RNG_MODES = ("per_device", "per_example")

_FRY = jex_random.threefry_prng_impl
# A per-example key's data: the threefry key (2 words) and the global index of the block's first row.
_KEY_WORDS = 3


def per_example_key(key: Any, *, offset: Any, rows: int) -> jax.Array:
    """A typed key for a block of ``rows`` examples whose first example has global index ``offset``.

    ``key`` is a threefry key (raw ``uint32[2]`` or typed) shared by every device. Row ``r`` of a
    draw of shape ``(rows, *rest)`` comes from ``fold_in(key, offset + r)`` (after any ``fold_in``
    or ``split`` applied to the returned key, which act on ``key`` and keep ``offset``), so blocks of
    one global batch draw exactly the bits one device would draw for the whole batch. ``offset`` may
    be traced; ``rows`` is static. Costs one extra threefry hash per row and draw.
    """
    data = _threefry_data("per_example_key", key)
    offset = jnp.asarray(offset, jnp.uint32)
    words = jnp.concatenate([data, jnp.broadcast_to(offset, data.shape[:-1] + (1,))], axis=-1)
    return jax.random.wrap_key_data(words, impl=_per_example_impl(int(rows)))


def sub_block_key(key: Any, *, shift: Any, rows: int) -> Any:
    """The key of ``rows`` rows starting ``shift`` rows after the first row of ``key``'s block (``shift`` may be
    traced and negative: rows another device started with). A per-example key keeps its threefry part and moves its
    global offset, so a sub-block draws exactly the bits of those examples; any other key is folded with ``shift``
    (its draws depend on the split, as per-device keys do)."""
    if _rows_of(key) is None:
        return jax.random.fold_in(key, jnp.asarray(shift, jnp.int32).astype(jnp.uint32))
    data = jax.random.key_data(key)
    return per_example_key(
        data[..., :2], offset=data[..., 2] + jnp.asarray(shift, jnp.int32).astype(jnp.uint32), rows=rows
    )


def raw_key(rng: Any) -> np.ndarray:
    """``rng`` (an int seed, a raw or typed key, or None for seed 0) as a host ``uint32[2]`` raw key."""
    if rng is None:
        rng = 0
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return np.asarray(rng, dtype=np.uint32)


def is_per_example_key(key: Any) -> bool:
    """Whether ``key`` is a typed key made by :func:`per_example_key`."""
    return _rows_of(key) is not None


def stream_key_for_call(stream_key: jax.Array, rng: Any) -> jax.Array:
    """The key a stored model RNG stream (a Flax NNX ``RngKey``) uses during one step call.

    ``rng`` is the key the step gave ``loss_fn``. A raw per-device key is folded into ``stream_key``
    (so every device, micro-batch and step draws differently). A per-example key's threefry part is
    folded into ``stream_key`` and the result becomes a per-example key with the same global row
    offset (so every stream draws per example, independently of the device count). Keys with a
    batch shape (split streams) are handled entry by entry.
    """
    rows = _rows_of(rng)
    data = jax.random.key_data(rng) if rows is not None else jnp.asarray(rng, jnp.uint32)
    if rows is None:
        return _map_keys(lambda k: jax.random.fold_in(jax.random.fold_in(k, data[0]), data[1]), stream_key)
    if not _is_threefry(stream_key):
        raise SpmdError(
            describe(
                "make_train_step",
                f"rng='per_example' needs threefry stream keys, but a model RNG stream holds a {stream_key.dtype} key.",
                fix="create the model's nnx.Rngs with the default (threefry) implementation, or use rng='per_device'.",
            )
        )
    folded = _map_keys(lambda k: jax.random.fold_in(jax.random.fold_in(k, data[0]), data[1]), stream_key)
    return per_example_key(folded, offset=data[2], rows=rows)


# --------------------------------------------------------------------------------------------------
# Typed key leaves on the host (TrainState.create's broadcast and placement)


def keys_to_data(tree: Any) -> tuple[Any, list[Any]]:
    """Replaces every typed key leaf of ``tree`` by its ``uint32`` key data and every other leaf by
    a NumPy array; returns the new tree and, per leaf, the key implementation (``None`` for plain
    arrays), for :func:`data_to_keys`."""
    leaves, treedef = jax.tree.flatten(tree)
    impls = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
    host = [
        np.asarray(jax.device_get(jax.random.key_data(x))) if impl is not None else np.asarray(x)
        for x, impl in zip(leaves, impls, strict=True)
    ]
    return jax.tree.unflatten(treedef, host), impls


def data_to_keys(tree: Any, impls: list[Any]) -> Any:
    """Inverse of :func:`keys_to_data` on a tree of (placed) arrays: wraps key data back into typed
    keys of the recorded implementations, keeping each array's sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [x if impl is None else _wrap_placed(x, impl) for x, impl in zip(leaves, impls, strict=True)]
    return jax.tree.unflatten(treedef, out)


def is_key_leaf(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``, Flax NNX ``RngKey`` values)."""
    return _is_key(x)


# --------------------------------------------------------------------------------------------------
# Private helpers


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _is_threefry(key: jax.Array) -> bool:
    # key_impl gives the built-in implementations by name and custom ones as a spec.
    return str(jax.random.key_impl(key)) == _FRY.name


def _wrap_placed(x: jax.Array, impl: Any) -> jax.Array:
    # wrap_key_data is a jitted op: with an explicit output sharding the key keeps the data's
    # placement (also for arrays spanning several processes).
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return jax.random.wrap_key_data(x, impl=impl)
    return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=sharding)(x)


def _threefry_data(fn: str, key: Any) -> jax.Array:
    if _is_key(key):
        if not _is_threefry(key):
            raise SpmdError(
                describe(fn, f"expected a threefry key, got a {key.dtype} key.", fix="use jax.random.key(seed).")
            )
        return jax.random.key_data(key)
    data = jnp.asarray(key)
    if data.dtype != jnp.uint32 or data.shape[-1:] != (2,):
        raise SpmdError(
            describe(
                fn,
                f"expected a threefry key (raw uint32[..., 2] or typed), got dtype {data.dtype} and "
                f"shape {data.shape}.",
                fix="pass jax.random.PRNGKey(seed) or jax.random.key(seed).",
            )
        )
    return data


def _map_keys(fn: Any, keys: jax.Array) -> jax.Array:
    # jax.random.fold_in takes one key; stream keys may carry a batch shape (nnx split streams).
    for _ in range(keys.ndim):
        fn = jax.vmap(fn)
    return fn(keys)


_ROWS: dict[Any, int] = {}


def _rows_of(key: Any) -> int | None:
    if not _is_key(key):
        return None
    return _ROWS.get(jax.random.key_impl(key))


@functools.cache
def _per_example_impl(rows: int) -> Any:
    """The PRNG implementation of per-example keys for blocks of ``rows`` examples.

    One implementation per block size: ``rows`` must be static so that a draw of the wrong shape
    fails while tracing, not silently at run time.
    """
    if rows < 1:
        raise ShapeError(describe("per_example_key", f"rows={rows} must be positive."))

    def seed(s: jax.Array) -> jax.Array:
        return jnp.concatenate([_FRY.seed(s), jnp.zeros((1,), jnp.uint32)])

    def split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        keys = _FRY.split(key[:2], shape)
        return jnp.concatenate([keys, jnp.broadcast_to(key[2], tuple(shape) + (1,))], axis=-1)

    def fold_in(key: jax.Array, data: Any) -> jax.Array:
        return jnp.concatenate([_FRY.fold_in(key[:2], data), key[2:]])

    def random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
        if len(shape) == 0 or shape[0] != rows:
            raise ShapeError(
                describe(
                    "make_train_step(rng='per_example')",
                    f"a random draw of shape {tuple(shape)} from a per-example key of a block of "
                    f"{rows} examples: dimension 0 of every draw must be the example index (size "
                    f"{rows}), or the bits would depend on how the batch is split over devices.",
                    fix="draw per example (e.g. no dropout broadcast over dimension 0, no flattened "
                    "(batch * time, ...) draws, no scalar draws), or use rng='per_device'.",
                )
            )
        # Row r of the block is global example offset + r: its bits depend on nothing else.
        index = key[2] + jnp.arange(rows, dtype=jnp.uint32)
        row_bits = lambda i: _FRY.random_bits(_FRY.fold_in(key[:2], i), bit_width, tuple(shape[1:]))
        return jax.vmap(row_bits)(index)

    spec = jex_random.define_prng_impl(
        key_shape=(_KEY_WORDS,),
        seed=seed,
        split=split,
        random_bits=random_bits,
        fold_in=fold_in,
        name=f"spmdcomm_per_example_{rows}",
        tag=f"per_example{rows}",
    )
    _ROWS[jax.random.key_impl(jax.random.key(0, impl=spec))] = rows
    return spec
