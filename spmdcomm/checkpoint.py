"""Saving and restoring a :class:`~spmdcomm.TrainState` with orbax-checkpoint.

Each save writes ``DIRECTORY/STEP`` into a temporary directory first and renames it when complete,
so a save that fails (or a process that dies) part-way never damages the last good checkpoint.
Restoring needs a template state (e.g. a freshly created one): it supplies the tree structure, the static
fields and the sharding of every leaf. The template may use another strategy or device count than the
saved state (a ZeRO or FSDP run restored onto 4 devices instead of 8, or onto DDP): each checkpoint records
its strategy and axis size, and restoring converts the parameters and optimizer state to the template's
layout on the devices (flat vectors are read split over the template's axis where their length allows,
never gathered on one host first). Resuming from a checkpoint
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

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm._flat import FlatLayout
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
    strategy or axis size is converted to the template's (see the module docstring).
    """
    import orbax.checkpoint as ocp

    _check_state("restore_checkpoint", state)
    with _manager(directory) as mgr:
        step = _existing_step("restore_checkpoint", directory, mgr, step)
        saved = mgr.item_metadata(step).custom_metadata or _layout_of(state)
        if saved == _layout_of(state):
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _arrays(state))
            return state.replace(**mgr.restore(step, args=ocp.args.StandardRestore(target)))
        return _restore_converted(mgr, step, state, saved)


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
    """What a checkpoint records of its state's layout: the strategy and the axis size its vectors split over."""
    return {"strategy": state.strategy.name, "shards": int(state.mesh.shape[state.axis])}


def _restore_converted(mgr: Any, step: int, state: TrainState, saved: dict[str, Any]) -> TrainState:
    """Restores a checkpoint saved under another strategy or axis size into the template ``state``'s layout."""
    import orbax.checkpoint as ocp

    logical = _logical_params(state)
    n = state.mesh.shape[state.axis]
    source_params, source_opt = (_form(saved["strategy"], kind, logical, saved["shards"]) for kind in _KINDS)
    target_params, target_opt = (_form(state.strategy.name, kind, logical, n) for kind in _KINDS)
    split, whole = NamedSharding(state.mesh, P(state.axis)), NamedSharding(state.mesh, P())

    def abstract(x: Any) -> jax.ShapeDtypeStruct:
        # Vectors whose length divides over the template's axis are read split; others whole.
        sharding = split if x.ndim == 1 and x.shape[0] % n == 0 and x.shape[0] >= n else whole
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target = {
        **jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _arrays(state)),
        "params": jax.tree.map(abstract, source_params.abstract(logical)),
        "opt_state": jax.tree.map(abstract, jax.eval_shape(state.tx.init, source_opt.abstract(logical))),
    }
    raw = mgr.restore(step, args=ocp.args.StandardRestore(target))
    source_leaves, source_struct = jax.tree.flatten(source_opt.abstract(logical))
    source_shapes = [x.shape for x in source_leaves]

    def params_like(x: Any) -> bool:
        # A parameter-shaped part of the optimizer state (optax's moments and traces), in the saved form.
        return jax.tree.structure(x) == source_struct and [np.shape(v) for v in jax.tree.leaves(x)] == source_shapes

    def convert_opt(x: Any) -> Any:
        return target_opt.store(source_opt.load(x)) if params_like(x) else x

    def convert(params: Any, opt_state: Any) -> tuple[Any, Any]:
        params = target_params.store(source_params.load(params))
        opt_state = jax.tree.map(convert_opt, opt_state, is_leaf=params_like)
        return params, opt_state

    out_shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
    params, opt_state = jax.jit(convert, out_shardings=out_shardings)(raw["params"], raw["opt_state"])
    return state.replace(**{**raw, "params": params, "opt_state": opt_state})


@dataclasses.dataclass(frozen=True)
class _Form:
    """How a strategy stores a parameter-shaped tree: the tree itself, or flat vectors split ``shards`` ways."""

    flat: FlatLayout | None
    shards: int

    def abstract(self, logical: Any) -> Any:
        if self.flat is None:
            return logical
        return {
            key: jax.ShapeDtypeStruct((size,), key.rsplit("/", 1)[-1])
            for key, size in self.flat.sizes(self.shards).items()
        }

    def load(self, stored: Any) -> Any:
        return stored if self.flat is None else self.flat.unflatten(stored)

    def store(self, tree: Any) -> Any:
        return tree if self.flat is None else self.flat.flatten(tree, pad_to=self.shards)


_KINDS = ("params", "opt")


def _form(strategy: str, kind: str, logical: Any, shards: int) -> _Form:
    # DDP keeps trees; ZeRO keeps the parameters as a tree and the optimizer state as one flat vector per
    # dtype; FSDP keeps both as flat vectors per layer and dtype.
    if strategy == "fsdp":
        return _Form(FlatLayout.build(logical, grouped=True), shards)
    if strategy in ("zero1", "zero2") and kind == "opt":
        return _Form(FlatLayout.build(logical), shards)
    if strategy in ("ddp", "zero1", "zero2"):
        return _Form(None, shards)
    raise SpmdError(
        describe(
            "restore_checkpoint",
            f"the checkpoint was saved with strategy {strategy!r}, which this version cannot convert.",
            fix="restore it into a template with the same strategy and device count.",
        )
    )


def _logical_params(state: TrainState) -> Any:
    """The model's parameter tree, abstract (shapes and dtypes), whatever form the state stores it in."""
    flat = getattr(state.layout, "flat", None) if state.strategy.shards_params else None
    if flat is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(flat.shapes, flat.dtypes, strict=True)]
    return jax.tree.unflatten(flat.treedef, leaves)
