"""Error and warning types of spmdcomm.

Every error says which function and argument were wrong, which pytree leaf and mesh axis were involved, the
sizes that did not fit, and how to fix it. All input errors derive from :class:`SpmdError`, itself a
``ValueError``, so code that already catches ``ValueError`` keeps working. Failures of a run whose input
was fine (processes that do not cooperate, replicas that drift apart) derive from
:class:`DistributedError`, a ``RuntimeError``.
"""

from __future__ import annotations

from typing import Any

from spmdcomm._cache import Cache

__all__ = [
    "SpmdError",
    "AxisError",
    "ShapeError",
    "BackendError",
    "DeletedArrayError",
    "TracedCallError",
    "ReplicatedReductionWarning",
    "CheckpointDamagedWarning",
    "MissingLogicalRuleWarning",
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


class DeletedArrayError(SpmdError, RuntimeError):
    """An argument holds an array whose buffers were already freed, usually by an earlier call's donation.

    The earlier call consumed it through buffer donation (``donate=True``, ``donate_argnums``). Raised
    before dispatch: handing a deleted array to a compiled computation can kill the process
    (JAX 0.10 segfaults on multi-device CPU). It is an :class:`SpmdError` because the caller passed a
    stale value, and a ``RuntimeError`` so code written against JAX's own "Array has been deleted"
    error still catches it.
    """


class TracedCallError(SpmdError):
    """A host-side call (barrier, host collective, ...) made inside a traced function.

    There it would run once at trace time and be missing from the compiled program.
    """


class ReplicatedReductionWarning(UserWarning):
    """A sum/mean over an axis along which the value is already identical on every device.

    ``psum`` of such a value multiplies it by the axis size, and ``pmean`` is a no-op. Inside ``shard_map``
    with ``check_vma=True`` this is the classic gradient trap: ``jax.grad`` with respect to replicated
    parameters already returns the gradient summed over the axis.
    """


class CheckpointDamagedWarning(UserWarning):
    """A checkpoint was skipped (or replaced) because a file that restoring it needs is missing or unreadable.

    Emitted when :func:`~spmdcomm.checkpoint.latest_checkpoint_step`,
    :func:`~spmdcomm.checkpoint.restore_checkpoint` or :func:`~spmdcomm.checkpoint.checkpoint_extra`
    fall back to an older intact checkpoint, and when :func:`~spmdcomm.checkpoint.save_checkpoint` replaces a
    damaged checkpoint of the step it saves (as :func:`spmdcomm.fit` does after resuming from an older one). The
    message names each damaged step, the directory and what is damaged.
    """


class MissingLogicalRuleWarning(UserWarning):
    """A parameter's logical axis name has no rule, so its dimension stays whole (not split), as Flax leaves it.

    Emitted once by :meth:`TrainState.create <spmdcomm.TrainState.create>` (default
    ``missing_logical_rules="warn"``), naming every such parameter, the logical name and the rule to add. Filter it
    by category (``warnings.filterwarnings("ignore", category=sc.MissingLogicalRuleWarning)``), or add a rule such as
    ``("mlp", None)``; ``missing_logical_rules="error"`` raises :class:`AxisError` instead.
    """


class DistributedError(RuntimeError):
    """A distributed run failed at run time (base class of the errors below).

    Not a :class:`SpmdError`: the input was fine, but the processes of the job did not cooperate, or
    the devices' copies of a replicated value drifted apart.
    """


class CoordinatorError(DistributedError, ConnectionError):
    """The coordinator of a multi-process job could not be reached, or cannot listen on its port."""


class BarrierTimeoutError(DistributedError, TimeoutError):
    """Not every process arrived in time; the message names the missing ones and where each was."""


class ProcessMismatchError(DistributedError):
    """Processes reached different barriers, or called the same function with different inputs."""


class RemoteProcessError(DistributedError):
    """Another process failed in a block this process was waiting for; the message has its error."""


class ReplicaDivergenceError(DistributedError):
    """A value that should be identical on every device (replicated parameters, optimizer state) is not.

    A :class:`DistributedError` (so a ``RuntimeError``), not an input error: the state was consistent
    once and the run made it diverge, e.g. through non-deterministic or process-dependent code.
    (Before 0.2.0 it derived from :class:`SpmdError`, a ``ValueError``.)
    """


def describe(fn: str, message: str, *, fix: str | None = None, leaf: str | None = None) -> str:
    """Formats an error message: ``spmdcomm.FN: [leaf PATH: ]MESSAGE. Fix: FIX``."""
    where = f"leaf {leaf}: " if leaf else ""
    text = f"spmdcomm.{fn}: {where}{message}"
    if fix:
        text += f" Fix: {fix}"
    return text


def check_not_deleted(fn: str, tree: Any, *, arg: str, fix: str, leaves: list[Any] | None = None) -> None:
    """Raises :class:`DeletedArrayError` if any ``jax.Array`` leaf of ``tree`` has been deleted.

    Call it on donated arguments before dispatching a compiled function. The message names ``arg``,
    the first deleted leaf's path and how many leaves are gone; ``fix`` says how to keep the value
    (e.g. ``"pass donate=False, or copy the state first"``). Tracers and non-array leaves are
    skipped, so it is safe inside a trace. Cost: one tree flatten plus ``is_deleted()`` per leaf
    (pass ``leaves=jax.tree.leaves(tree)`` when the caller flattens ``tree`` anyway); paths are only
    computed once something is found.
    """
    import jax  # here, not at the top: the launcher imports this module without starting JAX (spmdcomm._env)

    leaves = jax.tree.leaves(tree) if leaves is None else leaves
    # An inlined loop: this runs on every train step, over every leaf of the state.
    concrete = _CONCRETE_ARRAY
    for x in leaves:
        kind: type = type(x)  # declared: mypy takes type[Any], unlike type, for unhashable
        known = concrete.get(kind)
        if known is None:
            known = _has_buffers(kind)
        if known and x.is_deleted():
            break
    else:
        return
    with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    gone = [jax.tree_util.keystr(path) for path, x in with_paths if _has_buffers(type(x)) and x.is_deleted()]
    raise DeletedArrayError(
        describe(
            fn,
            f"`{arg}` holds {len(gone)} deleted array(s) out of {len(leaves)} leaves: their buffers were "
            f"freed, most likely donated to an earlier call, which consumed them. Passing them on would "
            f"crash the process.",
            leaf=f"{arg}{gone[0]}",
            fix=fix,
        )
    )


def _has_buffers(t: type) -> bool:
    # Only concrete arrays have buffers (``is_deleted()`` on a tracer raises instead of answering).
    # The answer per type is cached: ``isinstance`` against ``jax.Array`` is an ABC check that costs
    # more than ``is_deleted()`` itself.
    import jax

    return _CONCRETE_ARRAY.get_or_make(t, lambda: issubclass(t, jax.Array) and not issubclass(t, jax.core.Tracer))


_CONCRETE_ARRAY = Cache(limit=256)  # type -> whether its instances have buffers
