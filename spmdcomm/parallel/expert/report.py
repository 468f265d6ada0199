"""The expert section of ``sc.explain`` (:class:`ExpertReport`): a step's MoE layers, their experts' bytes per
device, and the all-to-alls over the expert axis, read from the compiled program."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from spmdcomm._format import format_bytes

__all__ = ["ExpertReport", "expert_report"]


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
      per_layer: ``(layer, all-to-alls, bytes per device)`` for each MoE layer, by its module path (the layers name
        their collectives with a ``jax.named_scope`` that the optimised HLO keeps); the rest are in ``"?"``.
    """

    axis: str
    size: int
    layers: tuple[tuple[str, int, int, int], ...]
    all_to_alls: int
    all_to_all_bytes: int
    padded: bool
    per_layer: tuple[tuple[str, int, int], ...] = ()

    def __str__(self) -> str:
        layers = len(self.layers)
        kind = "padded (dense all-to-alls: full bounds sent)" if self.padded else "ragged (bytes are bounds)"
        lines = [
            f"experts over {self.axis!r} ({self.size} devices): {layers} MoE layer{'s' * (layers != 1)}; all-to-alls "
            f"over {self.axis!r}: {self.all_to_alls} ({format_bytes(self.all_to_all_bytes)} per device), {kind}"
        ]
        lines += [
            f"  {path}: {experts} experts, {experts // self.size} per device{_split(mine * self.size, whole)}; "
            f"parameters {format_bytes(mine)} per device of {format_bytes(whole)}"
            for path, experts, mine, whole in self.layers
        ]
        lines += [
            f"  layer {layer}: {count} all-to-alls over {self.axis!r}, {format_bytes(sent)} per device"
            for layer, count, sent in self.per_layer
        ]
        return "\n".join(lines)


def expert_report(state: Any, collectives: tuple[Any, ...]) -> ExpertReport | None:
    """The :class:`ExpertReport` of a step of ``state`` (a ``TrainState``) whose compiled program holds
    ``collectives``; None without an expert axis."""
    config = state.configs.get("expert")
    if config is None:
        return None
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    layers: dict[str, list[int]] = {}
    for (path, x), flag in zip(flat, state.layout.stacked_over(config.axis, "params"), strict=True):
        if flag:
            keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            owner = len(keys) - keys[::-1].index("experts") if "experts" in keys else len(keys)
            entry = layers.setdefault(jax.tree_util.keystr(path[:owner]), [int(x.shape[0]), 0, 0])
            entry[1] += x.addressable_shards[0].data.nbytes
            entry[2] += x.nbytes
    moves = [
        c
        for c in collectives
        if c.kind in ("all-to-all", "ragged-all-to-all") and c.axes is not None and config.axis in c.axes
    ]
    return ExpertReport(
        axis=config.axis,
        size=int(state.mesh.shape[config.axis]),
        layers=tuple((f"params{p}", e, mine, whole) for p, (e, mine, whole) in layers.items()),
        all_to_alls=sum(c.count for c in moves),
        all_to_all_bytes=sum(c.total_bytes for c in moves),
        padded=bool(moves) and not any(c.kind == "ragged-all-to-all" for c in moves),
        per_layer=_per_layer(moves),
    )


def _per_layer(moves: list[Any]) -> tuple[tuple[str, int, int], ...]:
    """``(layer, count, bytes)`` of ``moves`` (collectives) by the layer each names, in program order."""
    by: dict[str, list[int]] = {}
    for c in moves:
        entry = by.setdefault(c.layer or "?", [0, 0])
        entry[0] += c.count
        entry[1] += c.total_bytes
    return tuple((layer, count, sent) for layer, (count, sent) in by.items())


def _split(held: int, whole: int) -> str:
    """``", each split N ways"`` where a device's experts are themselves split (FSDP: ``held`` bytes of the expert
    group on the expert axis, ``whole`` in all), else nothing."""
    ways = whole // max(held, 1)
    return f", each split {ways} ways over the data axes" if ways > 1 else ""
