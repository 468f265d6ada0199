"""Reading the optimised HLO text of a compiled program: its instructions, which computations call which (and
through which control flow), and the collectives it holds with their sizes, dtypes, device groups and mesh axes.
The report built from them is :mod:`spmdcomm.explain.report`'s.

>>> from spmdcomm.explain.hlo import inventory, parse_module
>>> text = "\\n".join([
...     "HloModule m, num_partitions=2",
...     "ENTRY %main (p: f32[8]) -> f32[8] {",
...     "  %p = f32[8]{0} parameter(0)",
...     "  ROOT %r = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={{0,1}}, to_apply=%add",
...     "}",
... ])
>>> [(c.kind, c.bytes, c.dtypes, c.replica_groups) for c in inventory(parse_module(text), None)]
[('all-reduce', 32, ('float32',), ((0, 1),))]
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np
from jax.sharding import Mesh

from spmdcomm._format import LAYER_SCOPE

__all__ = ["COLLECTIVE_KINDS", "Collective"]

#: The HLO collectives :func:`~spmdcomm.explain` reports. Their asynchronous forms (``all-reduce-start`` /
#: ``all-reduce-done`` and the others, on GPU and TPU) count once, under the same kind. ``ragged-all-to-all`` is
#: XLA's all-to-all of runtime-sized chunks (:func:`~spmdcomm.ragged_all_to_all` on GPU and TPU).
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """Identical collectives of one compiled program (same kind, size, dtypes, groups and place).

    Device numbers are positions in the program's devices, in ``mesh.devices.flat`` order.

    Attributes:
      kind: one of :data:`COLLECTIVE_KINDS`.
      count: how many such collectives the program holds.
      bytes: one operation's message size per device (see :mod:`spmdcomm.explain.report`); ``total_bytes`` is
        ``count * bytes``. For a ``ragged-all-to-all`` it is a bound, the larger of its input and output buffers:
        how many rows it moves is decided at run time.
      buffers: how many arrays one operation moves: XLA fuses several reductions into one variadic all-reduce,
        which still pays per buffer on some backends.
      dtypes: the dtypes of the arrays it moves, by NumPy name (e.g. ``"float32"``).
      replica_groups: the device groups that reduce or exchange together (empty for a collective-permute).
      source_target_pairs: the ``(source, target)`` pairs of a collective-permute (empty for the other kinds).
      axes: the mesh axes the groups span; ``None`` when no mesh is known or the groups are not whole mesh
        axes.
      where: ``"entry"`` for the program's top level, else the constructs around it, outermost first, joined
        by ``"/"``: ``"while"`` (runs once per loop iteration), ``"conditional"``, ``"call"``.
      layer: the innermost ``jax.named_scope`` of the op's name that begins with ``LAYER_SCOPE`` (``"sc:"``), without
        it: a layer that names its collectives so (a MoE layer: its path); ``""`` for any other.
    """

    kind: str
    count: int
    bytes: int
    buffers: int
    dtypes: tuple[str, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...]
    axes: tuple[str, ...] | None
    where: str
    layer: str = ""

    @property
    def total_bytes(self) -> int:
        """``count * bytes``."""
        return self.count * self.bytes

    @property
    def in_loop(self) -> bool:
        """Whether the collective runs inside a while loop (once per iteration, not once per call)."""
        return "while" in self.where.split("/")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    """One HLO instruction: its result shape, opcode, operand names, attributes and computation."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed HLO module: what :func:`explain` reads of it."""

    name: str
    devices: int
    entry: str
    instructions: tuple[_Instruction, ...]  # in text order


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule\s+([^\s,]+)")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_NAME = re.compile(r"%?([\w.\-]+)\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([^\]]*)\]")
# Attributes that name called computations, and the construct each call stands for ("" = transparent: the
# callee runs as part of the calling instruction, e.g. a fusion or an async wrapper).
_CALLS = {"body": "while", "condition": "while", "branch_computations": "conditional"}
_CALLED = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


