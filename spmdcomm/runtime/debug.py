"""Debug mode: processes check that they call each spmd function with the same inputs.

A multi-process program hangs, aborts or silently computes garbage when its processes call a
compiled function with different shapes, dtypes or shardings. With ``SPMDCOMM_DEBUG=1`` in the
environment (or ``spmdcomm.set_debug(True)``), every call of an :func:`spmdcomm.spmd` function
first compares a fingerprint of the call across processes (function name and, per input leaf,
shape, dtype and sharding) through the coordination service; on a mismatch every process raises
:class:`~spmdcomm.errors.ProcessMismatchError` naming the differing process and the difference.
This is the counterpart of ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Each call then costs one host round
trip, so keep it for debugging. With one process there is nothing to compare and the check is
skipped.

>>> import spmdcomm as sc
>>> sc.set_debug(True); sc.runtime.debug_enabled()
True
>>> sc.set_debug(None)   # back to the SPMDCOMM_DEBUG environment variable
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from spmdcomm.runtime.process import process_count
from spmdcomm.runtime.transport import check_same_across_processes

__all__ = ["set_debug", "enabled", "check_call", "fingerprint", "ENV_DEBUG"]

ENV_DEBUG = "SPMDCOMM_DEBUG"

_override: list[bool | None] = [None]


def set_debug(on: bool | None = True) -> None:
    """Turns debug mode on or off for this process; ``None`` defers to ``SPMDCOMM_DEBUG`` again.

    Every process must make the same choice: the check is a sync point that all of them join.

    Args:
      on: True to check every :func:`spmdcomm.spmd` call across processes, False to skip the check, None to
        follow ``SPMDCOMM_DEBUG``.

    Examples:
      >>> sc.set_debug(False); sc.runtime.debug_enabled()
      False
      >>> sc.set_debug(None)
    """
    _override[0] = on


def enabled() -> bool:
    """Whether debug mode is on: :func:`set_debug`, else ``SPMDCOMM_DEBUG`` set and not ``0``.

    Returns:
      The last :func:`set_debug` choice other than None; else True when ``SPMDCOMM_DEBUG`` is set to anything
      but empty, ``0``, ``false``, ``no`` or ``off`` (any case).
    """
    if _override[0] is not None:
        return _override[0]
    return os.environ.get(ENV_DEBUG, "").strip().lower() not in ("", "0", "false", "no", "off")


def check_call(name: str, args: Sequence[Any], *, in_specs: Any = None, mesh: Mesh | None = None) -> None:
    """Raises :class:`~spmdcomm.errors.ProcessMismatchError` on every process unless all processes
    call function ``name`` with the same input structure, shapes, dtypes, shardings, specs and mesh.

    The message names each process that differs from process 0 and its differing entries of the
    :func:`fingerprint` (``function``, ``in_specs``, ``mesh``, ``args<path>``) with both processes' values.

    Runs before the inputs are placed: placing host data on a multi-process mesh is itself a
    cross-process transfer, which aborts when the shapes differ.

    >>> check_call("step", (np.zeros(3),))   # one process: nothing to compare
    """
    if process_count() == 1:
        return
    fp = fingerprint(name, args, in_specs=in_specs, mesh=mesh)
    signature = {key: str(fp[key]) for key in ("function", "in_specs", "mesh")}
    for path, (shape, dtype, sharding) in fp["leaves"].items():
        signature[f"args{path}"] = f"shape {shape}, dtype {dtype}, sharding {sharding}"
    check_same_across_processes(
        name,
        "inputs to the spmd debug check",
        signature,
        fix="give every process inputs of the same global shape, dtype and sharding (pad the "
        "last batch, e.g. with spmdcomm.pad_batch), and call the same functions in the same "
        "order.",
        label="spmd debug check",
    )


def fingerprint(name: str, args: Sequence[Any], *, in_specs: Any = None, mesh: Mesh | None = None) -> dict[str, Any]:
    """What :func:`check_call` compares: name, specs, mesh, ``path -> (shape, dtype, sharding)``.

    >>> fingerprint("f", (np.zeros((2, 3), np.float32),))["leaves"]
    {'[0]': ((2, 3), 'float32', None)}
    """
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    return {
        "function": name,
        "in_specs": str(in_specs),
        "mesh": None if mesh is None else str(dict(mesh.shape)),
        "leaves": {jax.tree_util.keystr(path): _leaf(x) for path, x in leaves},
    }


# ------------------------------------------------------------------------------------------------


def _leaf(x: Any) -> tuple[tuple[int, ...], str, str | None]:
    dtype = str(getattr(x, "dtype", type(x).__name__))
    sharding = getattr(x, "sharding", None)
    where: str | None
    if isinstance(sharding, NamedSharding):
        where = f"{sharding.spec} over mesh {dict(sharding.mesh.shape)}"
    else:
        where = None if sharding is None else type(sharding).__name__
    return tuple(getattr(x, "shape", ())), dtype, where
