"""The work of a compiled program: the floating-point operations of its matrix multiplications and convolutions,
per device, read from the optimised HLO (:attr:`Explanation.work <spmdcomm.explain.Explanation.work>`).

What is counted, per device and per call (one multiply-add is 2 FLOPs):

- a ``dot``: ``2 x (product of the result's dimensions, batch dimensions included) x (product of the contracting
  dimensions)``;
- a ``convolution``: ``2 x (result elements) x (kernel spatial size) x (input features per group)``: every window
  position, padding included (XLA's own cost analysis counts only the positions inside the input, so it is lower
  for a padded convolution);
- the same operations inside fusions (XLA:CPU wraps a dot in a ``kCustom`` / ``__ynn_fusion`` or ``kOutput``
  fusion), called computations and asynchronous wrappers;
- GPU library calls that stand for them: cuBLAS matmuls (``custom-call`` targets ``__cublas$gemm`` and
  ``__cublas$lt$matmul...``, read from their shapes and ``dot_dimension_numbers``) and cuDNN convolutions
  (``__cudnn$conv...``, whose window and ``dim_labels`` describe the forward convolution);
- a ``while`` body times its trip count (``known_trip_count``, which XLA writes on a loop it can count, e.g.
  ``lax.scan`` and ``lax.fori_loop`` with static bounds); a loop of unknown trip count is counted once and makes the
  count a lower bound;
- a ``conditional`` (``lax.cond``, ``lax.switch``) at its largest branch, which makes the count an upper bound when
  the branches differ (:meth:`Work.weighted` counts them by given shares instead).

Not counted: elementwise operations, reductions, transcendental functions, collectives, sorting, loop conditions
and any other custom call. Matrix multiplications dominate the work of the models this library trains, and they
are what a GPU's peak FLOP/s (the denominator of MFU) measures. Rematerialisation (``jax.checkpoint``) shows up as
duplicated dots in the optimised HLO, so recomputed work is counted.

>>> from spmdcomm.explain.flops import count_work
>>> text = "\\n".join([
...     "HloModule m",
...     "ENTRY %main (a: f32[8,32], b: f32[32,16]) -> f32[8,16] {",
...     "  %a = f32[8,32]{1,0} parameter(0)",
...     "  %b = f32[32,16]{1,0} parameter(1)",
...     "  ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
...     "}",
... ])
>>> work = count_work(text)
>>> work.flops == 2 * 8 * 32 * 16, work.bound
(True, 'exact')
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from spmdcomm._format import format_flops
from spmdcomm.errors import SpmdError, describe
from spmdcomm.explain.hlo import _ARRAY, Module, _Instruction, parse_module
from spmdcomm.explain.scopes import beside, scopes

__all__ = ["Work", "Conditional", "count_work", "model_flops", "work_line"]


@dataclasses.dataclass(frozen=True)
class Conditional:
    """One ``conditional`` of a program (a ``lax.cond`` or ``lax.switch``) and the work of each of its branches.

    Attributes:
      name: its HLO instruction name (the key of :meth:`Work.weighted`'s ``shares``).
      scope: the ``jax.named_scope`` / Flax module path it sits in (``""`` at the top).
      runs: how many times a call runs it (the product of the trip counts of the loops around it).
      flops: each branch's FLOPs per run, in branch-index order: ``lax.switch``'s order, ``(false, true)`` for a
        ``lax.cond``.
    """

    name: str
    scope: str
    runs: int
    flops: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Work:
    """The matmul and convolution FLOPs of one call of a compiled program (see :mod:`spmdcomm.explain.flops`).

    Attributes:
      flops: per device (every device of an SPMD program runs the same HLO on its own block).
      devices: the devices the program runs on.
      by_scope: FLOPs per device by ``jax.named_scope`` / Flax module path (``"M/Dense_0"``; a backward-pass op
        counts under its forward scope; an op XLA left without metadata under that of the loop, branch or fusion
        running it: :mod:`spmdcomm.explain.scopes`; ``""`` for ops outside any scope), largest first.
      conditionals: the program's conditionals with each branch's work.
      unknown_loops: how many ``while`` loops of unknown trip count were counted once.
      unscoped_near: the scopes of the instructions that feed or use a matmul or convolution counted under ``""``
        (no scope of its own nor of anything running it: XLA drops the metadata of some ops it rewrites); their
        counts in ``by_scope`` may be missing its FLOPs. Sorted.
    """

    flops: float
    devices: int
    by_scope: dict[str, float]
    conditionals: tuple[Conditional, ...] = ()
    unknown_loops: int = 0
    unscoped_near: tuple[str, ...] = ()
    # The program, to count again with shares (:meth:`weighted`), and whether shares counted this one.
    _module: Module | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _shares: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    @property
    def total(self) -> float:
        """The FLOPs summed over the program's devices: ``flops x devices``."""
        return self.flops * self.devices

    @property
    def bound(self) -> str:
        """What :attr:`flops` is: ``"exact"``, an ``"upper"`` or ``"lower"`` bound, or an ``"estimate"``.

        ``"upper"`` when a conditional whose branches differ counts at its largest branch; ``"lower"`` when a loop of
        unknown trip count counts once; ``"estimate"`` for both, or for branches counted by shares.
        """
        differ = any(len(set(c.flops)) > 1 for c in self.conditionals)
        if self._shares and differ:
            return "estimate"
        upper, lower = differ, self.unknown_loops > 0
        return {(False, False): "exact", (True, False): "upper", (False, True): "lower"}.get((upper, lower), "estimate")

    def weighted(self, shares: Sequence[float] | Mapping[str, Sequence[float]]) -> Work:
        """The work with each conditional counted as its branches' mean weighted by ``shares``, not the largest.

        Args:
          shares: one share per branch, in branch-index order (``(false, true)`` for a ``lax.cond``), for every
            conditional; or a mapping from a conditional's :attr:`Conditional.name` to its shares (the others keep
            their largest branch). Each conditional's shares must be as many as its branches, not negative, and
            sum to 1.

        Returns:
          A :class:`Work` whose ``bound`` is ``"estimate"`` where a weighted conditional's branches differ.

        Raises:
          SpmdError: if the shares do not fit a conditional (count, sign or sum), or name an unknown conditional.
        """
        if self._module is None:
            raise SpmdError(describe("Work.weighted", "this Work keeps no program to count again."))
        known = {c.name for c in self.conditionals}
        if isinstance(shares, Mapping):
            unknown = sorted(set(shares) - known)
            if unknown:
                raise SpmdError(
                    describe(
                        "Work.weighted",
                        f"shares name {unknown}, which are not conditionals of the program.",
                        fix=f"key the shares by Conditional.name: one of {sorted(known)}.",
                    )
                )
        return _count(self._module, self.devices, shares)


def count_work(hlo: str | Module, devices: int | None = None) -> Work:
    """The :class:`Work` of a program, from its optimised HLO text (``compiled.as_text()``) or parsed module.

    Args:
      hlo: the HLO text, or a module from :func:`spmdcomm.explain.hlo.parse_module`.
      devices: the devices it runs on; by default the module's (replicas x partitions).

    Returns:
      Its FLOPs per device, conditionals at their largest branch.
    """
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    return _count(module, module.devices if devices is None else devices, None)


def model_flops(parameters: int, tokens: int, *, layers: int = 0, context: int = 0, width: int = 0) -> int:
    """The dense-equivalent FLOPs of one training step (forward and backward) of a model, by the usual formula.

    ``6 x parameters x tokens`` (2 FLOPs per multiply-add per parameter and token forward, twice that backward) plus,
    for a transformer, ``12 x layers x context x width x tokens`` for the attention scores and their weighted sum
    (forward ``4 x context x width`` per token and layer, backward twice that; a causal mask still computes them all).

    Args:
      parameters: the parameters that multiply activations, per token: for a mixture of experts the active ones
        (those of the experts a token visits); leave out embedding tables, which are looked up, not multiplied.
      tokens: the tokens of one global batch.
      layers: attention layers (0: no attention term).
      context: the sequence length attention spans.
      width: the model width (query/key size summed over heads).

    Returns:
      The step's model FLOPs, for the whole global batch (divide by devices for a per-device figure).

    Examples:
      >>> model_flops(1_000, 64), model_flops(1_000, 64, layers=2, context=16, width=8)
      (384000, 580608)
    """
    return 6 * parameters * tokens + 12 * layers * context * width * tokens


# ------------------------------------------------------------------------------------------------
# Counting


@dataclasses.dataclass
class _Tally:
    """The work of one computation per run of it, before the enclosing loops multiply it."""

    flops: float = 0.0
    scopes: dict[str, float] = dataclasses.field(default_factory=dict)
    conditionals: list[Conditional] = dataclasses.field(default_factory=list)
    unknown_loops: int = 0

    def add(self, other: _Tally, times: float = 1, runs: int = 1) -> None:
        """Adds ``other`` run ``times`` times (its conditionals run ``runs`` times as often)."""
        self.flops += other.flops * times
        for scope, flops in other.scopes.items():
            self.scopes[scope] = self.scopes.get(scope, 0) + flops * times
        self.conditionals += [dataclasses.replace(c, runs=c.runs * runs) for c in other.conditionals]
        self.unknown_loops += other.unknown_loops


def _count(module: Module, devices: int, shares: Sequence[float] | Mapping[str, Sequence[float]] | None) -> Work:
    body: dict[str, list[_Instruction]] = {}
    for inst in module.instructions:
        body.setdefault(inst.computation, []).append(inst)
    shapes = {i.name: i.shape for i in module.instructions}
    scope = scopes(module)
    done: dict[str, _Tally] = {}

    def tally(computation: str) -> _Tally:
        if computation in done:
            return done[computation]
        total = _Tally()
        done[computation] = total  # a cycle (none in valid HLO) counts as empty rather than recursing forever
        for inst in body.get(computation, []):
            own = _own_flops(inst, shapes)
            if own:
                total.add(_Tally(own, {scope[inst.name]: own}))
            if inst.opcode == "while":
                trips = _trip_count(inst.attrs)
                runs = 1 if trips is None else trips  # unknown: once, a lower bound
                total.add(tally(_callee(inst.attrs, "body")), runs, runs)
                total.unknown_loops += trips is None
            elif inst.opcode == "conditional":
                branches = [tally(b) for b in _branches(inst.attrs)]
                weights = _weights(inst, len(branches), shares)
                if weights is None and branches:  # the largest branch
                    largest = max(range(len(branches)), key=lambda b: branches[b].flops)
                    weights = [float(b == largest) for b in range(len(branches))]
                for branch, weight in zip(branches, weights or []):
                    chosen = _Tally(branch.flops, branch.scopes)  # flops only: every branch's records are kept
                    total.add(chosen, weight)
                    total.add(_Tally(conditionals=branch.conditionals, unknown_loops=branch.unknown_loops))
                flops = tuple(_exact(b.flops) for b in branches)
                total.conditionals.append(Conditional(inst.name, scope[inst.name], 1, flops))
            elif inst.opcode in ("fusion", "async-start", "call"):  # run once, as part of the instruction
                for callee in _callees(inst.attrs, "to_apply" if inst.opcode == "call" else "calls"):
                    total.add(tally(callee))
        return total

    result = tally(module.entry) if module.entry else _Tally()
    by_scope = dict(sorted(result.scopes.items(), key=lambda kv: -kv[1]))
    lost = [i for i in module.instructions if not scope[i.name] and _own_flops(i, shapes)]
    work = Work(
        flops=_exact(result.flops),
        devices=devices,
        by_scope={k: _exact(v) for k, v in by_scope.items()},
        conditionals=tuple(result.conditionals),
        unknown_loops=result.unknown_loops,
        unscoped_near=beside(module, lost, scope),
    )
    object.__setattr__(work, "_module", module)  # frozen: set once, here
    object.__setattr__(work, "_shares", shares is not None)
    return work


def _own_flops(inst: _Instruction, shapes: dict[str, str]) -> int:
    """The FLOPs of one instruction itself (0 for anything but a matmul or a convolution)."""
    if inst.opcode == "dot" and len(inst.operands) >= 2:
        lhs = _dims(shapes.get(inst.operands[0], ""))
        contracting = _int_list(inst.attrs, "lhs_contracting_dims")
        return 2 * math.prod(_dims(inst.shape)) * math.prod(lhs[d] for d in contracting if d < len(lhs))
    if inst.opcode == "convolution" and len(inst.operands) >= 2:
        return _conv_flops(inst.attrs, _dims(inst.shape), _dims(shapes.get(inst.operands[1], "")))
    if inst.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        name = target.group(1) if target else ""
        operands = [_dims(shapes.get(o, "")) for o in inst.operands[:2]]
        result = _dims(inst.shape)  # the first array of a (result, workspace) tuple
        if name.startswith("__cublas$") and operands:
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
            contracting = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
            lhs = operands[0]
            return 2 * math.prod(result) * math.prod(lhs[d] for d in contracting if d < len(lhs))
        if name.startswith("__cudnn$conv") and len(operands) == 2:
            return _cudnn_conv_flops(name, inst.attrs, result, operands)
    return 0


def _conv_flops(attrs: str, output: list[int], kernel: list[int]) -> int:
    """``2 x output elements x kernel elements / kernel output features``: each result element sums the kernel's
    spatial window over its input features (per group)."""
    labels = re.search(r"dim_labels=\w+_(\w+)->\w+", attrs)
    if labels is None or len(labels.group(1)) != len(kernel) or "o" not in labels.group(1):
        return 0
    out_features = kernel[labels.group(1).index("o")]
    return 2 * math.prod(output) * math.prod(kernel) // max(out_features, 1)


def _cudnn_conv_flops(target: str, attrs: str, result: list[int], operands: list[list[int]]) -> int:
    """A cuDNN convolution call: its ``dim_labels`` describe the forward convolution (input, kernel -> output),
    whichever pass it computes; the FLOPs are the forward's, ``2 x |output| x |kernel| / output features``."""
    if "BackwardInput" in target:  # (output gradient, kernel) -> input gradient
        output, kernel = operands[0], operands[1]
    elif "BackwardFilter" in target:  # (input, output gradient) -> kernel gradient
        output, kernel = operands[1], result
    else:  # forward, with or without bias and activation: (input, kernel, ...) -> output
        output, kernel = result, operands[1]
    return _conv_flops(attrs, output, kernel)


def _weights(
    inst: _Instruction, branches: int, shares: Sequence[float] | Mapping[str, Sequence[float]] | None
) -> list[float] | None:
    """The shares of a conditional's branches, checked; ``None`` for its largest branch."""
    chosen = shares.get(inst.name) if isinstance(shares, Mapping) else shares
    if chosen is None:
        return None
    weights = [float(s) for s in chosen]
    if len(weights) != branches or min(weights, default=0) < 0 or not math.isclose(sum(weights), 1.0):
        raise SpmdError(
            describe(
                "Work.weighted",
                f"conditional {inst.name} has {branches} branches; the shares {weights} are not {branches} "
                "non-negative numbers summing to 1.",
                fix="pass one share per branch, in branch-index order ((false, true) for lax.cond), summing to 1.",
            )
        )
    return weights


def _trip_count(attrs: str) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', attrs)
    return int(m.group(1)) if m else None


def _branches(attrs: str) -> list[str]:
    """A conditional's branch computations in branch-index order (``(false, true)`` for a predicate)."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if listed:
        return re.findall(r"%?([\w.\-]+)", listed.group(1))
    return [_callee(attrs, "false_computation"), _callee(attrs, "true_computation")]


def _callee(attrs: str, key: str) -> str:
    found = _callees(attrs, key)
    return found[0] if found else ""


def _callees(attrs: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _dims(shape: str) -> list[int]:
    """The dimensions of the first array of ``shape`` (``f32[8,32]{1,0}`` -> ``[8, 32]``; ``[]`` for a scalar)."""
    m = _ARRAY.search(shape)
    if m is None:
        return []
    return [int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip()]


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,\s]*)\}}", attrs)
    return [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []


def _exact(flops: float) -> float:
    """Whole numbers as ``int`` (every count without shares is one)."""
    return int(flops) if float(flops).is_integer() else flops


def work_line(work: Work) -> str:
    """The report table's line for ``work``: per device, over the devices, and what makes it a bound."""
    line = (
        f"work: {format_flops(work.flops)} per device, {format_flops(work.total)} over {work.devices} "
        f"device(s) (matmuls and convolutions)"
    )
    differ = sum(len(set(c.flops)) > 1 for c in work.conditionals)
    notes = []
    if work.bound in ("upper", "estimate") and differ:
        notes.append(f"{differ} conditional(s) at their largest branch")
    if work.unknown_loops:
        notes.append(f"{work.unknown_loops} loop(s) of unknown trip count counted once")
    bound = {"upper": "an upper bound", "lower": "a lower bound"}.get(work.bound, "an estimate")
    return line if work.bound == "exact" else f"{line}; {bound}: {', '.join(notes)}"
