"""Error types raised by spmdcomm.

Every error says which function and argument were wrong, which pytree leaf and mesh axis were involved, the
sizes that did not fit, and how to fix it. All input errors derive from :class:`SpmdError`, itself a
``ValueError``, so code that already catches ``ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "SpmdError",
    "AxisError",
    "ShapeError",
    "BackendError",
    "ReplicatedReductionWarning",
    "ReplicaDivergenceError",
    "DistributedError",
    "CoordinatorError",
    "BarrierTimeoutError",
    "ProcessMismatchError",
    "RemoteProcessError",
]


class SpmdError(ValueError):
    """Bad input to an spmdcomm function (base class of the more specific errors below)."""


class AxisError(SpmdError):
    """An axis name that is not bound here, or a device index (``root``, permutation) outside the axis."""


class ShapeError(SpmdError):
    """A leaf whose shape does not fit the collective (e.g. a dimension the axis size does not divide)."""


class BackendError(SpmdError):
    """The chosen backend cannot express what was asked (e.g. a 2-D mesh under ``backend="pmap"``)."""


class ReplicatedReductionWarning(UserWarning):
    """A sum/mean over an axis along which the value is already identical on every device.

    ``psum`` of such a value multiplies it by the axis size, and ``pmean`` is a no-op. Inside ``shard_map``
    with ``check_vma=True`` this is the classic gradient trap: ``jax.grad`` with respect to replicated
    parameters already returns the gradient summed over the axis.
    """


class DistributedError(RuntimeError):
    """A multi-process operation failed at run time (base class of the errors below).

    Not a :class:`SpmdError`: the input was fine, but the processes of the job did not cooperate.
    """


class CoordinatorError(DistributedError, ConnectionError):
    """The coordinator of a multi-process job could not be reached, or cannot listen on its port."""


class BarrierTimeoutError(DistributedError, TimeoutError):
    """Not every process arrived in time; the message names the missing ones and where each was."""


class ProcessMismatchError(DistributedError):
    """Processes reached different barriers, or called the same function with different inputs."""


class RemoteProcessError(DistributedError):
    """Another process failed in a block this process was waiting for; the message has its error."""


class ReplicaDivergenceError(SpmdError):
    """A value that should be identical on every device (replicated parameters, optimizer state) is not."""


def describe(fn: str, message: str, *, fix: str | None = None, leaf: str | None = None) -> str:
    """Formats an error message: ``spmdcomm.FN: [leaf PATH: ]MESSAGE. Fix: FIX``."""
    where = f"leaf {leaf}: " if leaf else ""
    text = f"spmdcomm.{fn}: {where}{message}"
    if fix:
        text += f" Fix: {fix}"
    return text
