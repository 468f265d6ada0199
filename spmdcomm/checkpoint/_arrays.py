"""The arrays a checkpoint holds of a :class:`~spmdcomm.TrainState`: its step, parameters, optimizer state, model
state, RNG and loss scale, every leaf at the model's own shape (padded leaves cut to it), so that a checkpoint
restores onto any strategy and device count.

The checkpoint layer sits below ``spmdcomm.train`` (``fit`` saves checkpoints), so it never imports the state's
class: it reads a state through :class:`CheckpointState`, the attributes a ``TrainState`` has."""

from __future__ import annotations

import os
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import numpy as np

from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.data.strategies import BY_NAME

__all__ = [
    "CheckpointState",
    "State",
    "arrays",
    "targets",
    "unpadded",
    "stored",
    "with_arrays",
    "check_leaves",
    "leaf_name",
    "layout_of",
    "check_format",
]


@runtime_checkable
class CheckpointState(Protocol):
    """What checkpoints read of a :class:`~spmdcomm.TrainState`: its arrays, its layout on the mesh (strategy,
    padded leaves, pipeline order) and ``replace``. ``isinstance`` checks that every attribute is there."""

    @property
    def step(self) -> Any: ...
    @property
    def params(self) -> Any: ...
    @property
    def opt_state(self) -> Any: ...
    @property
    def model_state(self) -> Any: ...
    @property
    def rng(self) -> Any: ...
    @property
    def loss_scale(self) -> Any: ...
    @property
    def mesh(self) -> Any: ...
    @property
    def strategy(self) -> Any: ...
    @property
    def layout(self) -> Any: ...
    @property
    def pipeline(self) -> Any: ...
    @property
    def data_size(self) -> int: ...
    def replace(self, **updates: Any) -> Any: ...


State = TypeVar("State", bound=CheckpointState)


def arrays(state: CheckpointState) -> dict[str, Any]:
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


def targets(state: CheckpointState) -> dict[str, Any]:
    """What :func:`arrays` of ``state``'s unpadded form holds, as ``jax.ShapeDtypeStruct`` s with shardings: the
    leaves a checkpoint of this template must hold, and the shardings they are read into."""
    targets = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), arrays(state))
    layout, mesh = state.layout, state.mesh
    for which, field in (("params", "params"), ("opt", "opt_state")):
        structs = jax.tree.leaves(targets[field])
        shardings = jax.tree.leaves(layout.unpadded_shardings(mesh, which))
        shapes = layout.own_shapes(which)
        leaves = [
            jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
            for x, shape, sharding in zip(structs, shapes, shardings, strict=True)
        ]
        targets[field] = jax.tree.unflatten(jax.tree.structure(targets[field]), leaves)
    return targets


def unpadded(state: State) -> State:
    """``state`` with its padded leaves (spmdcomm.parallel.data.layout) at their own shapes, whole over the data axes,
    and a pipeline's stacked layers in canonical order: what a checkpoint holds, so that it restores onto any device
    count, strategy and pipeline layout."""
    layout, mesh = state.layout, state.mesh
    if not layout.pads and not _reordered(state):
        return state

    def cut(p: Any, o: Any) -> tuple[Any, Any]:
        p, o = layout.unpadded(p, "params", mesh), layout.unpadded(o, "opt", mesh)
        return _layers(state, p, "params", to_stage=False), _layers(state, o, "opt", to_stage=False)

    shardings = (layout.unpadded_shardings(mesh, "params"), layout.unpadded_shardings(mesh, "opt"))
    params, opt_state = jax.jit(cut, out_shardings=shardings)(state.params, state.opt_state)
    return state.replace(params=params, opt_state=opt_state)


def stored(state: State) -> State:
    """The inverse of :func:`unpadded`: ``state``'s leaves padded, ordered and placed as its layout stores them."""
    layout, mesh = state.layout, state.mesh
    if not layout.pads and not _reordered(state):
        return state

    def pad(p: Any, o: Any) -> tuple[Any, Any]:
        p, o = _layers(state, p, "params", to_stage=True), _layers(state, o, "opt", to_stage=True)
        return layout.stored(p, "params", mesh), layout.stored(o, "opt", mesh)

    shardings = (layout.shardings(mesh, "params"), layout.shardings(mesh, "opt"))
    params, opt_state = jax.jit(pad, out_shardings=shardings)(state.params, state.opt_state)
    return state.replace(params=params, opt_state=opt_state)


def _reordered(state: CheckpointState) -> bool:
    return state.pipeline is not None and state.pipeline.repeats > 1


def _layers(state: CheckpointState, tree: Any, which: str, *, to_stage: bool) -> Any:
    pipeline = state.pipeline
    if pipeline is None:
        return tree
    return pipeline.reorder(tree, state.layout.stacked_over(pipeline.axis, which), state.mesh, to_stage=to_stage)


def with_arrays(state: State, arrays: dict[str, Any]) -> State:
    """``state`` with the arrays :func:`arrays` listed replaced by ``arrays``."""
    arrays = dict(arrays)
    if "loss_scale" in arrays:
        arrays["loss_scale"] = state.loss_scale.replace(**arrays["loss_scale"])
    return state.replace(**arrays)


def check_leaves(directory: str | os.PathLike[str], step: int, saved: Any, state: CheckpointState) -> None:
    """Raises unless the checkpoint holds exactly the template's leaves, with the same shapes and dtypes."""
    stored = {m.name: m for m in jax.tree.leaves(dict(saved)) if hasattr(m, "shape")}
    wanted = {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(targets(state))[0]}
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


def leaf_name(path: tuple[Any, ...]) -> str:
    """A leaf's dotted name as orbax records it (``params.Dense_0.kernel``, ``opt_state.0.mu.Dense_0.bias``)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def layout_of(state: CheckpointState) -> dict[str, Any]:
    """What a checkpoint records of its state's layout: the format (2: the model's tree under every strategy),
    the strategy and the size of the axis its leaves were split over."""
    return {"format": FORMAT, "strategy": state.strategy.name, "shards": state.data_size}


FORMAT = 2


def check_format(directory: str | os.PathLike[str], step: int, saved: dict[str, Any]) -> None:
    # spmdcomm 0.2 stored what a strategy splits (ZeRO's optimizer state, FSDP's parameters) as flat vectors keyed
    # "<layer>/<dtype>": only the checkpoints of a strategy that split nothing hold the model's tree.
    if saved.get("format", 1) >= FORMAT or "strategy" not in saved:
        return
    written = BY_NAME.get(saved["strategy"])
    if written is None or written.shards_optimizer:
        raise SpmdError(
            describe(
                "restore_checkpoint",
                f"checkpoint {step} in {os.fspath(directory)!r} was saved by spmdcomm 0.2 with strategy "
                f"{saved['strategy']!r}, whose flat-vector layout this version no longer reads.",
                fix="restore it with spmdcomm 0.2 into a DDP template (strategy=spmdcomm.DDP()) and save it again; "
                "DDP checkpoints of 0.2 restore here into any strategy.",
            )
        )
