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

import collections
import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmdcomm.errors import SpmdError, check_not_deleted, describe
from spmdcomm.runtime.process import process_count
from spmdcomm.runtime.transport import exchange
from spmdcomm.train.state import TrainState

__all__ = [
    "save_checkpoint",
    "restore_checkpoint",
    "latest_checkpoint_step",
    "checkpoint_extra",
    "CheckpointDamagedWarning",
]


class CheckpointDamagedWarning(UserWarning):
    """A checkpoint was skipped (or replaced) because a file that restoring it needs is missing or unreadable.

    Emitted when :func:`latest_checkpoint_step`, :func:`restore_checkpoint` or :func:`checkpoint_extra` fall
    back to an older intact checkpoint, and when :func:`save_checkpoint` replaces a damaged checkpoint of the
    step it saves (as :func:`spmdcomm.fit` does after resuming from an older one). The message names each
    damaged step, the directory and what is damaged.
    """


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

    Blocks until the checkpoint is complete; no orbax thread is left working on ``directory``. ``max_to_keep``
    deletes the oldest checkpoints beyond that many. ``extra`` is a small JSON-serialisable dict saved in the
    same checkpoint (atomically with the arrays; process 0's is written), read back by :func:`checkpoint_extra`:
    e.g. the data position that :func:`spmdcomm.fit` records. Every process must call it (each writes its own
    shards). A checkpoint of the same step that is already there raises :class:`~spmdcomm.SpmdError`, unless it
    is damaged: then it is replaced, with a :class:`CheckpointDamagedWarning`.
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
    extra = _json_dict("save_checkpoint", extra)
    with _manager(directory, writing=True, max_to_keep=max_to_keep) as mgr:
        _make_room(directory, mgr, step)
        args = ocp.args.StandardSave(_arrays(state), custom_metadata=_layout_of(state))
        # Orbax's save first waits for its removal of unfinished saves, so no thread of it outlives this block.
        mgr.save(step, args=args, custom_metadata=extra, force=True)
        mgr.wait_until_finished()
    return step


def restore_checkpoint(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    step: int | None = None,
    missing_ok: bool = False,
) -> TrainState:
    """Returns ``state`` with every array replaced by checkpoint ``step``'s (default: the newest intact one).

    ``state`` is the template: the restored arrays get its shapes, dtypes and shardings, and its
    static fields (``apply_fn``, ``tx``, mesh, strategy and layout) are kept. A checkpoint of another
    strategy or axis size is read into the template's shardings (see the module docstring); one whose leaves
    differ from the template's raises :class:`~spmdcomm.SpmdError` naming them, and so does a damaged one (see
    the module docstring for the fallback without ``step``). With ``missing_ok=True``, a ``directory`` that does
    not exist or holds no checkpoint returns ``state`` itself (as Flax's ``restore_checkpoint`` does); by
    default that raises.

    >>> import optax, tempfile
    >>> state = sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     sc.restore_checkpoint(d, state, missing_ok=True) is state
    True
    """
    import orbax.checkpoint as ocp

    _check_state("restore_checkpoint", state)
    with _manager(directory) as mgr:
        step = _chosen_step("restore_checkpoint", directory, mgr, step, missing_ok=missing_ok)
        if step is None:
            return state
        saved = mgr.item_metadata(step)
        _check_format(directory, step, saved.custom_metadata or {})
        _check_leaves(directory, step, saved, state)
        # Each leaf is read straight into the template's sharding: every process reads only its blocks, whatever
        # strategy or device count wrote them.
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _arrays(state))
        try:
            arrays = mgr.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:  # tensorstore's read and decoding errors come as ValueError or bare Exception
            raise SpmdError(
                describe(
                    "restore_checkpoint",
                    f"reading the arrays of checkpoint {step} in {os.fspath(directory)!r} failed: "
                    f"{_innermost(e)}. Its metadata, index and data files are all there, so "
                    "when this is a read or decoding error, the bytes of a data file were damaged after the save.",
                    fix=f"restore another checkpoint (step=...; the directory has steps {sorted(mgr.all_steps())}), "
                    f"or delete checkpoint {step} so that the newest intact one is used.",
                )
            ) from e
        return _with_arrays(state, arrays)


