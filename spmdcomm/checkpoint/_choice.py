"""Which checkpoint to use, agreed by every process: the newest one every process finds intact (or the one asked
for), with a warning naming each newer damaged one; and making room for a save over a damaged checkpoint. What
"intact" means is :mod:`spmdcomm.checkpoint._disk`'s."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from spmdcomm.checkpoint._disk import damage
from spmdcomm.errors import CheckpointDamagedWarning, SpmdError, describe
from spmdcomm.runtime.process import process_count
from spmdcomm.runtime.transport import exchange


def chosen_step(
    fn: str, directory: str | os.PathLike[str], mgr: Any, step: int | None, *, missing_ok: bool
) -> int | None:
    """``step`` if every process finds that checkpoint intact, or without ``step`` the newest checkpoint every
    process finds intact (warning about newer damaged ones); raises naming the damage otherwise. A directory
    without any checkpoint gives None with ``missing_ok``, and raises without."""
    steps = list(mgr.all_steps())
    if step is None:
        chosen, damaged = _newest_intact(fn, directory, steps)
        if chosen is None and damaged:
            raise SpmdError(
                describe(
                    fn,
                    f"every checkpoint in {os.fspath(directory)!r} is damaged: {_listed(damaged)}.",
                    fix="restore the directory from a copy, or start afresh in an empty directory.",
                )
            )
        if damaged:
            warnings.warn(
                describe(
                    fn,
                    f"checkpoint(s) {sorted(damaged)} in {os.fspath(directory)!r} are damaged, so checkpoint {chosen}, "
                    f"the newest intact one, is used: {_listed(damaged)}.",
                    fix="nothing, if going back to that checkpoint is fine (a save of a damaged step replaces it); "
                    "otherwise find what damaged the newer ones (a full disk, an interrupted copy).",
                ),
                CheckpointDamagedWarning,
                stacklevel=3,
            )
    else:
        views = _views_of_step(fn, directory, steps, step)
        chosen = step if any(step in view["steps"] for view in views) else None
        problems = _problems(views, step) if chosen is not None else []
        if problems:
            raise SpmdError(
                describe(
                    fn,
                    f"checkpoint {step} in {os.fspath(directory)!r} is damaged: {'; '.join(problems)}.",
                    fix=f"leave out step= to use the newest intact checkpoint, or pass another of {sorted(steps)}.",
                )
            )
        if chosen is None and any(view["steps"] for view in views):
            missing_ok = False  # asking for a step that is not among the saved ones is a mistake
    if chosen is None and not missing_ok:
        there = f"it has steps {sorted(steps)}" if os.path.isdir(directory) else "the directory does not exist"
        raise SpmdError(
            describe(
                fn,
                f"no checkpoint {'at all' if step is None else f'for step {step}'} in {os.fspath(directory)!r} "
                f"({there}).",
                fix="check the directory, or save first with spmdcomm.save_checkpoint.",
            )
        )
    return chosen


def make_room(directory: str | os.PathLike[str], mgr: Any, step: int) -> None:
    """Deletes checkpoint ``step`` before it is saved again when it is damaged (``fit`` resumed from an older one
    and reached that step); raises when it is intact, or when only some processes see it."""
    steps = list(mgr.all_steps())
    views = _views_of_step("save_checkpoint", directory, steps, step)
    seen = [p for p, view in enumerate(views) if step in view["steps"]]
    if not seen:
        return
    problems = _problems(views, step)
    if len(seen) < len(views) or not problems:
        where = "" if len(seen) == len(views) else f" on process(es) {seen} only (the processes see different files)"
        raise SpmdError(
            describe(
                "save_checkpoint",
                f"checkpoint {step} already exists in {os.fspath(directory)!r}{where}.",
                fix="pass another step=, delete that checkpoint first, or give this run a directory of its own "
                "that every process reaches.",
            )
        )
    warnings.warn(
        describe(
            "save_checkpoint",
            f"checkpoint {step} in {os.fspath(directory)!r} is damaged ({'; '.join(problems)}); this save replaces it.",
        ),
        CheckpointDamagedWarning,
        stacklevel=3,
    )
    mgr.delete(step)


def _newest_intact(
    fn: str, directory: str | os.PathLike[str], steps: list[int]
) -> tuple[int | None, dict[int, list[str]]]:
    """The newest checkpoint that every process finds intact (None when there is none), and the damage of each
    newer one.

    Each process checks its checkpoints from the newest down to the first intact one, and the processes exchange
    what they found; a checkpoint that one process found intact but another has not checked yet starts another
    round below it. Every process computes the same rounds from the same exchanged views.
    """
    found: dict[int, list[str]] = {}  # this process's checks, kept across rounds
    bound = math.inf
    while True:
        for step in sorted((s for s in steps if s <= bound), reverse=True):
            if step not in found:
                found[step] = damage(_step_path(directory, step))
            if not found[step]:
                break
        views = _exchange_views(fn, steps, found)
        damaged: dict[int, list[str]] = {}
        for step in sorted({s for view in views for s in view["steps"]}, reverse=True):
            problems = _problems(views, step)
            if problems is None:  # intact wherever checked, not yet checked everywhere
                bound = step
                break
            if not problems:
                return step, damaged
            damaged[step] = problems
        else:
            return None, damaged


def _exchange_views(fn: str, steps: list[int], found: dict[int, list[str]]) -> list[dict[str, Any]]:
    """Every process's view of the directory, in process order: its steps and the damage it found in the steps it
    checked (``[]``: intact). One sync point in a multi-process job; nothing is exchanged with one process."""
    view = {"steps": sorted(steps), "damage": {str(s): problems for s, problems in found.items()}}
    if process_count() == 1:
        return [view]
    return [json.loads(b) for b in exchange(fn, f"{fn}: which checkpoints are intact", json.dumps(view).encode())]


def _views_of_step(fn: str, directory: str | os.PathLike[str], steps: list[int], step: int) -> list[dict[str, Any]]:
    """Every process's view of checkpoint ``step`` alone (see :func:`_exchange_views`)."""
    return _exchange_views(fn, steps, {step: damage(_step_path(directory, step))} if step in steps else {})


def _problems(views: list[dict[str, Any]], step: int) -> list[str] | None:
    """The damage of checkpoint ``step`` over every process's view (``[]``: intact on all; each problem seen by
    only some processes names them), or None when it is intact wherever checked but some process has not
    checked it."""
    seen: dict[str, list[int]] = {}
    unchecked = False
    for p, view in enumerate(views):
        if step not in view["steps"]:
            seen.setdefault(f"{step}/ is not in the directory", []).append(p)
        elif str(step) in view["damage"]:
            for problem in view["damage"][str(step)]:
                seen.setdefault(problem, []).append(p)
        else:
            unchecked = True
    if not seen:
        return None if unchecked else []
    return [what + ("" if len(who) == len(views) else f" (seen by process(es) {who})") for what, who in seen.items()]


def _listed(damaged: dict[int, list[str]]) -> str:
    return "; ".join(f"checkpoint {step}: {'; '.join(problems)}" for step, problems in damaged.items())


def _step_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(os.path.abspath(os.fspath(directory))) / str(step)  # orbax's default step names
