"""Saving and restoring a :class:`~spmdcomm.TrainState` with orbax-checkpoint.

Each save writes ``DIRECTORY/STEP`` into a temporary directory first and renames it when complete,
so a save that fails (or a process that dies) part-way never damages the last good checkpoint.
Restoring needs a template state (e.g. a freshly created one, also ZeRO-1 sharded): it supplies the
tree structure, the static fields and the sharding of every leaf. Resuming from a checkpoint
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

import os
from typing import Any

import jax

from spmdcomm.errors import SpmdError, check_not_deleted, describe
from spmdcomm.train_state import TrainState

__all__ = ["save_checkpoint", "restore_checkpoint", "latest_checkpoint_step"]


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    step: int | None = None,
    max_to_keep: int | None = None,
) -> int:
    """Saves ``state`` as checkpoint ``step`` (default ``state.step``) under ``directory``; returns
    the step.

    Blocks until the checkpoint is complete. ``max_to_keep`` deletes the oldest checkpoints beyond
    that many. Every process must call it (each writes its own shards).
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
        mgr.save(step, args=ocp.args.StandardSave(_arrays(state)), force=True)
        mgr.wait_until_finished()
    return step


def restore_checkpoint(directory: str | os.PathLike[str], state: TrainState, *, step: int | None = None) -> TrainState:
    """Returns ``state`` with every array replaced by checkpoint ``step``'s (default: the latest).

    ``state`` is the template: the restored arrays get its shapes, dtypes and shardings, and its
    static fields (``apply_fn``, ``tx``, the ZeRO-1 layout) are kept.
    """
    import orbax.checkpoint as ocp

    _check_state("restore_checkpoint", state)
    with _manager(directory) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None or step not in mgr.all_steps():
            raise SpmdError(
                describe(
                    "restore_checkpoint",
                    f"no checkpoint {'at all' if step is None else f'for step {step}'} in "
                    f"{os.fspath(directory)!r} (it has steps {sorted(mgr.all_steps())}).",
                    fix="check the directory, or save first with spmdcomm.save_checkpoint.",
                )
            )
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _arrays(state))
        values = mgr.restore(step, args=ocp.args.StandardRestore(target))
    return state.replace(**values)


def latest_checkpoint_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete checkpoint's step in ``directory``, or ``None`` when there is none."""
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as mgr:
        return mgr.latest_step()


def _arrays(state: TrainState) -> dict[str, Any]:
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "model_state": state.model_state,
        "rng": state.rng,
    }


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
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)
