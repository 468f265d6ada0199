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

A checkpoint damaged after it was written (a file deleted, truncated or overwritten: a full disk, an
interrupted copy) is never read silently. Before reading, each checkpoint is checked: orbax's step metadata
(``_CHECKPOINT_METADATA``, which holds ``extra``), the arrays' metadata and layout (``default/_METADATA``),
the other metadata files orbax reads when present, and the array data's index (``default/manifest.ocdbt`` and
its B-tree nodes), every data file that index refers to (present and long enough) and every chunk of every
array leaf. :func:`latest_checkpoint_step`, :func:`restore_checkpoint` and :func:`checkpoint_extra` without a
``step`` use the newest intact checkpoint, with a :class:`CheckpointDamagedWarning` naming each newer damaged
one and its damage; when every checkpoint is damaged, or an explicit ``step`` is, they raise
:class:`~spmdcomm.SpmdError` naming the damage. Bytes changed inside a data file are only seen when restore
decodes them: that raises :class:`~spmdcomm.SpmdError` naming the step and the cause. In a multi-process job
every process must call these functions (as it must call :func:`save_checkpoint`): the processes exchange what
each one found, so that all of them use the same checkpoint even when their views of the directory differ.

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
import math
import os
from typing import Any, Literal, overload

import jax

from spmdcomm.checkpoint._arrays import (
    CheckpointState,
    State,
    arrays,
    check_format,
    check_leaves,
    layout_of,
    stored,
    targets,
    unpadded,
    with_arrays,
)
from spmdcomm.checkpoint._async import (
    DEFAULT_SAVE_TIMEOUT,
    CheckpointSave,
    CommitBarrier,
    checked_timeout,
    started,
    wait_for_save_in_flight,
)
from spmdcomm.checkpoint._choice import chosen_step, make_room
from spmdcomm.checkpoint._disk import innermost
from spmdcomm.errors import CheckpointDamagedWarning, SpmdError, check_not_deleted, describe
from spmdcomm.runtime.process import process_count

__all__ = [
    "save_checkpoint",
    "restore_checkpoint",
    "latest_checkpoint_step",
    "checkpoint_extra",
    "CheckpointDamagedWarning",
]


