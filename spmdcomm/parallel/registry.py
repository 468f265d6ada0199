"""The parallelisms a train state can run besides data parallelism, one :class:`Parallelism` entry each, registered by
one line in ``spmdcomm/parallel/__init__.py`` (``register(...)``); :class:`~spmdcomm.parallel.roles.MeshRoles`,
``TrainState.create``, the steps and ``sc.explain`` read the entries instead of naming a parallelism.

An entry says what its mesh axis does and what the state and the steps do for it: the role and the keyword of
``TrainState.create`` that takes its config object (``pipeline=sc.Pipeline(...)``), or the axis name that turns it on
when no config is given; whether its axis splits the batch's rows (as one more data axis: the stage axis) or the
tokens of every row (dimension 1: the context axis); whether leaves split over it on dimension 0 are its own (a
pipeline's stacked layers, stacked experts ``[E, ...]``); its checks before anything compiles; what it does to the
parameters once the layout is known; the context it installs around the model call inside the traced step; and its
section of ``sc.explain``. Parameters it owns may also be placed by a logical axis name (``logical``): the rule
``(logical, its axis)`` joins the state's logical axis rules, so ``nn.with_logical_partitioning(init, ("expert",
...))`` splits dimension 0 over its axis, composing with FSDP on the other dimensions and with model axes.

Inside the step the model sees the batch as a data axis would split it (its axis is manual in the step's
``shard_map``): parameters replicated over the axis get their gradient summed over it by autodiff, as over the
stage axis, and the step sums the example count and the metrics over it. A layer that needs a statistic of the
global batch (a mixture of experts' load-balancing loss) reads the axes from the context its parallelism installs
(``roles.manual``: every axis the batch is split over), reduces over them with ``sc.psum``, and hands the value to
``loss_fn`` (a Flax ``sow`` collection or the model state); ``loss_fn`` adds it to the loss and may return it in
``aux``: a value that is already global is the same on every device, and the step's mean over blocks keeps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from jax.sharding import Mesh

from spmdcomm.errors import SpmdError, describe

__all__ = ["Parallelism", "Program", "register", "registered", "logical_rules"]


class Program(NamedTuple):
    """What ``sc.explain`` read of a compiled step, for the parallelisms' sections (an entry's ``explain``).

    Attributes:
      collectives: its collectives (``spmdcomm.explain.Collective``), in program order.
      hlo: its optimised HLO text.
      work: its matmul and convolution FLOPs (``spmdcomm.explain.Work``), counted on the first call, then kept.
    """

    collectives: tuple[Any, ...]
    hlo: str
    work: Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """One parallelism of a train state's mesh (an entry of the registry).

    Attributes:
      role: its name among the mesh roles (``"stage"``, ``"context"``; ``roles.axis(role)``).
      keyword: the ``TrainState.create`` keyword that takes its config (``"pipeline"``).
      config: the class of its config objects (:class:`~spmdcomm.Pipeline`); a config has an ``axis`` attribute.
      axis_words: how messages name its axis (``"the pipeline's stage axis"``).
      example: a config to suggest in messages (``"sc.Pipeline(microbatches=...)"``).
      by_name: with no config given, a mesh axis of this name turns it on with ``config()`` (``None``: only a
        config does).
      rows: its axis splits the batch's rows, as a data axis (it joins ``roles.batch``); otherwise it splits the
        tokens of every row (dimension 1 of each batch leaf of two or more dimensions, in ``config.order``).
      stacks: parameter leaves split over its axis on dimension 0 are its own: each device holds its block of them.
      logical: a logical axis name mapped to its axis while it runs (``None``: none).
      check: ``check(fn, config, mesh)`` raises before anything compiles for a config the mesh cannot run.
      prepare: ``prepare(fn, config, params, layout) -> params``: the parameters as the state stores them, once the
        layout is known (a pipeline's layers in stage order).
      step_context: ``step_context(config, roles)``: the context manager the steps enter around the model call
        (``config`` is ``None`` for a state without it, so that a step's trace never sees an outer step's).
      explain: ``explain(state, program) -> section | None``: its part of ``sc.explain``'s report (an object
        whose ``str`` is one line or more), from the state and what ``sc.explain`` read of the compiled step
        (:class:`Program`).
    """

    role: str
    keyword: str
    config: type
    axis_words: str
    example: str
    by_name: str | None = None
    rows: bool = True
    stacks: bool = False
    logical: str | None = None
    check: Callable[[str, Any, Mesh], None] | None = None
    prepare: Callable[[str, Any, Any, Any], Any] | None = None
    step_context: Callable[[Any, Any], AbstractContextManager[Any]] | None = None
    explain: Callable[[Any, Program], Any] | None = None

    def enter(self, config: Any, roles: Any) -> AbstractContextManager[Any]:
        """The context the steps enter around the model call (a null context when it installs none)."""
        return contextlib.nullcontext() if self.step_context is None else self.step_context(config, roles)


def register(entry: Parallelism) -> Parallelism:
    """Adds ``entry`` to the registry (after the others: their order is the order of the batch axes) and returns it.

    Raises:
      SpmdError: when another entry has its role or keyword.
    """
    for other in _REGISTRY:
        if entry.role == other.role or entry.keyword == other.keyword:
            raise SpmdError(
                describe(
                    "register",
                    f"a parallelism with role {entry.role!r} and keyword {entry.keyword!r} is registered already as "
                    f"{other.config.__name__} (role {other.role!r}, keyword {other.keyword!r}).",
                    fix="give the new parallelism a role and a keyword of its own.",
                )
            )
    _REGISTRY.append(entry)
    return entry


def registered() -> tuple[Parallelism, ...]:
    """Every registered parallelism, in registration order."""
    return tuple(_REGISTRY)


def logical_rules(configs: dict[str, Any]) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """``(rules, whole)`` for a state running the parallelisms of ``configs`` (``{keyword: config}``): the
    ``(logical name, axis)`` rule of each of them that has a logical name, and the logical names of the registered
    ones it does not run (their dimensions stay whole, without a rule or a warning)."""
    running = [p for p in _REGISTRY if configs.get(p.keyword) is not None]
    rules = tuple((p.logical, configs[p.keyword].axis) for p in running if p.logical)
    return rules, tuple(p.logical for p in _REGISTRY if p.logical and p not in running)


_REGISTRY: list[Parallelism] = []