def latest_checkpoint_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest intact checkpoint's step in ``directory``, or ``None`` when there is no checkpoint (or no
    directory).

    Newer damaged checkpoints are skipped with a :class:`CheckpointDamagedWarning`; when every checkpoint is
    damaged it raises :class:`~spmdcomm.SpmdError` naming each one's damage.
    """
    with _manager(directory) as mgr:
        return _chosen_step("latest_checkpoint_step", directory, mgr, None, missing_ok=True)


def checkpoint_extra(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The ``extra`` dict saved with checkpoint ``step`` (default: the newest intact one) by
    :func:`save_checkpoint`; ``{}`` when it was saved without one."""
    with _manager(directory) as mgr:
        step = _chosen_step("checkpoint_extra", directory, mgr, step, missing_ok=False)
        return dict(mgr.metadata(step).custom_metadata or {})


# ---- private helpers -------------------------------------------------------------------------------------


def _arrays(state: TrainState) -> dict[str, Any]:
    arrays = {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "model_state": state.model_state,
        "rng": state.rng,
    }
    if state.loss_scale is not None:  # saved as a plain dict: its static growth settings are the template's
        arrays["loss_scale"] = {"scale": state.loss_scale.scale, "fin_steps": state.loss_scale.fin_steps}
    return arrays


def _with_arrays(state: TrainState, arrays: dict[str, Any]) -> TrainState:
    """``state`` with the arrays :func:`_arrays` listed replaced by ``arrays``."""
    arrays = dict(arrays)
    if "loss_scale" in arrays:
        arrays["loss_scale"] = state.loss_scale.replace(**arrays["loss_scale"])
    return state.replace(**arrays)


