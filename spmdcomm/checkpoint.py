"""Saving and restoring a :class:`~spmdcomm.TrainState` with orbax-checkpoint.

Each save writes ``DIRECTORY/STEP`` into a temporary directory first and renames it when complete,
so a save that fails (or a process that dies) part-way never damages the last good checkpoint.
Restoring needs a template state (e.g. a freshly created one): it supplies the tree structure, the static
fields and the sharding of every leaf. The template may use another strategy or device count than the
saved state (a ZeRO or FSDP run restored onto 4 devices instead of 8, or onto DDP): under every strategy the
state is the model's own tree, so each leaf is read directly into the template leaf's sharding (every process
reads only its blocks; nothing is gathered on one host). Each checkpoint records its strategy and axis size, and
orbax's metadata each leaf's shape and dtype: a template whose leaves differ (another model configuration, even
one of the same sizes) gets an error naming the leaf and both shapes. Resuming from a checkpoint
reproduces the uninterrupted run bit for bit on CPU (the per-step RNG is derived from ``state.rng``
and ``state.step``). Typed PRNG key leaves (Flax NNX ``RngKey``) are saved as keys and restored
with the template's key implementation; NNX ``RngCount`` counters are plain integers. The template
may live on another mesh than the saved state (e.g. 4 devices instead of 2); with
``make_train_step(..., rng="per_example")`` the resumed run then draws the same random bits as
the uninterrupted one.

>>> import optax, tempfile
>>> params = {"w": np.arange(3.0, dtype=np.float32)}
>>> state = sc.TrainState.create(params=params, tx=optax.adam(1e-3))
>>> with tempfile.TemporaryDirectory() as d:
...     sc.save_checkpoint(d, state)
...     restored = sc.restore_checkpoint(d, state)
0
>>> restored.params["w"].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from spmdcomm.errors import SpmdError, check_not_deleted, describe
from spmdcomm.train_state import TrainState

__all__ = ["save_checkpoint", "restore_checkpoint", "latest_checkpoint_step", "checkpoint_extra"]


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    step: int | None = None,
    max_to_keep: int | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    """Saves ``state`` as checkpoint ``step`` (default ``state.step``) under ``directory``; returns
    the step.

    Blocks until the checkpoint is complete. ``max_to_keep`` deletes the oldest checkpoints beyond
    that many. ``extra`` is a small JSON-serialisable dict saved in the same checkpoint (atomically with
    the arrays; process 0's is written), read back by :func:`checkpoint_extra`: e.g. the data position
    that :func:`spmdcomm.fit` records. Every process must call it (each writes its own shards).
    """
    import orbax.checkpoint as ocp

    _check_state("save_checkpoint", state)
    # Checked before orbax touches the arrays: a consumed state would fail half-way (or crash).
    check_not_deleted(
        "save_checkpoint",
        state,
        arg="state",
        fix="save the state the step returned, not the one passed to it (a step with donate=True, the "
        "default, consumes its input), or build the step with make_train_step(..., donate=False).",
    )
    step = int(jax.device_get(state.step)) if step is None else int(step)
    with _manager(directory, max_to_keep=max_to_keep) as mgr:
        args = ocp.args.StandardSave(_arrays(state), custom_metadata=_layout_of(state))
        mgr.save(step, args=args, custom_metadata=_json_dict("save_checkpoint", extra), force=True)
        mgr.wait_until_finished()
    return step


def restore_checkpoint(directory: str | os.PathLike[str], state: TrainState, *, step: int | None = None) -> TrainState:
    """Returns ``state`` with every array replaced by checkpoint ``step``'s (default: the latest).

    ``state`` is the template: the restored arrays get its shapes, dtypes and shardings, and its
    static fields (``apply_fn``, ``tx``, mesh, strategy and layout) are kept. A checkpoint of another
    strategy or axis size is read into the template's shardings (see the module docstring); one whose leaves
    differ from the template's raises :class:`~spmdcomm.SpmdError` naming them.
    """
    import orbax.checkpoint as ocp

    _check_state("restore_checkpoint", state)
    with _manager(directory) as mgr:
        step = _existing_step("restore_checkpoint", directory, mgr, step)
        saved = mgr.item_metadata(step)
        _check_format(directory, step, saved.custom_metadata or {})
        _check_leaves(directory, step, saved, state)
        # Each leaf is read straight into the template's sharding: every process reads only its blocks, whatever
        # strategy or device count wrote them.
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _arrays(state))
        return state.replace(**mgr.restore(step, args=ocp.args.StandardRestore(target)))


def latest_checkpoint_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete checkpoint's step in ``directory``, or ``None`` when there is none."""
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as mgr:
        return mgr.latest_step()


def checkpoint_extra(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The ``extra`` dict saved with checkpoint ``step`` (default: the latest) by :func:`save_checkpoint`;
    ``{}`` when it was saved without one."""
    with _manager(directory) as mgr:
        step = _existing_step("checkpoint_extra", directory, mgr, step)
        return dict(mgr.metadata(step).custom_metadata or {})


def _arrays(state: TrainState) -> dict[str, Any]:
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "model_state": state.model_state,
        "rng": state.rng,
    }


def _existing_step(fn: str, directory: str | os.PathLike[str], mgr: Any, step: int | None) -> int:
    """``step``, or the latest step when it is None, if that checkpoint exists; raises otherwise."""
    step = mgr.latest_step() if step is None else step
    if step is None or step not in mgr.all_steps():
        raise SpmdError(
            describe(
                fn,
                f"no checkpoint {'at all' if step is None else f'for step {step}'} in "
                f"{os.fspath(directory)!r} (it has steps {sorted(mgr.all_steps())}).",
                fix="check the directory, or save first with spmdcomm.save_checkpoint.",
            )
        )
    return step


def _json_dict(fn: str, extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """``extra`` if it is a dict that JSON can store unchanged; raises naming the problem otherwise."""
    if extra is None:
        return None
    try:
        ok = isinstance(extra, dict) and json.loads(json.dumps(extra)) == extra
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise SpmdError(
            describe(
                fn,
                f"extra={extra!r} is not a dict that JSON stores unchanged.",
                fix="pass a dict with string keys and str/int/float/bool/None/list/dict values.",
            )
        )
    return extra


def _check_state(fn: str, state: Any) -> None:
    if not isinstance(state, TrainState):
        raise SpmdError(
            describe(
                fn,
                f"state is a {type(state).__name__}, not a TrainState.",
                fix="pass the TrainState (for restore: a template built the same way).",
            )
        )


def _manager(directory: str | os.PathLike[str], *, max_to_keep: int | None = None) -> Any:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=False,
        cleanup_tmp_directories=True,
        create=True,
    )
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def _layout_of(state: TrainState) -> dict[str, Any]:
    """What a checkpoint records of its state's layout: the format (2: the model's tree under every strategy),
    the strategy and the size of the axis its leaves were split over."""
    return {"format": _FORMAT, "strategy": state.strategy.name, "shards": state.data_size}


_FORMAT = 2


def _check_format(directory: str | os.PathLike[str], step: int, saved: dict[str, Any]) -> None:
    # spmdcomm 0.2 stored ZeRO's optimizer state and FSDP's parameters as flat vectors keyed "<layer>/<dtype>".
    if saved.get("format", 1) < _FORMAT and saved.get("strategy", "ddp") != "ddp":
        raise SpmdError(
            describe(
                "restore_checkpoint",
                f"checkpoint {step} in {os.fspath(directory)!r} was saved by spmdcomm 0.2 with strategy "
                f"{saved['strategy']!r}, whose flat-vector layout this version no longer reads.",
                fix="restore it with spmdcomm 0.2 into a DDP template (strategy='ddp') and save it again; "
                "DDP checkpoints of 0.2 restore here into any strategy.",
            )
        )


def _check_leaves(directory: str | os.PathLike[str], step: int, saved: Any, state: TrainState) -> None:
    """Raises unless the checkpoint holds exactly the template's leaves, with the same shapes and dtypes."""
    stored = {m.name: m for m in jax.tree.leaves(dict(saved)) if hasattr(m, "shape")}
    wanted = {_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(_arrays(state))[0]}
    problems = [f"{name}: missing from the checkpoint" for name in wanted if name not in stored]
    problems += [f"{name}: in the checkpoint, not in the template" for name in stored if name not in wanted]
    for name, leaf in wanted.items():
        if name not in stored or jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
            continue  # typed PRNG keys are stored as key data and checked by orbax
        have = stored[name]
        if tuple(have.shape) != tuple(leaf.shape) or np.dtype(have.dtype) != np.dtype(leaf.dtype):
            problems.append(
                f"{name}: the checkpoint has {np.dtype(have.dtype).name}{list(have.shape)}, the template "
                f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
            )
    if problems:
        # The parameters first: an optimizer leaf differs because its parameter does.
        problems.sort(key=lambda p: not p.startswith("params."))
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise SpmdError(
            describe(
                "restore_checkpoint",
                f"checkpoint {step} in {os.fspath(directory)!r} does not match the template state: {shown}.",
                fix="build the template from the same model configuration and optax transformation the checkpoint "
                "was trained with (the strategy and device count may differ).",
            )
        )


def _name(path: tuple[Any, ...]) -> str:
    """A leaf's dotted name as orbax records it (``params.Dense_0.kernel``, ``opt_state.0.mu.Dense_0.bias``)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)