def parse_module(text: str) -> Module:
    """The module's name, device count, entry computation and instructions, from its HLO text."""
    name, entry, computation = "program", "", ""
    replicas = partitions = 1
    instructions = []
    for line in text.splitlines():
        if line.startswith("HloModule"):
            m = _MODULE.match(line)
            name = m.group(1) if m else name
            replicas = _int_attr(line, "replica_count", 1)
            partitions = _int_attr(line, "num_partitions", 1)
            continue
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("(", 1)[0]:
            computation = head.group(2)
            entry = computation if head.group(1) else entry
            continue
        m = _INSTRUCTION.match(line)
        if m is None or not computation:
            continue
        shape, rest = _split_shape(m.group(2))
        op = _OPCODE.match(rest)
        if op is None:
            continue
        inside, attrs = _split_parens(rest[op.end() - 1 :])
        operands = tuple(n.group(1) for n in map(_NAME.search, _split_top(inside)) if n)
        instructions.append(_Instruction(m.group(1), shape, op.group(1), operands, attrs, computation))
    return Module(name, replicas * partitions, entry, tuple(instructions))


def inventory(module: Module, mesh: Mesh | None) -> list[Collective]:
    """The collectives of ``module``, identical ones counted together, in program order; ``mesh`` names their axes."""
    by_name = {i.name: i for i in module.instructions}
    done_of = {i.operands[0]: i for i in module.instructions if i.opcode.endswith("-done") and i.operands}
    where = _call_contexts(module)
    rows: dict[tuple[Any, ...], int] = {}
    for inst in module.instructions:
        kind = inst.opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS or inst.computation not in where:
            continue
        # An async start's own shape bundles operands and context; the matching done holds the result.
        result = done_of[inst.name].shape if inst.opcode.endswith("-start") and inst.name in done_of else inst.shape
        # A ragged all-to-all's operands are its input, its output buffer and four offset and size arrays: only the
        # input is sent.
        operands = inst.operands[:1] if kind == "ragged-all-to-all" else inst.operands
        sent = sum(_shape_bytes(by_name[o].shape) for o in operands if o in by_name)
        dtypes = tuple(dict.fromkeys(_dtype_name(t) for t, _ in _ARRAY.findall(result)))
        groups: tuple[tuple[int, ...], ...]
        pairs: tuple[tuple[int, int], ...]
        if kind == "collective-permute":
            groups, pairs = (), _pairs(inst.attrs)
        else:
            groups, pairs = _groups(inst.attrs, module.devices), ()
        size = max(sent, _shape_bytes(result))
        key = (kind, size, len(operands), dtypes, groups, pairs, where[inst.computation], _layer(inst.attrs))
        rows[key] = rows.get(key, 0) + 1
    return [
        Collective(kind, count, size, buffers, dtypes, groups, pairs, _axes(mesh, groups, pairs), place, layer)
        for (kind, size, buffers, dtypes, groups, pairs, place, layer), count in rows.items()
    ]


def _layer(attrs: str) -> str:
    """The innermost layer scope in the op's metadata (``op_name``), or ``""``."""
    m = _OP_NAME.search(attrs)
    scopes = [p for p in (m.group(1).split("/") if m else []) if p.startswith(LAYER_SCOPE)]
    return scopes[-1].removeprefix(LAYER_SCOPE) if scopes else ""


def _call_contexts(module: Module) -> dict[str, str]:
    """Each computation reachable from the entry, with the control-flow constructs that lead to it."""
    calls: dict[str, list[tuple[str, str]]] = {}
    for inst in module.instructions:
        for attr, value in _CALLED.findall(inst.attrs):
            construct = _CALLS.get(attr, "")
            if attr in ("true_computation", "false_computation"):
                construct = "conditional"
            elif attr == "to_apply" and inst.opcode == "call":
                construct = "call"
            for callee in re.findall(r"%?([\w.\-]+)", value):
                calls.setdefault(inst.computation, []).append((callee, construct))
    contexts = {module.entry: ""}
    stack = [module.entry]
    while stack:
        caller = stack.pop()
        for callee, construct in calls.get(caller, []):
            if callee not in contexts:
                outer = contexts[caller]
                contexts[callee] = f"{outer}/{construct}".strip("/") if construct else outer
                stack.append(callee)
    return {c: place or "entry" for c, place in contexts.items()}


