"""The ``spmd`` wrapper: one jit-compiled SPMD function, with a shard_map or a pmap backend.

Both backends have the same contract. Arguments are ``jax.Array``s or host values (NumPy); each is split
across the mesh as ``in_specs`` says, the function runs once per device on its block, and the outputs are
assembled into global arrays as ``out_specs`` say. Arguments that are not yet placed that way are placed for
you, so the ``Explicit``-mesh error of raw ``jax.shard_map`` never reaches you. Host values follow
:mod:`spmdcomm.data.placement`'s rule: with several processes each process passes its own part by default
(``host_input="local"``), or every process the same full value (``host_input="global"``).

>>> import numpy as np, spmdcomm as sc
>>> @sc.spmd(in_specs=sc.P("data"), out_specs=sc.P("data"))
... def centred(x):
...     return x - sc.pmean(x.mean(), "data")
>>> centred(np.arange(8.0)).tolist()
[-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5]

The pmap backend maps each split dimension to pmap's leading device axis and back, so the same call works
with ``backend="pmap"``. It can express only 1-D meshes and at most one split dimension per argument.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm import _compile_watch
from spmdcomm._cache import Cache
from spmdcomm.collectives._common import arg_specs, hashable_specs, is_spec
from spmdcomm.collectives._pmap import check_pmap_spec, make_pmap
from spmdcomm.data.blocks import check_divisible
from spmdcomm.data.placement import HostInput, check_host_input, place_leaves
from spmdcomm.errors import BackendError, SpmdError, check_not_deleted, describe
from spmdcomm.runtime import debug
from spmdcomm.runtime.mesh import check_mesh_axes, default_mesh

__all__ = ["spmd", "SpmdFunction", "P"]

Backend = Literal["shard_map", "pmap"]
BACKENDS: tuple[str, ...] = ("shard_map", "pmap")


def spmd(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    in_specs: Any,
    out_specs: Any,
    mesh: Mesh | None = None,
    backend: Backend = "shard_map",
    check_vma: bool = True,
    donate_argnums: int | Sequence[int] = (),
    host_input: HostInput = "local",
) -> SpmdFunction | Callable[[Callable[..., Any]], SpmdFunction]:
    """Compiles ``fn`` to run once per device of ``mesh``, on the blocks that ``in_specs`` describe.

    Usable as ``spmd(fn, in_specs=..., out_specs=...)`` or as a decorator ``@spmd(in_specs=..., ...)``.
    Compiled functions are cached per (function, mesh, specs, backend, options) and per input shape, so
    repeated calls with same-shaped inputs neither re-trace nor re-compile.

    Args:
      fn: the per-device function. Inside it, collectives name the mesh axes. Leave it out to get a decorator.
      in_specs: a ``PartitionSpec`` for all arguments, or a pytree prefix of the argument tuple.
      out_specs: a ``PartitionSpec`` or a pytree prefix of the output.
      mesh: the device mesh; ``None`` uses :func:`spmdcomm.default_mesh` (1-D ``"data"`` over all devices).
      backend: ``"shard_map"`` (default) or ``"pmap"`` (legacy, 1-D meshes only).
      check_vma: shard_map's check that ``out_specs=P()`` outputs really are identical on every device.
      donate_argnums: arguments whose buffers the call may reuse for its outputs.
      host_input: what a host (NumPy) argument means with several processes: ``"local"`` (default), this
        process's part of the global array; ``"global"``, the full value, the same on every process. See
        :mod:`spmdcomm.data.placement`. With one process both mean the same.

    Returns:
      An :class:`SpmdFunction` to call like ``fn``; without ``fn``, a decorator that makes one.

    Raises:
      BackendError: if ``backend`` is neither ``"shard_map"`` nor ``"pmap"``.
      SpmdError: if ``host_input`` is neither ``"local"`` nor ``"global"``.

    Examples:
      >>> f = sc.spmd(lambda x: x * sc.axis_size("data"), in_specs=sc.P("data"), out_specs=sc.P("data"))
      >>> f(np.ones(8)).tolist()
      [8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    """
    check_backend("spmd", backend)
    check_host_input("spmd", host_input)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)

    def wrap(f: Callable[..., Any]) -> SpmdFunction:
        return SpmdFunction(
            f,
            in_specs=in_specs,
            out_specs=out_specs,
            mesh=mesh,
            backend=backend,
            check_vma=check_vma,
            donate_argnums=donate,
            host_input=host_input,
        )

    return wrap if fn is None else wrap(fn)


def check_backend(fn: str, backend: str) -> None:
    """Raises :class:`BackendError` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise BackendError(describe(fn, f"unknown backend {backend!r}.", fix=f"use one of {BACKENDS}."))


class SpmdFunction:
    """What :func:`spmd` returns (``spmdcomm.collectives.SpmdFunction``, not in ``sc``); call it like the original.

    Build it through :func:`spmd`, which checks ``backend`` and ``host_input`` and turns an int
    ``donate_argnums`` into a tuple. Each argument below is kept as an attribute of the same name.

    Args:
      fn: the per-device function.
      in_specs: a ``PartitionSpec`` for all arguments, or a pytree prefix of the argument tuple.
      out_specs: a ``PartitionSpec`` or a pytree prefix of the output.
      mesh: the device mesh, or ``None`` for :func:`spmdcomm.default_mesh` at each call.
      backend: ``"shard_map"`` or ``"pmap"``.
      check_vma: shard_map's check that ``out_specs=P()`` outputs really are identical on every device.
      donate_argnums: the indices of the arguments whose buffers the call may reuse for its outputs.
      host_input: what a host (NumPy) argument means with several processes: ``"local"`` (default) or
        ``"global"`` (see :func:`spmd`).
    """

    __name__: str  # the wrapped function's (copied by functools.update_wrapper in __init__), or its type's

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        in_specs: Any,
        out_specs: Any,
        mesh: Mesh | None,
        backend: str,
        check_vma: bool,
        donate_argnums: tuple[int, ...],
        host_input: HostInput = "local",
    ):
        self.fn = fn
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        self.backend = backend
        self.check_vma = check_vma
        self.donate_argnums = donate_argnums
        self.host_input = host_input
        functools.update_wrapper(self, fn)
        if "__name__" not in self.__dict__:  # a functools.partial or another callable object has no __name__
            inner = getattr(getattr(fn, "func", None), "__name__", None)  # a partial's function's name
            self.__name__ = f"partial({inner})" if inner is not None else type(fn).__name__
        # (treedef, mesh) -> the program and the input shardings of the last call: the fast path of __call__
        self._fast = Cache(limit=64)

    def __call__(self, *args: Any) -> Any:
        """Runs the compiled function on ``args`` and returns its output as global arrays.

        Arguments not yet placed as ``in_specs`` say are placed first (:meth:`place`); a call whose leaves all
        sit where the previous call with the same tree placed them skips that walk. Inside a traced function
        (``jax.jit``, ``jax.grad``, ``jax.vmap``, ``jax.checkpoint``) the outer trace owns placement, so the call
        is exactly the raw ``shard_map`` (or ``pmap``) program, with the same input checks.

        Args:
          *args: the arguments of ``fn``: ``jax.Array`` values, host values (NumPy) or numbers.

        Returns:
          ``fn``'s output, its blocks assembled into global arrays as ``out_specs`` say.

        Raises:
          DeletedArrayError: if an argument holds a deleted array (e.g. donated to an earlier call).
          AxisError: if a spec names an axis the mesh does not have.
          ShapeError: if a split dimension does not divide into the mesh's blocks.
          BackendError: with ``backend="pmap"``, for a mesh that is not 1-D, a spec that splits more than one
            dimension, or a traced call in a job of several processes.
          SpmdError: if a spec is not a ``PartitionSpec``, ``in_specs`` has another number of entries than
            ``args``, or an argument leaf is neither an array nor a number.
          ProcessMismatchError: with several processes, if they pass leaves that would build different global
            arrays.
        """
        mesh = self.resolved_mesh()
        leaves, treedef = jax.tree.flatten(args)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            # Called inside the user's jit / grad / vmap / checkpoint: the outer trace owns placement, so
            # the call is exactly the raw shard_map (or pmap) program, with the same input checks.
            self._check_traced(mesh, args)
            return self.program(mesh)(*args)
        # A deleted (donated) buffer handed to XLA can crash the process: raise first.
        check_not_deleted(self.__name__, args, arg="args", fix=_DONATED_FIX, leaves=leaves)
        if debug.enabled():  # SPMDCOMM_DEBUG: processes compare the call before placing inputs
            debug.check_call(self.__name__, args, in_specs=self.in_specs, mesh=mesh)
        hit = self._fast.get((treedef, mesh))
        # Fast path: every leaf already sits where the last call placed it (one == per leaf, no pytree walk).
        if hit is not None and all(getattr(x, "sharding", None) == s for x, s in zip(leaves, hit[1])):
            with _compile_watch.call():  # a new shape compiles: the caller's PhaseTimer counts it as "compile"
                return hit[0](*args)
        placed = self.place(args)
        compiled = self.program(mesh)
        self._fast.put((treedef, mesh), (compiled, [x.sharding for x in jax.tree.leaves(placed)]))
        with _compile_watch.call():
            return compiled(*placed)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Places ``args`` and lowers the compiled function for them (``.compile().as_text()`` gives HLO).

        Args:
          *args: the arguments of a call, as for :meth:`__call__`.

        Returns:
          The ``jax.stages.Lowered`` program for these arguments' shapes and shardings.

        Raises:
          BackendError: with ``backend="pmap"`` in a job of several processes, which has no single program.
          SpmdError: for arguments that :meth:`place` rejects (an ``AxisError``, ``ShapeError`` or
            ``BackendError`` among them, as listed there).
        """
        placed = self.place(args)
        return self.program().lower(*placed)

    def resolved_mesh(self) -> Mesh:
        """The mesh this function runs on: its own, or :func:`spmdcomm.default_mesh`.

        Returns:
          ``self.mesh`` if it was given, else the current default mesh.
        """
        return self.mesh if self.mesh is not None else default_mesh()

    def place(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """Puts every argument leaf on the mesh as ``in_specs`` say, checking that the split fits.

        Host leaves follow :mod:`spmdcomm.data.placement`'s rule under this function's ``host_input``; all of
        them go to the devices in one batched call. Leaves already placed so are returned as they are.

        Args:
          args: the arguments of a call, one entry per positional argument of ``fn``.

        Returns:
          A tuple like ``args`` whose leaves are ``jax.Array`` values with the shardings their specs name.

        Raises:
          AxisError: if a spec names an axis the mesh does not have.
          ShapeError: if a split dimension does not divide into the mesh's blocks.
          BackendError: with ``backend="pmap"``, for a mesh that is not 1-D or a spec that splits more than one
            dimension.
          SpmdError: if a spec is not a ``PartitionSpec``, ``in_specs`` has another number of entries than
            ``args``, or an argument leaf is neither an array nor a number.
          ProcessMismatchError: with several processes, if they pass leaves that would build different global
            arrays.
        """
        mesh = self.resolved_mesh()
        leaves: list[Any] = []
        shardings: list[NamedSharding] = []
        names: list[str] = []

        def collect(leaf: Any, spec: P, name: str) -> int:
            leaves.append(leaf)
            shardings.append(NamedSharding(mesh, spec))
            names.append(name)
            return len(leaves) - 1

        positions = self._map_args(mesh, args, collect)
        placed = place_leaves(self.__name__, leaves, shardings, names=lambda: names, host_input=self.host_input)
        return jax.tree.map(lambda i: placed[i], positions)

    def _check_traced(self, mesh: Mesh, args: Sequence[Any]) -> None:
        if self.backend == "pmap" and jax.process_count() > 1:
            raise BackendError(
                describe(
                    self.__name__,
                    "backend='pmap' cannot run inside jax.jit, jax.grad or another traced function "
                    "when the job has several processes (JAX cannot stage pmap into jit across processes).",
                    fix="use backend='shard_map' (the default), or call the function outside the traced code.",
                )
            )
        self._map_args(mesh, args, lambda leaf, spec, name: leaf)

    def _map_args(self, mesh: Mesh, args: Sequence[Any], put: Callable[[Any, P, str], Any]) -> tuple[Any, ...]:
        """Checks every argument leaf against its spec and the mesh, then maps ``put(leaf, spec, name)`` over
        them. Host leaves are checked against the blocks when placed, where the host-input rule is known."""
        specs = arg_specs(self.in_specs, args, "in_specs")

        def one(path: Any, spec: P | None, leaf: Any) -> Any:
            name = "args" + jax.tree_util.keystr(path)
            spec = P() if spec is None else spec
            _check_spec(self.__name__, name, spec, mesh, self.backend)
            if not hasattr(leaf, "shape"):
                if not isinstance(leaf, (int, float, bool, complex)):
                    raise SpmdError(
                        describe(
                            self.__name__,
                            f"argument is a {type(leaf).__name__}, not an array.",
                            leaf=name,
                            fix="pass arrays or numbers, or close over other values.",
                        )
                    )
                leaf = jnp.asarray(leaf)
            if isinstance(leaf, jax.Array):  # also tracers: the global shape is known
                check_divisible(self.__name__, name, leaf.shape, NamedSharding(mesh, spec))
            return put(leaf, spec, name)

        return tuple(
            jax.tree_util.tree_map_with_path(
                lambda path, spec, sub: jax.tree_util.tree_map_with_path(
                    lambda p2, leaf: one(path + p2, spec, leaf), sub
                ),
                specs,
                tuple(args),
                is_leaf=is_spec,
            )
        )

    def program(self, mesh: Mesh | None = None) -> jax.stages.Wrapped:
        """The jitted ``shard_map`` (or ``pmap``) program on ``mesh``, without the per-call checks and placement.

        Its arguments must already be placed as ``in_specs`` say. Programs are cached per (function, mesh,
        specs, backend, options).

        Args:
          mesh: the mesh to run on; ``None`` (default) uses :meth:`resolved_mesh`.

        Returns:
          The jitted program (a ``jax.stages.Wrapped``).

        Raises:
          BackendError: with ``backend="pmap"``, if ``mesh`` is not 1-D.
        """
        mesh = self.resolved_mesh() if mesh is None else mesh
        key = (
            self.fn,
            mesh,
            hashable_specs(self.in_specs),
            hashable_specs(self.out_specs),
            self.backend,
            self.check_vma,
            self.donate_argnums,
        )
        return _build(key, self)


# ---------------------------------------------------------------------------------------------------------


_PROGRAMS = Cache(limit=512)  # (function, mesh, specs, backend, options) -> the jitted program


def _build(key: tuple[Any, ...], sf: SpmdFunction) -> jax.stages.Wrapped:
    return _PROGRAMS.get_or_make(key, lambda: _make(sf, key[1]))


def _make(sf: SpmdFunction, mesh: Mesh) -> jax.stages.Wrapped:
    if sf.backend == "shard_map":
        mapped = jax.shard_map(
            sf.fn, mesh=mesh, in_specs=_as_tuple_specs(sf.in_specs), out_specs=sf.out_specs, check_vma=sf.check_vma
        )

        @functools.wraps(mapped)  # the program keeps the name it would have without this wrapper
        def traced(*args: Any) -> Any:
            _compile_watch.tracing()
            return mapped(*args)

        return jax.jit(traced, donate_argnums=sf.donate_argnums)
    return make_pmap(sf, mesh)


def _as_tuple_specs(in_specs: Any) -> Any:
    # shard_map takes a single P as "every argument"; lists become tuples so the prefix matches *args.
    return in_specs if is_spec(in_specs) else tuple(in_specs)


def _check_spec(fn: str, name: str, spec: P, mesh: Mesh, backend: str) -> None:
    if not isinstance(spec, P):
        raise SpmdError(
            describe(
                fn,
                f"spec {spec!r} is not a PartitionSpec.",
                leaf=name,
                fix="use spmdcomm.P(...), e.g. P('data') or P().",
            )
        )
    for entry in spec:
        check_mesh_axes(fn, mesh, entry if isinstance(entry, tuple) else entry)
    if backend == "pmap":
        check_pmap_spec(fn, name, spec, mesh)


_DONATED_FIX = (
    "an argument listed in donate_argnums is consumed by the call; keep the call's output instead, pass a copy "
    "(jnp.copy), or leave that argument out of donate_argnums."
)
