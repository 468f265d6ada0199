"""What a compiled step communicates and how much device memory it holds, without running it.

:func:`explain` compiles a function for the given arguments (a train or eval step, an ``spmd`` function, a
jitted or plain function) and reads the optimised HLO that XLA will run: every collective with its kind, how
many there are, the bytes each moves, the dtypes, the device groups and the mesh axes those groups span; and
the per-device memory XLA reserved for arguments, outputs, temporaries and code.

>>> f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
>>> report = sc.explain(f, np.ones((8, 1024), np.float32))
>>> [(c.kind, c.count, c.bytes, c.dtypes, c.axes) for c in report.collectives]
[('all-reduce', 1, 4096, ('float32',), ('data',))]

``bytes`` is the message size in the sense of nccl-tests (NCCL's benchmarks), per device and per operation:
the larger of the bytes one device sends into the collective and the bytes it gets out of it. That is the
buffer size for an all-reduce, the gathered (output) size for an all-gather, the unscattered (input) size for a
reduce-scatter, and the buffer each device sends for an all-to-all or a collective-permute. Bus bandwidth
follows with nccl-tests' factors (2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
all-to-all, 1 for permute).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spmdcomm.errors import SpmdError, describe

__all__ = ["explain", "Explanation", "Collective", "DeviceMemory", "COLLECTIVE_KINDS"]

#: The HLO collectives :func:`explain` reports. Their asynchronous forms (``all-reduce-start`` /
#: ``all-reduce-done`` and the others, on GPU and TPU) count once, under the same kind.
COLLECTIVE_KINDS: tuple[str, ...] = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def explain(fn: Any, /, *args: Any, mesh: Mesh | None = None, **kwargs: Any) -> Explanation:
    """Compiles ``fn(*args, **kwargs)`` (without running it) and reports its collectives and memory.

    ``fn`` is anything with a ``.lower(*args, **kwargs)`` method returning a ``jax.stages.Lowered`` (a train
    or eval step, an ``spmd`` function, a ``jax.jit`` function), a plain function (lowered through
    ``jax.jit``), or an already lowered or compiled program (then pass no arguments). The arguments are
    those of a call; a train step is not run, so its donated state stays usable.

    ``mesh`` names the axes of the device groups; by default the function's own mesh (``fn.mesh``, an
    ``spmd`` function's resolved mesh) or the mesh of its placed arguments. Counts and bytes are per call
    and per device; a collective inside a loop counts once (see :attr:`Collective.where`).

    >>> report = sc.explain(jax.jit(lambda x: x * 2), np.ones(4, np.float32))
    >>> report.collectives, report.memory.argument_bytes
    ((), 16)
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise SpmdError(
            describe(
                "explain",
                f"mesh is a {type(mesh).__name__}, not a jax.sharding.Mesh.",
                fix="pass the mesh the function runs on (e.g. spmdcomm.data_mesh()), or leave it out.",
            )
        )
    compiled = _compile(fn, args, kwargs)
    text = compiled.as_text()
    module = _parse_module(text)
    devices = module.devices
    if mesh is not None and mesh.size != devices:
        raise SpmdError(
            describe(
                "explain",
                f"mesh has {mesh.size} devices ({dict(mesh.shape)}) but the compiled program runs on {devices}.",
                fix="pass the mesh the function runs on, or leave mesh out.",
            )
        )
    if mesh is None:
        mesh = _mesh_of(fn, compiled, devices)
    return Explanation(
        name=_name_of(fn, module.name),
        devices=devices,
        mesh=mesh,
        collectives=tuple(_inventory(module, mesh)),
        memory=_memory(compiled),
        hlo=text,
    )