@overload
def save_checkpoint(
    directory: str | os.PathLike[str],
    state: CheckpointState,
    *,
    step: int | None = ...,
    max_to_keep: int | None = ...,
    extra: dict[str, Any] | None = ...,
    asynchronous: Literal[False] = ...,
    timeout: None = ...,
) -> int: ...
@overload
def save_checkpoint(
    directory: str | os.PathLike[str],
    state: CheckpointState,
    *,
    step: int | None = ...,
    max_to_keep: int | None = ...,
    extra: dict[str, Any] | None = ...,
    asynchronous: Literal[True],
    timeout: float | None = ...,
) -> CheckpointSave: ...
def save_checkpoint(
    directory: str | os.PathLike[str],
    state: CheckpointState,
    *,
    step: int | None = None,
    max_to_keep: int | None = None,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
    timeout: float | None = None,
) -> int | CheckpointSave:
    """Saves ``state`` as checkpoint ``step`` (default ``state.step``) under ``directory``.

    Blocks until the checkpoint is complete; no orbax thread is left working on ``directory``. With
    ``asynchronous=True`` it returns once the state is copied to host memory (on CPU: referenced) and the files are
    written in the background while training goes on (orbax's asynchronous checkpointing), with a
    :class:`~spmdcomm.checkpoint.CheckpointSave` handle. A process has at most one save in flight: every save first
    waits for the previous one, and raises its error if it failed. Every process must call it (each writes its
    own shards). A damaged checkpoint of the same step is replaced, with a :class:`CheckpointDamagedWarning`.

    Args:
      directory: the checkpoint directory (created when missing); the checkpoint goes to ``directory/step``.
      state: the :class:`~spmdcomm.TrainState` to save (not one a donating step consumed).
      step: the checkpoint's step; ``None`` (default): ``state.step``.
      max_to_keep: deletes the oldest checkpoints beyond that many; ``None`` (default): keeps all.
      extra: a small JSON-serialisable dict saved in the same checkpoint (atomically with the arrays; process 0's
        is written), read back by :func:`checkpoint_extra`: e.g. the data position that :func:`spmdcomm.fit`
        records. ``None`` (default): none.
      asynchronous: ``True``: write in the background and return a handle (its ``wait()`` blocks until the
        checkpoint is complete and raises the background write's error; ``done()`` polls). The checkpoint becomes
        the latest only once complete: a failed save, or a process killed while it writes, leaves the previous
        complete checkpoint the latest. ``False`` (default): return once the checkpoint is complete. In a job of
        several processes a background save that fails on one process fails on every process: each one's
        ``wait()`` raises, naming the failing process, as soon as its write raised (see ``timeout``).
      timeout: with ``asynchronous=True``, the seconds the background save may take, on every process, from the
        start of its write until the checkpoint is complete (default :data:`DEFAULT_SAVE_TIMEOUT`, 1200 s, orbax's
        own). Once it passes, every process's ``wait()`` raises, naming the processes that had not finished (a
        stalled disk, a process that stopped); a process that finishes later raises too, and process 0 does not
        make the checkpoint complete. Only for asynchronous saves.

    Returns:
      The step saved; with ``asynchronous=True``, a :class:`~spmdcomm.checkpoint.CheckpointSave` of it.

    Raises:
      SpmdError: when ``state`` is not a :class:`~spmdcomm.TrainState`, ``extra`` is not a dict JSON stores
        unchanged, ``timeout`` is not a number of seconds > 0 or comes without ``asynchronous=True``, an intact
        checkpoint of the same step is already there, or this process's previous asynchronous save failed (naming
        its step, directory and cause, and in a job of several processes the process that failed or those that
        were late; nothing is saved then).
      DeletedArrayError: when ``state`` was consumed by a donating step.
      ImportError: when orbax-checkpoint cannot be imported.
    """
    ocp = _orbax("save_checkpoint")
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
    extra = _json_dict("save_checkpoint", extra)
    limit = checked_timeout("save_checkpoint", timeout, asynchronous=asynchronous)
    wait_for_save_in_flight()  # at most one save in flight; its error is raised here, before anything is written
    # With several processes, the save's barriers: a failure on one process is raised on every one.
    barrier = CommitBarrier(directory, step, limit) if asynchronous and process_count() > 1 else None
    mgr = _manager(
        "save_checkpoint",
        directory,
        writing=True,
        max_to_keep=max_to_keep,
        asynchronous=asynchronous,
        timeout=limit,
        barrier=barrier,
    )
    try:
        make_room(directory, mgr, step)
        args = ocp.args.StandardSave(arrays(unpadded(state)), custom_metadata=layout_of(state))
        # Orbax's save first waits for its removal of unfinished saves, so no thread of it outlives this block.
        mgr.save(step, args=args, custom_metadata=extra, force=True)
    except BaseException as e:
        if barrier is not None:  # the other processes' background saves wait for this one's: they raise instead
            barrier.fail(e)
        mgr.close()
        raise
    if asynchronous:  # the handle closes the manager once the background write ends
        return started(CheckpointSave(mgr, directory, step, barrier))
    with mgr:
        mgr.wait_until_finished()
    return step


def restore_checkpoint(
    directory: str | os.PathLike[str],
    state: State,
    *,
    step: int | None = None,
    missing_ok: bool = False,
) -> State:
    """Returns ``state`` with every array replaced by checkpoint ``step``'s (default: the newest intact one).

    A checkpoint of another strategy or axis size is read into the template's shardings (see the module
    docstring, also for the fallback without ``step`` when newer checkpoints are damaged).

    Args:
      directory: the checkpoint directory.
      state: the template: the restored arrays get its shapes, dtypes and shardings, and its static fields
        (``apply_fn``, ``tx``, mesh, strategy and layout) are kept.
      step: the checkpoint to restore; ``None`` (default): the newest intact one.
      missing_ok: ``True``: a ``directory`` that does not exist or holds no checkpoint returns ``state`` itself
        (as Flax's ``restore_checkpoint`` does); ``False`` (default): that raises.

    Returns:
      The restored :class:`~spmdcomm.TrainState` (``state`` itself when ``missing_ok`` found no checkpoint).

    Raises:
      SpmdError: naming them, when the checkpoint's leaves differ from the template's; naming the damage, when
        the checkpoint (or, without ``step``, every checkpoint) is damaged or its bytes fail to decode; and when
        there is no checkpoint and not ``missing_ok``, ``step`` is not among the saved ones, or ``state`` is not
        a :class:`~spmdcomm.TrainState`.
      ImportError: when orbax-checkpoint cannot be imported.

    Examples:
      >>> import optax, tempfile
      >>> state = sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
      >>> with tempfile.TemporaryDirectory() as d:
      ...     sc.restore_checkpoint(d, state, missing_ok=True) is state
      True
    """
    ocp = _orbax("restore_checkpoint")
    _check_state("restore_checkpoint", state)
    with _manager("restore_checkpoint", directory) as mgr:
        step = chosen_step("restore_checkpoint", directory, mgr, step, missing_ok=missing_ok)
        if step is None:
            return state
        saved = mgr.item_metadata(step)
        check_format(directory, step, saved.custom_metadata or {})
        check_leaves(directory, step, saved, state)
        # Each leaf is read straight into the template's sharding: every process reads only its blocks, whatever
        # strategy or device count wrote them.
        target = targets(state)
        try:
            restored = mgr.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:  # tensorstore's read and decoding errors come as ValueError or bare Exception
            raise SpmdError(
                describe(
                    "restore_checkpoint",
                    f"reading the arrays of checkpoint {step} in {os.fspath(directory)!r} failed: "
                    f"{innermost(e)}. Its metadata, index and data files are all there, so "
                    "when this is a read or decoding error, the bytes of a data file were damaged after the save.",
                    fix=f"restore another checkpoint (step=...; the directory has steps {sorted(mgr.all_steps())}), "
                    f"or delete checkpoint {step} so that the newest intact one is used.",
                )
            ) from e
        return stored(with_arrays(state, restored))