def _groups(attrs: str, devices: int) -> tuple[tuple[int, ...], ...]:
    by_axes = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", attrs)
    if by_axes:  # newer XLA: groups named by mesh axes, e.g. mesh['data'=2,'model'=4] {'data'}
        return _mesh_axis_groups(*by_axes.groups())
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        ids = np.arange(math.prod(_ints(iota.group(3)))).reshape(_ints(iota.group(3)))
        if iota.group(4):
            ids = ids.transpose(_ints(iota.group(4)))
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(count, size))
    listed = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    groups = () if listed is None else tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", listed.group(1)))
    return groups or (tuple(range(devices)),)  # no groups, or {}, means one group of every device


def _mesh_axis_groups(mesh: str, dims: str | None, perm: str | None, axes: str) -> tuple[tuple[int, ...], ...]:
    """The device groups of ``mesh['a'=2,'b'=4] {'a'}``: devices that differ only along the named axes."""
    named = re.findall(r"'([^']*)'\s*=\s*(\d+)", mesh)
    names, sizes = [n for n, _ in named], [int(s) for _, s in named]
    ids = np.arange(math.prod(sizes))
    if dims:  # an explicit device order, as in the iota form
        ids = ids.reshape(_ints(dims))
        if perm:
            ids = ids.transpose(_ints(perm))
    ids = ids.reshape(sizes)
    chosen = [names.index(a) for a in re.findall(r"'([^']*)'", axes)]
    rest = [i for i in range(len(names)) if i not in chosen]
    size = math.prod(sizes[i] for i in chosen)
    return tuple(tuple(int(d) for d in g) for g in ids.transpose(rest + chosen).reshape(-1, size))


def _pairs(attrs: str) -> tuple[tuple[int, int], ...]:
    listed = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if listed is None:
        return ()
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", listed.group(1)))


def _axes(
    mesh: Mesh | None, groups: tuple[tuple[int, ...], ...], pairs: tuple[tuple[int, int], ...]
) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of each group (or each pair) differ, if the groups are whole axes."""
    if mesh is None or not (groups or pairs):
        return None
    shape = mesh.devices.shape
    members = groups or pairs
    if any(d >= mesh.size for g in members for d in g):
        return None
    varying: set[int] = set()
    for g in members:
        coords = np.array(np.unravel_index(list(g), shape)).T
        varying |= {int(a) for a in np.flatnonzero((coords != coords[0]).any(axis=0))}
    axes = tuple(name for i, name in enumerate(mesh.axis_names) if i in varying)
    if groups and any(len(g) != math.prod(shape[i] for i in varying) for g in groups):
        return None  # groups that cover only part of an axis (or mix axes unevenly)
    return axes


# ------------------------------------------------------------------------------------------------
# Small text helpers


def _split_shape(text: str) -> tuple[str, str]:
    """``"(f32[2], s32[]) op(...)"`` -> the shape and the rest; a tuple shape may nest parentheses."""
    text = text.lstrip()
    if text.startswith("("):
        inside, rest = _split_parens(text)
        return f"({inside})", rest
    shape, _, rest = text.partition(" ")
    return shape, rest


def _split_parens(text: str) -> tuple[str, str]:
    """``"(a, (b), c) rest"`` -> ``"a, (b), c"`` and ``" rest"``: the text up to the matching parenthesis."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(ch, 0)
        if depth == 0:
            return text[1:i], text[i + 1 :]
    return text[1:], ""


def _split_top(text: str) -> list[str]:
    """Splits at the commas that are not inside brackets (operands may carry their shapes)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        total += math.ceil(count * _dtype_bits(dtype) / 8)
    return total


def _dtype_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    m = re.match(r"[a-z]+?(\d+)", dtype)
    return int(m.group(1)) if m else 0  # token[] and other non-data types move no bytes


def _dtype_name(dtype: str) -> str:
    """HLO element type -> NumPy / JAX name: f32 -> float32, s8 -> int8, bf16 -> bfloat16, f8e4m3fn -> ..."""
    if dtype == "pred":
        return "bool"
    m = re.fullmatch(r"(bf|f|s|u|c)(\d+)(.*)", dtype)
    if m is None:
        return dtype
    base = {"bf": "bfloat", "f": "float", "s": "int", "u": "uint", "c": "complex"}[m.group(1)]
    return f"{base}{m.group(2)}" + (f"_{m.group(3)}" if m.group(3) else "")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def _int_attr(line: str, name: str, default: int) -> int:
    m = re.search(rf"\b{name}=(\d+)", line)
    return int(m.group(1)) if m else default
