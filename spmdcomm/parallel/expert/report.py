"""The expert section of ``sc.explain`` (:class:`ExpertReport`): a step's MoE layers, their experts' bytes per
device, the all-to-alls over the expert axis, and the path each layer's experts run on with its matmul FLOPs, read
from the compiled program."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax

from spmdcomm._format import LAYER_SCOPE, format_bytes, format_flops
from spmdcomm.parallel.data._specs import names
from spmdcomm.parallel.registry import Program

__all__ = ["ExpertReport", "ExpertLayer", "expert_report"]

# The scopes the experts run in (spmdcomm.parallel.expert.routing.moe), by the path they name.
_PATHS = {"grouped_experts": "grouped", "grouped_experts_one_row": "grouped", "buffered_experts": "buffer"}
# Scopes whose matmuls XLA may turn into elementwise products (tiles of one row): their count is not vouched for.
_UNCOUNTED = {"grouped_experts_one_row"}
_WORDS = {
    "grouped": "grouped experts (routed rows only)",
    "buffer": "buffered experts (a static buffer of rows per expert)",
    "grouped+buffer": "grouped and buffered experts",
    "": "experts not found in the program",
}


class ExpertLayer(NamedTuple):
    """One MoE layer of a step (:attr:`ExpertReport.per_layer`): its all-to-alls and its experts' path and work.

    Attributes:
      layer: its module path: the layer names its collectives and its experts with a ``jax.named_scope`` of
        ``"sc:"`` and the path, which the optimised HLO keeps in each op's name; ``"?"`` for what no layer names
        (the NNX layer names none: its layers together).
      all_to_alls: its all-to-alls over the expert axis per step, forward and backward.
      all_to_all_bytes: their message bytes per device.
      path: what its experts run on: ``"grouped"`` (each local expert on the rows it received only, in tiles:
        :mod:`~spmdcomm.parallel.expert.grouped`; the default), ``"buffer"`` (a static buffer of ``B`` rows per
        expert: ``grouped=False``), ``"grouped+buffer"`` (layers of both under ``"?"``), or ``""`` where the
        program holds neither.
      flops: the matmul FLOPs per device of its experts, forward and backward, as
        :attr:`Explanation.work <spmdcomm.explain.Explanation.work>` counts them (the ops in its experts' scope, and
        those XLA left without metadata inside a loop, branch or fusion of that scope); for the grouped path every
        tile of the static bound computes (``(ceil(R / b) + L) b`` rows for a bound of ``R`` received rows over
        ``L`` local experts and tiles of ``b`` rows), which a run stays under as it skips the tiles past its rows.
        ``None`` where the count cannot be vouched for: tiles of one row (XLA turns their matmuls into elementwise
        products), a matmul without any scope next to the experts' ops (``Work.unscoped_near``: it may be theirs),
        a loop of unknown trip count in the program, or no path found.
    """

    layer: str
    all_to_alls: int
    all_to_all_bytes: int
    path: str = ""
    flops: float | None = None

    def line(self, axis: str) -> str:
        """The report's line for this layer (``axis``: the expert axis)."""
        work = "matmul FLOPs unknown" if self.flops is None else f"{format_flops(self.flops)} per device"
        bound = "at most " if "grouped" in self.path and self.flops is not None else ""
        return (
            f"layer {self.layer}: {_WORDS.get(self.path, self.path)}, {self.all_to_alls} all-to-alls over {axis!r}, "
            f"{format_bytes(self.all_to_all_bytes)} per device, {bound}{work}"
        )


@dataclasses.dataclass(frozen=True)
class ExpertReport:
    """A step's expert parallelism (a section of ``sc.explain``): its MoE layers and what crosses the expert axis.

    Attributes:
      axis: the expert axis; ``size``: its devices ``e``.
      layers: ``(path, experts, bytes per device, bytes)`` of each MoE layer's stacked experts: ``E / e`` experts
        per device, ``1 / e`` of the bytes; under FSDP over ``N`` data devices each of those experts is split ``N``
        ways too (``1 / (e N)`` of the bytes), which the text says.
      all_to_alls: all-to-alls over the axis per step (forward and backward, every layer), and ``all_to_all_bytes``
        their message bytes per device.
      padded: the program moves the routed rows with the padded fallback (dense all-to-alls: every device is sent
        its bound of rows, whatever the routing), not with XLA's ``ragged-all-to-all``, which sends the routed rows
        only; read from the compiled program, so ``implementation="padded"`` on a GPU shows here too.
      per_layer: each MoE layer (:class:`ExpertLayer`): its all-to-alls, the path its experts run on and their
        matmul FLOPs per device, by its module path, in program order.
      stacked: ``(path, L, p)`` of the entries of ``layers`` that hold a pipeline's ``L`` stacked MoE layers
        (``[L, E, ...]``, the layers split over the ``p`` devices of the stage axis, the experts over the expert
        axis): one entry for the stack, its bytes per device ``1 / (p e)`` of them.
    """

    axis: str
    size: int
    layers: tuple[tuple[str, int, int, int], ...]
    all_to_alls: int
    all_to_all_bytes: int
    padded: bool
    per_layer: tuple[ExpertLayer, ...] = ()
    stacked: tuple[tuple[str, int, int], ...] = ()

    def __str__(self) -> str:
        stacks = {path: (count, stages) for path, count, stages in self.stacked}
        layers = sum(stacks.get(path, (1, 1))[0] for path, *_ in self.layers)
        kind = "padded (dense all-to-alls: full bounds sent)" if self.padded else "ragged (bytes are bounds)"
        lines = [
            f"experts over {self.axis!r} ({self.size} devices): {layers} MoE layer{'s' * (layers != 1)}; all-to-alls "
            f"over {self.axis!r}: {self.all_to_alls} ({format_bytes(self.all_to_all_bytes)} per device), {kind}"
        ]
        for path, experts, mine, whole in self.layers:
            count, stages = stacks.get(path, (1, 1))
            mine_layers = count // stages
            held = (
                f"{count} layers of {experts} experts, {mine_layers} layer{'s' * (mine_layers != 1)} of "
                f"{experts // self.size} experts per device (the layers over the stage axis)"
                if count > 1
                else f"{experts} experts, {experts // self.size} per device"
            )
            lines.append(
                f"  {path}: {held}{_split(mine * self.size * stages, whole)}; "
                f"parameters {format_bytes(mine)} per device of {format_bytes(whole)}"
            )
        lines += [f"  {layer.line(self.axis)}" for layer in self.per_layer]
        return "\n".join(lines)


