"""The tables of the 1F1B schedules (1F1B, interleaved 1F1B, ZB-H1): which work item every stage runs at every
unit of the loop, and where its inputs and outputs live, computed once in NumPy before anything is traced.

The loop of :mod:`spmdcomm.parallel.pipeline.one_f_one_b` runs in lockstep units: at each unit every stage runs
at most one *action* on one chunk (``k = L / (v p)`` layers) of one micro-batch, and what it sends reaches its
neighbour for the next unit. The actions (torch's ``_ComputationType``):

- ``F``: the forward pass of a chunk, keeping its residuals (every layer's activations) in a slot of the ring;
- ``B``: the whole backward pass (input and weight gradient), freeing the slot; it takes two units (a backward
  pass costs about two forward passes), the second idle;
- ``I`` and ``W`` (the zero-bubble split): the input gradient, which the previous stage waits for, keeping the
  cotangent of each layer's output in a slot of its own; then the weight gradient, which nothing waits for,
  freeing both slots.

A schedule is a greedy list scheduler over these actions, its order and a limit on the micro-batches in flight
per stage (residuals kept until freed):

- ``"1f1b"`` (torch's ``Schedule1F1B``, with ``v > 1`` ``ScheduleInterleaved1F1B``): Megatron's fixed order per
  stage, ``v p - s - 1`` forwards on stage ``s``, then a ``F`` and a ``B`` in turn, then the last ``B`` actions;
  forwards in Megatron's interleaved order (``p`` micro-batches through chunk 0, the same through chunk 1, ...).
  Stage ``s`` keeps at most ``v p - s`` chunks of activations (stage 0 ``v p``: ``p`` micro-batches' worth).
- ``"zb-h1"`` (Qi et al. 2023, torch's ``ScheduleInterleavedZeroBubble``): a ready ``I`` first, else a ``F`` while
  the stage keeps fewer than ``v p`` chunks, else the oldest pending ``W``: the weight gradients fill the units
  1F1B leaves idle. Every stage keeps up to ``v p`` chunks (1F1B's stage-0 peak, on every stage), and the
  cotangents each ``W`` reads wait from its ``I``.

:attr:`Table.in_flight_per_stage` gives each stage's peak, :attr:`Table.in_flight` the largest.

The bubble is measured on the table in these units (``F = I = W = 1``, ``B = 2``): the idle fraction of the
stages' units.

>>> t = table("1f1b", stages=4, microbatches=8, repeats=1)
>>> t.units, t.in_flight, round(t.bubble, 3)
(33, 4, 0.273)
>>> z = table("zb-h1", stages=4, microbatches=8, repeats=1)
>>> z.units, z.in_flight, round(z.bubble, 3)
(29, 4, 0.172)
>>> t.in_flight_per_stage, z.in_flight_per_stage
([4, 3, 2, 1], [4, 4, 4, 4])
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["IDLE", "F", "B", "I", "W", "SCHEDULES", "COLUMNS", "Table", "table"]

IDLE, F, B, I, W = 0, 1, 2, 3, 4  # noqa: E741 (torch's names for the actions)

#: The schedules built from tables, and the names they are known by.
SCHEDULES = {"1f1b": "1f1b", "interleaved_1f1b": "1f1b", "zb-h1": "zb-h1"}

#: Per-stage columns of a table, each ``[units, stages]`` (``-1``: none).
COLUMNS = ("op", "chunk", "item", "res", "inbox", "grad", "recv_f", "recv_b", "recv_loss")


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
    """A schedule's table (module docstring).

    Attributes:
      kind: ``"1f1b"`` or ``"zb-h1"``.
      stages, microbatches, repeats: ``p``, ``m``, ``v``.
      columns: ``name -> [units, stages]`` ints: ``op`` (``IDLE``, ``F``, ``B``, ``I``, ``W``), ``chunk`` (``r``,
        the stage's chunk ``r``: layers of virtual stage ``r p + s``), ``item`` (the micro-batch), ``res`` (the
        ring slot ``F`` writes and ``B`` / ``I`` / ``W`` read), ``inbox`` (the slot of the forward inbox ``F``
        reads, ``-1`` for stage 0's chunk 0: the rows' own device sends it; of the backward inbox for ``B`` /
        ``I``), ``grad`` (the slot of the layers' cotangents ``I`` writes and ``W`` reads), ``recv_f`` / ``recv_b``
        (the inbox slot the activation from the left neighbour / the cotangent from the right neighbour sent at
        this unit goes to), ``recv_loss`` (the backward inbox slot of the loss's cotangent, last stage).
      events: ``name -> [units]``: ``input`` (the micro-batch stage 0 takes from its device), ``loss`` (the one
        whose loss is computed), ``back`` (the one whose cotangent leaves stage 0 for its device's layers).
      slots: ``name -> count``: ``res``, ``inbox_f``, ``inbox_b``, ``grad``: buffer sizes (at least 1).
      kinds: ``[units]``, a lockstep table's action at each unit (every stage runs it, on a work item or masked);
        ``None`` for a table whose stages run different actions at a unit.
    """

    kind: str
    stages: int
    microbatches: int
    repeats: int
    columns: dict[str, np.ndarray]
    events: dict[str, np.ndarray]
    slots: dict[str, int]
    kinds: np.ndarray | None = None

    @property
    def units(self) -> int:
        """The loop's length."""
        return int(self.columns["op"].shape[0])

    @property
    def in_flight(self) -> int:
        """The most micro-batch chunks whose activations a stage keeps at once (the ring's slots)."""
        return self.slots["res"]

    @property
    def in_flight_per_stage(self) -> list[int]:
        """Per stage, the most chunks it keeps at once."""
        return self._peaks

    @property
    def lockstep(self) -> bool:
        """Whether every stage runs the same action at each unit (module docstring)."""
        return self.kinds is not None

    @property
    def bubble(self) -> float:
        """The idle fraction of the stages' time: of their units, a ``B`` counting its two; in a lockstep table, of
        the units weighted by their action's cost (``F = I = W = 1``, ``B = 2``), a stage that runs the unit's
        action masked being idle."""
        op = self.columns["op"]
        if self.kinds is None:
            busy = np.count_nonzero(op != IDLE) + np.count_nonzero(op == B)
            return float(1.0 - busy / op.size)
        return float(1.0 - _COST[op].sum() / (_COST[self.kinds].sum() * self.stages))

    @functools.cached_property
    def _peaks(self) -> list[int]:
        op = self.columns["op"]
        frees = B if self.kind == "1f1b" else W
        held = np.cumsum((op == F).astype(int) - (op == frees).astype(int), axis=0)
        return [int(x) for x in held.max(axis=0)]


@functools.cache
def table(kind: str, *, stages: int, microbatches: int, repeats: int, lockstep: bool = False) -> Table:
    """The table of schedule ``kind`` (a key of :data:`SCHEDULES`) for ``p`` stages, ``m`` micro-batches (a multiple
    of ``p``) and ``v`` chunks per stage; ``lockstep``: every stage runs the same action at each unit (module
    docstring)."""
    kind = SCHEDULES[kind]
    return _Simulation(kind, stages, microbatches, repeats, lockstep).run()


#: What each action costs, in forward passes (the lockstep bubble's weights).
_COST = np.array([0, 1, 2, 1, 1])


class _Slots:
    """Per-stage free lists of a buffer's slots; the buffer's size is the most any stage uses at once."""

    def __init__(self, stages: int) -> None:
        self.used: list[set[int]] = [set() for _ in range(stages)]
        self.size = 1

    def take(self, s: int) -> int:
        slot = next(i for i in range(len(self.used[s]) + 1) if i not in self.used[s])
        self.used[s].add(slot)
        self.size = max(self.size, slot + 1)
        return slot

    def free(self, s: int, slot: int) -> None:
        self.used[s].remove(slot)


class _Simulation:
    def __init__(self, kind: str, p: int, m: int, v: int, lockstep: bool) -> None:
        self.kind, self.p, self.m, self.v, self.lockstep = kind, p, m, v, lockstep
        # Forwards in Megatron's interleaved order: groups of p micro-batches through chunk 0, then chunk 1, ...;
        # backwards the same through the chunks in reverse.
        order = [(g * p + i, r) for g in range(m // p) for r in range(v) for i in range(p)]
        self.forwards = order
        self.backwards = [(j, v - 1 - r) for j, r in order]
        # ZB-H1's chunks in flight per stage: 1F1B's peak, v p, on every stage (the ring has that many slots on
        # every device anyway), so that stages can put off their weight gradients.
        self.limit = v * p

    def run(self) -> Table:
        p, m, v = self.p, self.m, self.v
        done: dict[tuple[str, int, int, int], int] = {}  # (action, stage, item, chunk) -> unit
        next_f, next_b = [0] * p, [0] * p
        pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        busy_until = [-1] * p
        held = [0] * p
        res, inbox_f, inbox_b, grad = _Slots(p), _Slots(p), _Slots(p), _Slots(p)
        where: dict[tuple[str, int, int, int], int] = {}  # (buffer, stage, item, chunk) -> slot
        rows: list[dict[str, list[int]]] = []
        events: list[dict[str, int]] = []
        # F and B (two units; one in lockstep), or F, I and W
        total = (2 if self.kind == "1f1b" and self.lockstep else 3) * v * m * p
        finished = 0
        kinds: list[int] = []
        while finished < total:
            u = len(rows)
            if u > 8 * (v * m + p) * 3:
                raise AssertionError(f"the {self.kind} table did not finish: p={p}, m={m}, v={v}")
            row = {name: [-1] * p for name in COLUMNS}
            row["op"] = [IDLE] * p
            event = {"input": -1, "loss": -1, "back": -1}
            outputs: list[tuple[str, int, int, int]] = []
            ready = [self._ready(s, u, done, next_f, next_b, pending_w) for s in range(p)]
            if self.lockstep:
                kinds.append(self._unit_kind(kinds[-1] if kinds else None, ready, next_f, next_b))
            for s in range(p):
                if busy_until[s] >= u:
                    finished += 1  # the second unit of a B
                    continue
                action = (
                    self._pick(kinds[-1], ready[s])
                    if self.lockstep
                    else self._choose(s, ready[s], next_f[s], next_b[s], held[s])
                )
                if action is None:
                    continue
                name, j, r = action
                row["op"][s], row["chunk"][s], row["item"][s] = {"F": F, "B": B, "I": I, "W": W}[name], r, j
                # A B's cotangent is ready after its second unit.
                done[(name, s, j, r)] = u + 1 if name == "B" and not self.lockstep else u
                finished += 1
                if name == "F":
                    next_f[s] += 1
                    held[s] += 1
                    row["res"][s] = where[("res", s, j, r)] = res.take(s)
                    if s == 0 and r == 0:
                        event["input"] = j
                    else:
                        row["inbox"][s] = slot = where.pop(("in_f", s, j, r))
                        inbox_f.free(s, slot)
                    outputs.append(("F", s, j, r))
                elif name in ("B", "I"):
                    next_b[s] += 1
                    row["res"][s] = where[("res", s, j, r)]
                    row["inbox"][s] = slot = where.pop(("in_b", s, j, r))
                    inbox_b.free(s, slot)
                    if name == "B":
                        busy_until[s] = u if self.lockstep else u + 1
                        held[s] -= 1
                        res.free(s, where.pop(("res", s, j, r)))
                    else:
                        row["grad"][s] = where[("grad", s, j, r)] = grad.take(s)
                        pending_w[s].append((j, r))
                    if s == 0 and r == 0:
                        event["back"] = j
                    outputs.append(("B", s, j, r))
                else:  # W
                    pending_w[s].remove((j, r))
                    held[s] -= 1
                    row["res"][s] = slot = where.pop(("res", s, j, r))
                    res.free(s, slot)
                    row["grad"][s] = slot = where.pop(("grad", s, j, r))
                    grad.free(s, slot)
            # What this unit sent lands in the receivers' inboxes (slots freed by this unit's reads are reused).
            for name, s, j, r in outputs:
                if name == "F":
                    if s == p - 1 and r == v - 1:
                        event["loss"] = j
                        row["recv_loss"][s] = where[("in_b", s, j, r)] = inbox_b.take(s)
                    else:
                        to, chunk = (s + 1, r) if s < p - 1 else (0, r + 1)
                        row["recv_f"][to] = where[("in_f", to, j, chunk)] = inbox_f.take(to)
                elif not (s == 0 and r == 0):
                    to, chunk = (s - 1, r) if s > 0 else (p - 1, r - 1)
                    row["recv_b"][to] = where[("in_b", to, j, chunk)] = inbox_b.take(to)
            rows.append(row)
            events.append(event)
        columns = {name: np.array([row[name] for row in rows], np.int32) for name in COLUMNS}
        event_columns = {name: np.array([e[name] for e in events], np.int32) for name in ("input", "loss", "back")}
        slots = {"res": res.size, "inbox_f": inbox_f.size, "inbox_b": inbox_b.size, "grad": grad.size}
        lock = np.array(kinds, np.int32) if self.lockstep else None
        return Table(self.kind, p, m, v, columns, event_columns, slots, lock)

    def _ready(
        self,
        s: int,
        u: int,
        done: dict[tuple[str, int, int, int], int],
        next_f: list[int],
        next_b: list[int],
        pending_w: list[list[tuple[int, int]]],
    ) -> dict[str, tuple[str, int, int] | None]:
        """What stage ``s`` could run at unit ``u``: its next forward and next backward (``B`` or ``I``) in their
        orders if their inputs have arrived, and its oldest pending weight gradient."""
        p, v, n = self.p, self.v, len(self.forwards)
        before = lambda key: done.get(key, u) < u  # finished at an earlier unit: its output has arrived
        backward = "B" if self.kind == "1f1b" else "I"
        ready: dict[str, tuple[str, int, int] | None] = {"F": None, "B": None, "W": None}
        if next_b[s] < n:
            j, r = self.backwards[next_b[s]]
            if s == p - 1 and r == v - 1:
                source = ("F", s, j, r)
            else:
                to, chunk = (s + 1, r) if s < p - 1 else (0, r + 1)
                source = (backward, to, j, chunk)
            ready["B"] = (backward, j, r) if before(source) else None
        if next_f[s] < n:
            j, r = self.forwards[next_f[s]]
            if (s == 0 and r == 0) or before(("F", s - 1, j, r) if s > 0 else ("F", p - 1, j, r - 1)):
                ready["F"] = ("F", j, r)
        if pending_w[s]:
            ready["W"] = ("W", *pending_w[s][0])
        return ready

    def _choose(
        self, s: int, ready: dict[str, tuple[str, int, int] | None], next_f: int, next_b: int, held: int
    ) -> tuple[str, int, int] | None:
        """The action stage ``s`` runs at a unit of a table whose stages run different actions (None: it waits)."""
        p, v, n = self.p, self.v, len(self.forwards)
        if self.kind == "1f1b":
            # A fixed order, as Megatron's: v p - s - 1 forwards, then a forward and a backward in turn, then the
            # last backwards; the stage waits for the next of its order.
            warm = min(v * p - s - 1, n)
            forward_next = next_f < warm or (next_f < n and next_b >= next_f - warm)
            return ready["F"] if forward_next else ready["B"]
        # ZB-H1: an input gradient as soon as it can run (the previous stage waits for it), else a forward while
        # the ring has room, else the oldest weight gradient.
        if ready["B"] is not None:
            return ready["B"]
        if ready["F"] is not None and held < self.limit:
            return ready["F"]
        return ready["W"]

    def _unit_kind(
        self,
        last: int | None,
        ready: list[dict[str, tuple[str, int, int] | None]],
        next_f: list[int],
        next_b: list[int],
    ) -> int:
        """A lockstep unit's action: the next of the schedule's cycle (``F``, ``B``; ``F``, ``I``, ``W``) that some
        stage can run; a ``W`` only when every stage has one pending (else it would run masked somewhere) or
        nothing else is left."""
        cycle = [F, B] if self.kind == "1f1b" else [F, I, W]
        start = 0 if last is None else cycle.index(last) + 1
        n = len(self.forwards)
        rest = all(f == n for f in next_f) and all(b == n for b in next_b)
        for kind in cycle[start:] + cycle[:start]:
            key = "F" if kind == F else "W" if kind == W else "B"
            stages = [r[key] is not None for r in ready]
            if any(stages) and (kind != W or all(stages) or rest):
                return kind
        raise AssertionError(f"the lockstep {self.kind} table is stuck: p={self.p}, m={self.m}, v={self.v}")

    @staticmethod
    def _pick(kind: int, ready: dict[str, tuple[str, int, int] | None]) -> tuple[str, int, int] | None:
        """A stage's action at a lockstep unit of action ``kind``: its ready one of that kind (None: masked)."""
        return ready["F" if kind == F else "W" if kind == W else "B"]