@dataclasses.dataclass(frozen=True)
class Collective:
    """Identical collectives of one compiled program (same kind, size, dtypes, groups and place).

    ``bytes`` is one operation's message size per device (see the module docstring); ``total_bytes`` is
    ``count * bytes``. ``buffers`` is how many arrays one operation moves: XLA fuses several reductions into
    one variadic all-reduce, which still pays per buffer on some backends. ``replica_groups`` lists the
    device groups that reduce or exchange together and ``source_target_pairs`` the ``(source, target)``
    pairs of a collective-permute (each empty for the other kinds). Device numbers are positions in the
    program's devices, in ``mesh.devices.flat`` order. ``axes`` names the mesh axes the groups span
    (``None`` when no mesh is known or the groups are not whole mesh axes). ``where`` is ``"entry"`` for the
    program's top level, else the constructs around it, outermost first, joined by ``"/"``: ``"while"``
    (runs once per loop iteration), ``"conditional"``, ``"call"``.
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

    @property
    def total_bytes(self) -> int:
        """``count * bytes``."""
        return self.count * self.bytes

    @property
    def in_loop(self) -> bool:
        """Whether the collective runs inside a while loop (once per iteration, not once per call)."""
        return "while" in self.where.split("/")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Per-device memory of a compiled program, from ``Compiled.memory_analysis()``, in bytes.

    Each field is ``None`` where the backend does not report it. ``alias_bytes`` are outputs that reuse a
    donated argument's buffer, so they are counted in both ``argument_bytes`` and ``output_bytes``.
    """

    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    alias_bytes: int | None

    @property
    def total_bytes(self) -> int | None:
        """Arguments + outputs + temporaries + generated code - aliased (``None`` if any is unknown)."""
        parts = (self.argument_bytes, self.output_bytes, self.temp_bytes, self.generated_code_bytes, self.alias_bytes)
        if any(p is None for p in parts):
            return None
        return parts[0] + parts[1] + parts[2] + parts[3] - parts[4]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the program's collectives, in program order, and its per-device memory.

    ``name`` is the function's name (its class name for a step object, the HLO module's name for a lowered
    or compiled program). ``str(explanation)`` (or :meth:`table`) prints an aligned table. ``hlo`` is the
    optimised HLO text the collectives were read from.
    """

    name: str
    devices: int
    mesh: Mesh | None
    collectives: tuple[Collective, ...]
    memory: DeviceMemory
    hlo: str = dataclasses.field(repr=False)

    def count(self, kind: str | None = None, *, over: str | None = None) -> int:
        """How many collectives of ``kind`` (default: of every kind) the program holds; with ``over``, only those
        whose groups span that mesh axis (e.g. the axis that crosses the network between nodes)."""
        return sum(c.count for c in self._of_kind(kind, over))

    def total_bytes(self, kind: str | None = None, *, over: str | None = None) -> int:
        """The message bytes of all collectives of ``kind`` (default: every kind), per device, per call; with
        ``over``, only those whose groups span that mesh axis."""
        return sum(c.total_bytes for c in self._of_kind(kind, over))

    def table(self) -> str:
        """The collectives and the memory as aligned text."""
        mesh = "" if self.mesh is None else " (mesh " + " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items()) + ")"
        lines = [f"{self.name} on {self.devices} device(s){mesh}"]
        rows = [("collective", "count", "bytes", "total", "buffers", "dtypes", "axes", "groups", "where")]
        for c in self.collectives:
            axes = "?" if c.axes is None else ",".join(c.axes) or "-"
            rows.append(
                (
                    c.kind,
                    str(c.count),
                    _format_bytes(c.bytes),
                    _format_bytes(c.total_bytes),
                    str(c.buffers),
                    ",".join(c.dtypes),
                    axes,
                    _format_groups(c),
                    c.where,
                )
            )
        if self.collectives:
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            right = {1, 2, 3, 4}  # numbers align right
            for r in rows:
                cells = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))]
                lines.append("  ".join(cells).rstrip())
            lines.append(f"total: {self.count()} collective(s), {_format_bytes(self.total_bytes())} per device")
            if self.mesh is not None and len(self.mesh.axis_names) > 1:
                spans = ", ".join(
                    f"{a} {self.count(over=a)} ({_format_bytes(self.total_bytes(over=a))})"
                    for a in self.mesh.axis_names
                )
                lines.append(f"over each axis: {spans}")
        else:
            lines.append("no collectives")
        m = self.memory
        parts = [
            ("arguments", m.argument_bytes),
            ("outputs", m.output_bytes),
            ("temporaries", m.temp_bytes),
            ("generated code", m.generated_code_bytes),
            ("aliased", m.alias_bytes),
            ("total", m.total_bytes),
        ]
        lines.append("memory per device: " + ", ".join(f"{k} {_format_bytes(v)}" for k, v in parts))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _of_kind(self, kind: str | None, over: str | None = None) -> list[Collective]:
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise SpmdError(
                describe(
                    "Explanation",
                    f"kind={kind!r} is not a collective kind.",
                    fix=f"pass one of {COLLECTIVE_KINDS}, or None for all of them.",
                )
            )
        if over is not None and (self.mesh is None or over not in self.mesh.axis_names):
            known = None if self.mesh is None else tuple(self.mesh.axis_names)
            raise SpmdError(
                describe(
                    "Explanation",
                    f"over={over!r} is not an axis of the program's mesh ({known}).",
                    fix="pass one of the mesh's axis names (explain(..., mesh=...) when it cannot tell the mesh).",
                )
            )
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (over is None or (c.axes is not None and over in c.axes))
        ]


# ------------------------------------------------------------------------------------------------
# Compiling


def _compile(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> jax.stages.Compiled:
    if isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
        if args or kwargs:
            raise SpmdError(
                describe(
                    "explain",
                    f"fn is already a {type(fn).__name__}, for fixed arguments, but {len(args) + len(kwargs)} "
                    "argument(s) were passed too.",
                    fix="call explain(lowered) without arguments, or pass the function itself with its arguments.",
                )
            )
        return fn if isinstance(fn, jax.stages.Compiled) else fn.compile()
    lower: Callable[..., Any] | None = getattr(fn, "lower", None)
    if not callable(lower):
        if not callable(fn):
            raise SpmdError(
                describe(
                    "explain",
                    f"fn is a {type(fn).__name__}, which is neither callable nor has a .lower(...) method.",
                    fix="pass a train or eval step, an spmd or jax.jit function, or a plain function, then its "
                    "arguments: spmdcomm.explain(step, state, batch).",
                )
            )
        lower = jax.jit(fn).lower
    lowered = lower(*args, **kwargs)
    if not isinstance(lowered, jax.stages.Lowered):
        raise SpmdError(
            describe(
                "explain",
                f"{type(fn).__name__}.lower(...) returned a {type(lowered).__name__}, not a jax.stages.Lowered.",
                fix="pass an object whose .lower(*args) returns jax.jit(...).lower(*args), or the plain function.",
            )
        )
    return lowered.compile()


def _mesh_of(fn: Any, compiled: jax.stages.Compiled, devices: int) -> Mesh | None:
    """The function's own mesh, else the mesh of its placed arguments, if it spans the program's devices."""
    candidates = [getattr(fn, "mesh", None)]
    resolved = getattr(fn, "resolved_mesh", None)
    if callable(resolved):
        candidates.append(resolved())
    candidates += [s.mesh for s in jax.tree.leaves(compiled.input_shardings) if isinstance(s, NamedSharding)]
    return next((m for m in candidates if isinstance(m, Mesh) and m.size == devices), None)


def _name_of(fn: Any, module_name: str) -> str:
    if isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
        return module_name
    return getattr(fn, "__name__", None) or type(fn).__name__


def _memory(compiled: jax.stages.Compiled) -> DeviceMemory:
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):  # backends without the analysis raise one of these
        stats = None

    def get(name: str) -> int | None:
        value = getattr(stats, name, None)
        return None if value is None else int(value)

    return DeviceMemory(
        argument_bytes=get("argument_size_in_bytes"),
        output_bytes=get("output_size_in_bytes"),
        temp_bytes=get("temp_size_in_bytes"),
        generated_code_bytes=get("generated_code_size_in_bytes"),
        alias_bytes=get("alias_size_in_bytes"),
    )


# ------------------------------------------------------------------------------------------------
# Reading HLO text


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str


@dataclasses.dataclass(frozen=True)
class _Module:
    name: str
    devices: int
    entry: str
    instructions: tuple[_Instruction, ...]  # in text order


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


def _parse_module(text: str) -> _Module:
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
    return _Module(name, replicas * partitions, entry, tuple(instructions))


def _inventory(module: _Module, mesh: Mesh | None) -> list[Collective]:
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
        sent = sum(_shape_bytes(by_name[o].shape) for o in inst.operands if o in by_name)
        dtypes = tuple(dict.fromkeys(_dtype_name(t) for t, _ in _ARRAY.findall(result)))
        if kind == "collective-permute":
            groups, pairs = (), _pairs(inst.attrs)
        else:
            groups, pairs = _groups(inst.attrs, module.devices), ()
        size = max(sent, _shape_bytes(result))
        key = (kind, size, len(inst.operands), dtypes, groups, pairs, where[inst.computation])
        rows[key] = rows.get(key, 0) + 1
    return [
        Collective(kind, count, size, buffers, dtypes, groups, pairs, _axes(mesh, groups, pairs), place)
        for (kind, size, buffers, dtypes, groups, pairs, place), count in rows.items()
    ]


def _call_contexts(module: _Module) -> dict[str, str]:
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


def _format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n < 1024:
        return f"{n} B"
    power = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def _format_groups(c: Collective) -> str:
    if c.source_target_pairs:
        text = ",".join(f"{a}->{b}" for a, b in c.source_target_pairs)
    else:
        text = ",".join("{" + ",".join(map(str, g)) + "}" for g in c.replica_groups)
    return text if len(text) <= 32 else text[:29] + "..."