def expert_report(state: Any, program: Program) -> ExpertReport | None:
    """The :class:`ExpertReport` of a step of ``state`` (a ``TrainState``) compiled to ``program``; None without an
    expert axis."""
    config = state.configs.get("expert")
    if config is None:
        return None
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    layers: dict[str, list[int]] = {}
    stage = getattr(state.configs.get("pipeline"), "axis", None)

    def experts_dim(spec: Any) -> int | None:
        # Dimension 0, or 1 behind a pipeline's stacked layers ([L, E, ...], L over the stage axis).
        if names(spec, 0) == config.axis:
            return 0
        return 1 if stage is not None and names(spec, 0) == stage and names(spec, 1) == config.axis else None

    stacked: dict[str, tuple[int, int]] = {}
    for (path, x), spec in zip(flat, state.layout.param_leaf_specs, strict=True):
        dim = experts_dim(spec)
        if dim is not None:
            keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            owner = len(keys) - keys[::-1].index("experts") if "experts" in keys else len(keys)
            key = jax.tree_util.keystr(path[:owner])
            entry = layers.setdefault(key, [int(x.shape[dim]), 0, 0])
            if dim == 1:
                stacked[f"params{key}"] = (int(x.shape[0]), int(state.mesh.shape[stage]))
            entry[1] += x.addressable_shards[0].data.nbytes
            entry[2] += x.nbytes
    moves = [
        c
        for c in program.collectives
        if c.kind in ("all-to-all", "ragged-all-to-all") and c.axes is not None and config.axis in c.axes
    ]
    return ExpertReport(
        axis=config.axis,
        size=int(state.mesh.shape[config.axis]),
        layers=tuple((f"params{p}", e, mine, whole) for p, (e, mine, whole) in layers.items()),
        all_to_alls=sum(c.count for c in moves),
        all_to_all_bytes=sum(c.total_bytes for c in moves),
        padded=bool(moves) and not any(c.kind == "ragged-all-to-all" for c in moves),
        per_layer=_per_layer(moves, program),
        stacked=tuple((path, count, stages) for path, (count, stages) in stacked.items()),
    )


def _per_layer(moves: list[Any], program: Program) -> tuple[ExpertLayer, ...]:
    """Each MoE layer named by ``moves`` (collectives) or by its experts' scope in the program, in program order:
    its all-to-alls and bytes, its experts' path (from every op's name) and their FLOPs (from ``program.work``)."""
    sent: dict[str, list[int]] = {}
    for c in moves:
        entry = sent.setdefault(c.layer or "?", [0, 0])
        entry[0] += c.count
        entry[1] += c.total_bytes
    paths: dict[str, set[str]] = {}
    uncounted: set[str] = set()
    for name in dict.fromkeys(re.findall(r'op_name="([^"]*)"', program.hlo)):
        found = _experts_of(name)
        if found is not None:
            paths.setdefault(found[0], set()).add(found[1])
            if _UNCOUNTED & set(name.split("/")):
                uncounted.add(found[0])
    flops: dict[str, float] = {}
    doubtful: set[str] = set()
    if paths:  # the work is counted only for a program with experts in it
        work = program.work()
        for scope, count in work.by_scope.items():
            found = _experts_of(scope)
            if found is not None:
                flops[found[0]] = flops.get(found[0], 0) + count
        # A matmul that lost its metadata next to a layer's experts may be theirs; a loop counted once undercounts.
        doubtful = uncounted | {f[0] for f in map(_experts_of, work.unscoped_near) if f is not None}
        if work.unknown_loops:
            doubtful |= set(paths)
    result = []
    for layer in dict.fromkeys([*sent, *paths]):
        path = "+".join(sorted(paths.get(layer, ())))
        count = None if not path or layer in doubtful else flops.get(layer, 0)
        moved, moved_bytes = sent.get(layer, (0, 0))
        result.append(ExpertLayer(layer, moved, moved_bytes, path, count))
    return tuple(result)


def _experts_of(scope: str) -> tuple[str, str] | None:
    """``(layer, path)`` of a scope or op name inside a MoE layer's experts: the innermost ``"sc:"`` part before the
    experts' scope (``"?"`` without one) and the path it names; None outside any experts."""
    layer = "?"
    for part in scope.split("/"):
        while (inner := re.fullmatch(r"[\w\-]+\((.*)\)", part)) is not None:  # transpose(jvp(MoE_0)) -> MoE_0
            part = inner.group(1)
        if part.startswith(LAYER_SCOPE):
            layer = part.removeprefix(LAYER_SCOPE)
        elif part in _PATHS:
            return layer, _PATHS[part]
    return None


def _split(held: int, whole: int) -> str:
    """``", each split N ways"`` where a device's experts are themselves split (FSDP: ``held`` bytes of the expert
    group on the expert axis, ``whole`` in all), else nothing."""
    ways = whole // max(held, 1)
    return f", each split {ways} ways over the data axes" if ways > 1 else ""
