"""What a compiled step communicates, how much device memory it holds and how much work it does, without running it.

:func:`explain` compiles a function for the given arguments (a train or eval step, an ``spmd`` function, a
jitted or plain function) and reads the optimised HLO that XLA will run: every collective with its kind, how
many there are, the bytes each moves, the dtypes, the device groups and the mesh axes those groups span; the
per-device memory XLA reserved for arguments, outputs, temporaries and code; and the FLOPs of its matrix
multiplications and convolutions (:mod:`spmdcomm.explain.flops`).

>>> f = sc.spmd(lambda x: sc.psum(x, "data"), in_specs=sc.P("data"), out_specs=sc.P())
>>> report = sc.explain(f, np.ones((8, 1024), np.float32))
>>> [(c.kind, c.count, c.bytes, c.dtypes, c.axes) for c in report.collectives]
[('all-reduce', 1, 4096, ('float32',), ('data',))]

``bytes`` is the message size in the sense of nccl-tests (NCCL's benchmarks), per device and per operation:
the larger of the bytes one device sends into the collective and the bytes it gets out of it. That is the
buffer size for an all-reduce, the gathered (output) size for an all-gather, the unscattered (input) size for a
reduce-scatter, and the buffer each device sends for an all-to-all or a collective-permute (for a ragged
all-to-all, a bound: the larger of its input and output buffers). Bus bandwidth
follows with nccl-tests' factors (2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
all-to-all, 1 for permute).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from spmdcomm._format import format_bytes as _format_bytes
from spmdcomm.errors import SpmdError, describe
from spmdcomm.explain.flops import Work, count_work, work_line
from spmdcomm.explain.hlo import COLLECTIVE_KINDS, Collective
from spmdcomm.explain.hlo import inventory as _inventory
from spmdcomm.explain.hlo import parse_module as _parse_module
from spmdcomm.explain.memory import DeviceMemory, device_memory
from spmdcomm.parallel.pipeline.report import PipelineReport
from spmdcomm.parallel.registry import Program, registered
from spmdcomm.train.memory import StateMemory
from spmdcomm.train.state import TrainState

__all__ = ["explain", "Explanation", "Collective", "DeviceMemory", "PipelineReport", "COLLECTIVE_KINDS"]


def explain(fn: Any, /, *args: Any, mesh: Mesh | None = None, **kwargs: Any) -> Explanation:
    """Compiles ``fn(*args, **kwargs)`` (without running it) and reports its collectives, memory and work.

    A train step is not run, so its donated state stays usable. Counts and bytes are per call and per
    device; a collective inside a loop counts once (see :attr:`Collective.where`).

    Args:
      fn: anything with a ``.lower(*args, **kwargs)`` method returning a ``jax.stages.Lowered`` (a train or
        eval step, an ``spmd`` function, a ``jax.jit`` function), a plain function (lowered through
        ``jax.jit``), or an already lowered or compiled program (then pass no arguments).
      *args: the positional arguments of a call.
      mesh: the mesh whose axes name the device groups; by default the function's own mesh (``fn.mesh``, an
        ``spmd`` function's resolved mesh) or the mesh of its placed arguments.
      **kwargs: the keyword arguments of a call.

    Returns:
      An :class:`Explanation` of the compiled program.

    Raises:
      SpmdError: if ``mesh`` is not a ``jax.sharding.Mesh`` or has another number of devices than the
        program, ``fn`` is neither callable nor has a ``.lower`` method (or that returns no
        ``jax.stages.Lowered``), arguments come with an already lowered or compiled ``fn``, or the backend
        does not print its compiled program.

    Examples:
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
    if text is None:  # JAX's answer where a backend cannot print its compiled program
        raise SpmdError(
            describe(
                "explain",
                "the compiled program has no text to read (its as_text() returned None: the backend does not "
                "print it).",
                fix="explain the function on a backend that prints its compiled HLO: cpu, gpu or tpu.",
            )
        )
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
    collectives = tuple(_inventory(module, mesh))
    state = args[0] if args and isinstance(args[0], TrainState) else None
    work = functools.cache(lambda: count_work(module, devices))  # counted once, if a section asks
    sections = () if state is None else _sections(state, Program(collectives, text, work))
    return Explanation(
        name=_name_of(fn, module.name),
        devices=devices,
        mesh=mesh,
        collectives=collectives,
        memory=device_memory(compiled),
        hlo=text,
        state=None if state is None else state.memory(),
        pipeline=next((s for s in sections if isinstance(s, PipelineReport)), None),
        sections=sections,
    )


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the program's collectives, in program order, its per-device memory and its work.

    ``str(explanation)`` (or :meth:`table`) prints an aligned table. :attr:`work` (with :attr:`flops` and
    :attr:`flops_total`) counts the FLOPs of the program's matrix multiplications and convolutions.

    Attributes:
      name: the function's name (its class name for a step object, the HLO module's name for a lowered or
        compiled program).
      devices: the number of devices the program runs on.
      mesh: the mesh whose axes name the collectives' device groups, or ``None`` when none is known.
      collectives: the collectives, in program order.
      memory: the per-device memory XLA reserved.
      hlo: the optimised HLO text the collectives were read from.
      state: for a train or eval step, the bytes of its :class:`~spmdcomm.TrainState` per device, by part
        (:meth:`TrainState.memory <spmdcomm.TrainState.memory>`: parameters, optimizer state, padding); else None.
      pipeline: for a step of a state with a :class:`~spmdcomm.Pipeline`, its schedule and what moves over the
        stage axis (:class:`PipelineReport`); else None.
      sections: for a train or eval step, the section of each parallelism its state runs that reports one (the
        :attr:`pipeline` among them), in registration order; else empty.
    """

    name: str
    devices: int
    mesh: Mesh | None
    collectives: tuple[Collective, ...]
    memory: DeviceMemory
    hlo: str = dataclasses.field(repr=False)
    state: StateMemory | None = None
    pipeline: PipelineReport | None = None
    sections: tuple[Any, ...] = ()

    @functools.cached_property
    def work(self) -> Work:
        """The FLOPs of the program's matrix multiplications and convolutions, read from :attr:`hlo`.

        Per device, summed over devices, by scope, and whether the count is exact or a bound
        (:class:`~spmdcomm.explain.Work`); counted on first use.
        """
        return count_work(self.hlo, self.devices)

    @property
    def flops(self) -> float:
        """The matmul and convolution FLOPs of one call, per device (``work.flops``; an ``int`` unless weighted)."""
        return self.work.flops

    @property
    def flops_total(self) -> float:
        """The matmul and convolution FLOPs of one call summed over the program's devices (``flops x devices``)."""
        return self.work.total

    def flops_ratio(self, reference: Explanation | float) -> float:
        """How much work this program does for what ``reference`` does: :attr:`flops_total` over the reference's.

        Compare a step on a mesh with the same step on one device for the same global batch: 1.0 means no work is
        repeated or wasted; above 1 is duplicated work (replicated compute, recomputation, padding). Against
        :func:`~spmdcomm.explain.model_flops` it is the ratio of the executed matmul FLOPs to the model's.

        Args:
          reference: another report (its :attr:`flops_total`) or a number of FLOPs for the whole global batch.

        Returns:
          ``flops_total / reference``.

        Raises:
          SpmdError: if the reference counts no FLOPs.
        """
        base = reference.flops_total if isinstance(reference, Explanation) else float(reference)
        if not base > 0:
            raise SpmdError(
                describe(
                    "Explanation.flops_ratio",
                    f"the reference counts {base} FLOPs: there is nothing to compare with.",
                    fix="compare with a program that multiplies matrices (the same step on one device), or a "
                    "positive number of FLOPs.",
                )
            )
        return self.flops_total / base

    def count(self, kind: str | None = None, *, over: str | None = None) -> int:
        """How many collectives of ``kind`` the program holds, per call.

        Args:
          kind: one of :data:`COLLECTIVE_KINDS`; ``None`` (default) counts every kind.
          over: a mesh axis name: count only the collectives whose groups span that axis (e.g. the axis that
            crosses the network between nodes); ``None`` (default) counts them all.

        Returns:
          The sum of :attr:`Collective.count` over the matching collectives.

        Raises:
          SpmdError: if ``kind`` is not a collective kind, or ``over`` is not an axis of :attr:`mesh`.
        """
        return sum(c.count for c in self._of_kind(kind, over))

    def total_bytes(self, kind: str | None = None, *, over: str | None = None) -> int:
        """The message bytes of all collectives of ``kind``, per device, per call.

        Args:
          kind: one of :data:`COLLECTIVE_KINDS`; ``None`` (default) sums every kind.
          over: a mesh axis name: sum only the collectives whose groups span that axis; ``None`` (default) sums
            them all.

        Returns:
          The sum of :attr:`Collective.total_bytes` over the matching collectives.

        Raises:
          SpmdError: if ``kind`` is not a collective kind, or ``over`` is not an axis of :attr:`mesh`.
        """
        return sum(c.total_bytes for c in self._of_kind(kind, over))

    def table(self) -> str:
        """The collectives and the memory as aligned text.

        Returns:
          One line naming the program, its devices and mesh; one row per collective (count, bytes, total, buffers,
          dtypes, axes, groups, where) with the totals (and, on a mesh of several axes, the totals over each
          axis), or ``no collectives``; then the memory per device and the work (FLOPs per device and over all
          devices, with the kind of bound where it is not exact).
        """
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
        lines.append(work_line(self.work))
        lines += [str(section) for section in self.sections]
        if self.state is not None:
            st = self.state
            lines.append(
                f"state per device: parameters {_format_bytes(st.params)}, optimizer state "
                f"{_format_bytes(st.opt_state)}, model state {_format_bytes(st.model_state)} (of which padding "
                f"{_format_bytes(st.padding)}; parameters whole on every device {_format_bytes(st.whole)})"
            )
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


# ------------------------------------------------------------------------------------------------
# Formatting


def _format_groups(c: Collective) -> str:
    if c.source_target_pairs:
        text = ",".join(f"{a}->{b}" for a, b in c.source_target_pairs)
    else:
        text = ",".join("{" + ",".join(map(str, g)) + "}" for g in c.replica_groups)
    return text if len(text) <= 32 else text[:29] + "..."


def _sections(state: TrainState, program: Program) -> tuple[Any, ...]:
    """The explain section of each parallelism ``state`` runs (its registry entry's ``explain``) that has one."""
    configs = state.configs
    hooks = [p.explain for p in registered() if p.keyword in configs and p.explain is not None]
    return tuple(s for s in (hook(state, program) for hook in hooks) if s is not None)