def latest_checkpoint_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest intact checkpoint's step in ``directory``.

    Newer damaged checkpoints are skipped with a :class:`CheckpointDamagedWarning`.

    Args:
      directory: the checkpoint directory.

    Returns:
      The step, or ``None`` when there is no checkpoint (or no directory).

    Raises:
      SpmdError: when every checkpoint is damaged, naming each one's damage.
      ImportError: when orbax-checkpoint cannot be imported.
    """
    with _manager("latest_checkpoint_step", directory) as mgr:
        return chosen_step("latest_checkpoint_step", directory, mgr, None, missing_ok=True)


def checkpoint_extra(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The ``extra`` dict saved with a checkpoint by :func:`save_checkpoint`.

    Args:
      directory: the checkpoint directory.
      step: the checkpoint; ``None`` (default): the newest intact one.

    Returns:
      A copy of the ``extra`` dict; ``{}`` when the checkpoint was saved without one.

    Raises:
      SpmdError: when there is no checkpoint (or none of ``step``), or the one asked for (without ``step``:
        every one) is damaged.
      ImportError: when orbax-checkpoint cannot be imported.
    """
    with _manager("checkpoint_extra", directory) as mgr:
        step = chosen_step("checkpoint_extra", directory, mgr, step, missing_ok=False)
        return dict(mgr.metadata(step).custom_metadata or {})


def _manager(
    fn: str,
    directory: str | os.PathLike[str],
    *,
    writing: bool = False,
    max_to_keep: int | None = None,
    asynchronous: bool = False,
    timeout: float = DEFAULT_SAVE_TIMEOUT,
    barrier: CommitBarrier | None = None,
) -> Any:
    """An orbax manager of ``directory``. Only a writing one creates the directory and removes unfinished saves
    (in a background thread, which its save waits for); a reading one starts no thread that outlives it. An
    asynchronous one writes its save, renames it complete and removes old steps in a background thread, within
    ``timeout`` seconds, meeting the other processes at ``barrier`` (``None``: orbax's barriers; one process)."""
    ocp = _orbax(fn)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=asynchronous,
        cleanup_tmp_directories=writing,
        create=writing,
        async_options=ocp.AsyncOptions(timeout_secs=max(1, math.ceil(timeout)), barrier_sync_fn=barrier),
    )
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def _orbax(fn: str) -> Any:
    """``orbax.checkpoint``, imported when ``fn`` first needs it: it is an optional dependency, so that
    ``import spmdcomm`` works (and stays fast) without it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            describe(
                fn,
                f"checkpoints need orbax-checkpoint, which cannot be imported ({e}).",
                fix="pip install 'spmdcomm[checkpoint]' (or pip install 'orbax-checkpoint>=0.11').",
            )
        ) from e
    return ocp


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
    # Duck-typed: this layer sits below spmdcomm.train, whose TrainState has every attribute checkpoints read.
    if not isinstance(state, CheckpointState):
        raise SpmdError(
            describe(
                fn,
                f"state is a {type(state).__name__}, not a TrainState.",
                fix="pass the TrainState (for restore: a template built the same way).",
            )
        )