def _manager(directory: str | os.PathLike[str], *, writing: bool = False, max_to_keep: int | None = None) -> Any:
    """An orbax manager of ``directory``. Only a writing one creates the directory and removes unfinished saves
    (in a background thread, which its save waits for); a reading one starts no thread that outlives it."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=False,
        cleanup_tmp_directories=writing,
        create=writing,
    )
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def _chosen_step(
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


def _make_room(directory: str | os.PathLike[str], mgr: Any, step: int) -> None:
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
                found[step] = _damage(_step_path(directory, step))
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
    return _exchange_views(fn, steps, {step: _damage(_step_path(directory, step))} if step in steps else {})


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


def _damage(path: Path) -> list[str]:
    """What is missing or unreadable in the checkpoint at ``path`` (one step's directory); ``[]`` when it is
    intact. Each entry names the file (relative to ``path``) and its problem."""
    problems: list[str] = []
    step_metadata = _read_json(path, _STEP_METADATA, problems)
    if step_metadata is not None and not isinstance(step_metadata.get("custom_metadata") or {}, dict):
        problems.append(f"{_STEP_METADATA} ({_FILES[_STEP_METADATA]}) holds no extra dict")
    item = _read_json(path, _ITEM_METADATA, problems)
    for optional in [_SHARDING, *sorted(f"{_ARRAY_METADATAS}/{p.name}" for p in (path / _ARRAY_METADATAS).glob("*"))]:
        if (path / optional).exists():
            _read_json(path, optional, problems)
    if item is None:
        return problems
    try:
        if not isinstance(item.get("custom_metadata") or {}, dict):
            raise TypeError("custom_metadata is not a dict")
        leaves = list(_array_leaves(item["tree_metadata"]))
    except (KeyError, TypeError, AttributeError) as e:
        problems.append(f"{_ITEM_METADATA} ({_FILES[_ITEM_METADATA]}) does not describe the arrays ({e!r})")
        return problems
    if item.get("use_ocdbt", True):  # every spmdcomm checkpoint; other layouts are checked by restore only
        problems += _array_damage(path / "default", item, leaves)
    return problems


def _read_json(path: Path, name: str, problems: list[str]) -> dict[str, Any] | None:
    """The JSON object in file ``path/name``, or None after adding its problem to ``problems``."""
    what = _FILES.get(name) or _FILES.get(os.path.dirname(name), "")
    label = f"{name} ({what})" if what else name
    try:
        value = json.loads((path / name).read_bytes())
    except FileNotFoundError:
        problems.append(f"{label} is missing")
        return None
    except OSError as e:
        problems.append(f"{label} is unreadable ({e.strerror})")
        return None
    except ValueError as e:  # also a UnicodeDecodeError
        problems.append(f"{label} is not valid JSON, so truncated or overwritten ({e})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{label} holds a JSON {type(value).__name__}, not an object")
        return None
    return value


def _array_leaves(tree: dict[str, Any]) -> Iterator[str]:
    """The dotted names of the array leaves that orbax's tree metadata lists (the keys of their data)."""
    for entry in tree.values():
        value = entry["value_metadata"]
        if value.get("value_type") in _ARRAY_TYPES and not value.get("skip_deserialize", False):
            yield ".".join(str(key["key"]) for key in entry["key_metadata"])


def _array_damage(item: Path, metadata: dict[str, Any], leaves: list[str]) -> list[str]:
    """What is missing from the array data of ``item`` (OCDBT): its index (the manifest and the B-tree nodes), the
    data files the index refers to (each present and long enough), and for each of ``leaves`` its zarr metadata
    and every chunk. The chunks' bytes are not read: their damage shows when restore decodes them."""
    import tensorstore as ts

    if not (item / "manifest.ocdbt").is_file():
        return [f"{_MANIFEST} ({_FILES[_MANIFEST]}) is missing"]
    base = ts.KvStore.open({"driver": "file", "path": f"{item}/"}).result()
    try:
        versions = ts.ocdbt.dump(base).result()["versions"]
    except Exception as e:  # tensorstore reports a corrupt manifest as ValueError
        return [f"{_MANIFEST} ({_FILES[_MANIFEST]}) is unreadable: {_first_line(e)}"]
    root = versions[-1]["root"].get("location") if versions else None  # no location: an empty tree
    entries, problems = _index(base, item, root)
    needed: dict[str, int] = {}  # data file -> the end of the last bytes the index refers to in it
    for entry in entries.values():
        if "indirect_value" in entry:
            file = _relative(entry["indirect_value"])
            needed[file] = max(needed.get(file, 0), _extent(entry["indirect_value"]))
    problems += filter(None, (_file_problem(item, file, end, "array data") for file, end in needed.items()))
    if problems:  # a lost node hides its leaves: listing each of them would bury the cause
        return problems
    metadata_name = "zarr.json" if metadata.get("use_zarr3", False) else ".zarray"
    keys = collections.Counter(key.rsplit(b"/", 1)[0] for key in entries)  # leaf -> its keys: metadata and chunks
    for leaf in leaves:
        key = f"{leaf}/{metadata_name}".encode()
        if key not in entries:
            problems.append(f"leaf {leaf}: its array data is not in {_MANIFEST}'s index (no key {key.decode()})")
        elif metadata_name == ".zarray" and metadata.get("store_array_data_equal_to_fill_value", False):
            problems += _missing_chunks(base, leaf, entries[key], keys[leaf.encode()] - 1)
    return problems


def _index(base: Any, item: Path, root: str | None) -> tuple[dict[bytes, dict[str, Any]], list[str]]:
    """Every key of the OCDBT B-tree below ``root``, with its entry (an inline value or where the value is), and
    the problem of each node that is missing or unreadable."""
    import tensorstore as ts

    entries: dict[bytes, dict[str, Any]] = {}
    problems: list[str] = []
    pending = [] if root is None else [(root, b"")]
    while pending:
        location, prefix = pending.pop()
        problem = _file_problem(item, _relative(location), _extent(location), "a node of the array index")
        if problem is None:
            try:
                node = ts.ocdbt.dump(base, location).result()
            except Exception as e:
                problem = f"default/{_relative(location)} (a node of the array index) is unreadable: {_first_line(e)}"
        if problem is not None:
            problems.append(problem)
            continue
        for entry in node["entries"]:
            if "location" in entry:  # an inner node: its keys continue the common prefix of its subtree
                pending.append((entry["location"], prefix + entry.get("subtree_common_prefix", b"")))
            else:
                entries[prefix + entry["key"]] = entry
    return entries, problems


def _missing_chunks(base: Any, leaf: str, entry: dict[str, Any], have: int) -> list[str]:
    """``leaf``'s problem when the index holds fewer than all of its chunks (orbax stores every chunk of a zarr v2
    array); ``entry`` is its ``.zarray`` key's, ``have`` the number of its chunks in the index."""
    import tensorstore as ts

    try:
        raw = (
            entry["inline_value"] if "inline_value" in entry else ts.ocdbt.dump(base, entry["indirect_value"]).result()
        )
        zarray = json.loads(raw)
        expected = math.prod(
            -(-size // max(chunk, 1)) for size, chunk in zip(zarray["shape"], zarray["chunks"], strict=True)
        )
    except Exception as e:
        return [f"leaf {leaf}: its zarr metadata is unreadable ({_first_line(e)})"]
    if have < expected:
        return [f"leaf {leaf}: {expected - have} of its {expected} chunks are missing from the array data"]
    return []


def _file_problem(item: Path, file: str, end: int, what: str) -> str | None:
    """The problem of data file ``file`` of ``item`` (missing, or shorter than ``end``, the bytes referred to)."""
    label = f"default/{file} ({what})"
    try:
        size = (item / file).stat().st_size
    except FileNotFoundError:
        return f"{label} is missing"
    except OSError as e:
        return f"{label} is unreadable ({e.strerror})"
    if size < end:
        return f"{label} is truncated: {size} bytes, the index refers to {end}"
    return None


def _relative(location: str) -> str:
    """The data file of an OCDBT location ``KIND:BASE:RELATIVE:OFFSET:LENGTH``, relative to the database."""
    _, base, relative = location.rsplit(":", 2)[0].split(":", 2)
    return f"{base}{relative}"


def _extent(location: str) -> int:
    """The end (offset + length) of the bytes an OCDBT location refers to."""
    offset, length = location.rsplit(":", 2)[1:]
    return int(offset) + int(length)


def _innermost(e: BaseException) -> str:
    """The first line of the error at the bottom of ``e``'s chain (orbax wraps tensorstore's, which names the key
    and the problem), with its type."""
    for _ in range(_CHAIN_DEPTH):
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


# Orbax's files in a step's directory, and what each holds.
_STEP_METADATA = "_CHECKPOINT_METADATA"
_ITEM_METADATA = "default/_METADATA"
_SHARDING = "default/_sharding"
_ARRAY_METADATAS = "default/array_metadatas"
_MANIFEST = "default/manifest.ocdbt"
_FILES = {
    _STEP_METADATA: "orbax's step metadata, with the extra dict",
    _ITEM_METADATA: "the arrays' tree, shapes and spmdcomm layout",
    _SHARDING: "the arrays' shardings",
    _ARRAY_METADATAS: "a process's array metadata",
    _MANIFEST: "the index of the array data",
}
# How far down an exception chain the cause of a failed read is looked for (the chains are a few links long).
_CHAIN_DEPTH = 10
# Orbax's type names of the leaves whose data is a zarr array in the OCDBT database.
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


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
