"""Hooks: functions :func:`~spmdcomm.fit` runs on the host between steps, every ``n`` global steps or at the end
of every ``n`` epochs (evaluation, logging, sample generation), and the checks and schedule ``fit`` runs them by."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from spmdcomm.errors import SpmdError, describe
from spmdcomm.train.state import TrainState

__all__ = ["Hook"]


@dataclasses.dataclass(frozen=True)
class Hook:
    """A function :func:`~spmdcomm.fit` calls between steps: ``fn(state, *, step, epoch) -> dict | None``.

    Give exactly one of ``every_steps`` and ``every_epochs``. ``fn``'s ``step`` is the global step count
    (``state.step``, an int), ``epoch`` the 0-based epoch of that step's batch, as the data counts it (0 in the first
    epoch; for an epoch hook, the epoch that just ended; ``None`` when the data counts no epochs). ``state`` is the
    state after the step: use it before returning
    (the next step consumes it). The returned dict of scalars (e.g. evaluation metrics from
    :func:`spmdcomm.evaluate`) joins that step's metrics in ``fit``'s history, log and callback.

    Args:
      fn: the callable ``fn(state, *, step, epoch) -> dict | None``; ``epoch`` is 0-based.
      every_steps: run after every ``every_steps``-th global step (``state.step`` a multiple of it).
      every_epochs: run after the last step of every ``every_epochs``-th epoch, i.e. of the 0-based epochs
        ``every_epochs - 1``, ``2 * every_epochs - 1``, ... (the data must count epochs, as
        :class:`spmdcomm.Loader` does).

    Raises:
      SpmdError: when ``fn`` is not callable, or not exactly one of ``every_steps`` and ``every_epochs`` is given
        as a positive int.

    Examples:
      >>> seen = []
      >>> sc.Hook(lambda state, *, step, epoch: seen.append(step), every_steps=100).every_steps
      100
    """

    fn: Callable[..., dict[str, Any] | None]
    every_steps: int | None = None
    every_epochs: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise SpmdError(describe("Hook", f"fn={self.fn!r} is not callable.", fix="pass fn(state, *, step, epoch)."))
        given = [name for name in ("every_steps", "every_epochs") if getattr(self, name) is not None]
        if len(given) != 1:
            raise SpmdError(
                describe(
                    "Hook",
                    f"give exactly one of every_steps and every_epochs (got {given or 'neither'}).",
                    fix="e.g. sc.Hook(evaluate_fn, every_epochs=1) or sc.Hook(log_fn, every_steps=100).",
                )
            )
        optional_positive(given[0], getattr(self, given[0]), fn="Hook")


# ---------------------------------------------------------------------------------------------------------


def check_hooks(hooks: Any, data: Any) -> tuple[Hook, ...]:
    """``fit``'s ``hooks`` as a tuple, each a :class:`Hook`; epoch hooks only over ``data`` that counts epochs."""
    hooks = tuple(hooks)
    for h in hooks:
        if not isinstance(h, Hook):
            raise SpmdError(
                describe(
                    "fit",
                    f"hooks holds a {type(h).__name__}, not a spmdcomm.Hook.",
                    fix="wrap the function: hooks=[sc.Hook(fn, every_epochs=1)].",
                )
            )
    if any(h.every_epochs is not None for h in hooks) and data_epoch(data) is None:
        raise SpmdError(
            describe(
                "fit",
                f"a Hook with every_epochs needs data that counts epochs, but data is a {type(data).__name__} "
                "without state_dict()['epoch'].",
                fix="pass a sc.Loader(dataset, sampler, batch_size=..., epochs=...), or use every_steps.",
            )
        )
    return hooks


def due_hooks(hooks: tuple[Hook, ...], step: int, epoch: int | None, *, ended_epoch: bool) -> list[Hook]:
    """The hooks to run after global step ``step`` (of epoch ``epoch``, its last one when ``ended_epoch``)."""
    return [h for h in hooks if _is_due(h, step, epoch, ended_epoch=ended_epoch)]


def run_hooks(hooks: list[Hook], state: TrainState, step: int, epoch: int | None, *, taken: Any) -> dict[str, Any]:
    """What ``hooks`` returned after global step ``step``, checked against the step's metrics ``taken``."""
    out: dict[str, Any] = {}
    for h in hooks:
        result = h.fn(state, step=step, epoch=epoch)
        if result is None:
            continue
        if not isinstance(result, dict):
            raise SpmdError(
                describe("fit", f"hook {h.fn!r} returned a {type(result).__name__}; expected a dict or None.")
            )
        clash = sorted(k for k in result if k in taken or k in out or k.startswith("time/"))
        if clash:
            raise SpmdError(
                describe(
                    "fit",
                    f"hook {h.fn!r} returned {clash}, which name metrics the step or another hook already reports.",
                    fix="prefix the hook's metrics, e.g. 'eval/accuracy'.",
                )
            )
        out.update(result)
    return out


def data_epoch(data: Any) -> int | None:
    """The epoch of the next batch ``data`` hands out, when it counts epochs (a :class:`spmdcomm.Loader`)."""
    position = getattr(data, "state_dict", None)
    position = position() if callable(position) else None
    epoch = position.get("epoch") if isinstance(position, dict) else None
    return epoch if isinstance(epoch, int) else None


def optional_positive(name: str, value: Any, *, fn: str = "fit") -> int | None:
    """``value``, checked to be a positive int or None (``fn``'s argument ``name``: a Hook's or ``fit``'s)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpmdError(describe(fn, f"{name}={value!r} must be a positive int or None.", fix=f"e.g. {name}=100."))
    return value


def _is_due(hook: Hook, step: int, epoch: int | None, *, ended_epoch: bool) -> bool:
    if hook.every_steps is not None:
        return step % hook.every_steps == 0
    assert hook.every_epochs is not None  # Hook.__post_init__ takes exactly one of the two
    return ended_epoch and epoch is not None and (epoch + 1) % hook.every_epochs == 0
