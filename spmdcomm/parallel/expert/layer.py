"""The Flax Linen mixture-of-experts layer (:class:`MoE`) and the ``expert`` mesh role: :class:`ExpertParallel`, the
context the steps install for MoE layers (:func:`expert_split`), the section of ``sc.explain`` and the registry entry
(:data:`PARALLELISM`). In the steps of a state on a mesh with an ``expert`` axis, the stacked experts (logical name
``"expert"`` on dimension 0) are split over that axis, the batch's rows too (as over a data axis), and every MoE layer
takes its axis and the axes that split the tokens from the step: the result equals one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from jax import lax

from spmdcomm._format import LAYER_SCOPE
from spmdcomm.collectives.ragged import RaggedImplementation
from spmdcomm.errors import AxisError, ShapeError, SpmdError, describe
from spmdcomm.parallel.context import ContextParallel, active_context
from spmdcomm.parallel.expert.capacity import SequenceSplit
from spmdcomm.parallel.expert.report import expert_report
from spmdcomm.parallel.expert.routing import Experts, MoEStats, RoutingName, check_routing, moe
from spmdcomm.parallel.pipeline.schedule import PIPELINED
from spmdcomm.parallel.real_rows import Unknown, real_rows
from spmdcomm.parallel.registry import Parallelism

__all__ = [
    "MoE",
    "MoEStats",
    "moe",
    "moe_rows",
    "MOE_COLLECTION",
    "ExpertParallel",
    "expert_split",
    "step_split",
    "token_mask",
    "PARALLELISM",
]

MOE_COLLECTION = "moe"  # the Flax collection MoE layers sow their losses and metrics into
EXPERT = "expert"  # the logical name of the stacked experts' dimension 0 (the state maps it to the expert axis)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Which mesh axis the experts of every MoE layer are split over.

    Pass it as ``TrainState.create(..., expert=sc.ExpertParallel(axis=...))``; a mesh axis named ``"expert"`` turns
    it on without one. In the steps of such a state, dimension 0 of every leaf a MoE layer stacks its experts on
    (logical name ``"expert"``) is split over ``axis``, each device holding ``E / e`` experts, and the batch's rows
    are split over it too, as over one more data axis (so no device computes the dense parts twice); every MoE layer
    takes the axis and the axes that split the tokens from the step (no ``axis_name=``), and the result equals one
    device.

    Args:
      axis: the mesh axis (``"expert"``).

    Raises:
      SpmdError: for an axis that is not a string.

    Examples:
      >>> sc.ExpertParallel()
      ExpertParallel(axis='expert')
    """

    axis: str = "expert"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str):
            raise SpmdError(describe("ExpertParallel", f"axis={self.axis!r} is not a mesh axis name.", fix='"expert"'))


class Split(NamedTuple):
    """What a step tells its MoE layers: the expert ``axis`` (None: every expert local), the ``token_axes`` (every
    axis the step maps by hand), those that split every sequence (``sequence``), and the pipeline's stage axis."""

    axis: str | None
    token_axes: tuple[str, ...]
    sequence: tuple[str, ...]
    stage: str | None


_ACTIVE: contextvars.ContextVar[Split | None] = contextvars.ContextVar("spmdcomm_expert", default=None)


@contextlib.contextmanager
def expert_split(config: ExpertParallel | None, roles: Any) -> Iterator[None]:
    """Within the block (the steps enter it around the model call), MoE layers run over ``config``'s axis (every
    expert local for ``None``) with their statistics and capacity over ``roles.manual``, the global batch."""
    split = Split(None if config is None else config.axis, tuple(roles.manual), tuple(roles.tokens), roles.stage)
    token = _ACTIVE.set(split)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def step_split(
    fn: str, axis_name: str | None, token_axes: tuple[str, ...] | None
) -> tuple[str | None, tuple[str, ...] | None, ContextParallel | None]:
    """``(axis_name, token_axes, context)`` a layer runs with: its own axes outside a step; inside a step, the
    step's (a layer's own must then be unset or the same), and the step's context split (``None`` without one),
    whose axis splits every sequence. Raises :class:`~spmdcomm.errors.AxisError` for a layer's axes that differ
    from the step's and :class:`~spmdcomm.errors.SpmdError` for what the steps cannot run exactly yet."""
    split = _ACTIVE.get()
    if split is None:
        return axis_name, token_axes, None
    token_axes_now = split.token_axes
    if split.stage is not None:
        if PIPELINED.get() == split.stage:
            # Inside the loop the stage devices hold other micro-batches and layers: one micro-batch's tokens.
            token_axes_now = tuple(a for a in split.token_axes if a != split.stage)
    mine: list[tuple[str, Any, Any]] = [("axis_name", axis_name, split.axis)] if axis_name is not None else []
    mine += [("token_axes", tuple(token_axes), token_axes_now)] if token_axes is not None else []
    for name, value, want in mine:
        if value != want:
            raise AxisError(
                describe(
                    fn,
                    f"{name}={value!r}, but the step runs its MoE layers with {name}={want!r} (its expert axis and "
                    "the axes it splits the batch over).",
                    fix=f"leave {name} unset: inside a train or eval step the layer takes it from the step.",
                )
            )
    return split.axis, token_axes_now, _sequence_split(fn, split.sequence)


def _sequence_split(fn: str, sequence: tuple[str, ...]) -> ContextParallel | None:
    """The context split of the step (its axis splits every sequence), or None without one."""
    context = active_context() if sequence else None
    if sequence and (context is None or (context.axis,) != sequence):
        raise SpmdError(
            describe(
                fn,
                f"the step splits every sequence over {sequence}, but no context split of that axis is active: the "
                "capacity rule cannot place the tokens in their sequences.",
                fix="run the layer inside the train or eval step of a state with context=sc.ContextParallel(...).",
            )
        )
    return context


class MoE(nn.Module):
    """A mixture-of-experts layer: a router choosing ``k`` of ``experts`` copies of ``expert`` for each token.

    ``y[t] = sum_r w[t, r] * expert_{e[t, r]}(x[t])`` over the last dimension of ``x`` (the tokens are every other
    position). The router is a ``[d, E]`` kernel (parameter ``"router"``, float32 math); the experts' parameters are
    stacked ``[E, ...]`` under ``"experts"`` (PipelineStack's convention: dimension 0 the experts), each initialised
    from its own key and boxed with the logical name ``"expert"`` on dimension 0 (then the expert's own logical
    names, if any). In the steps of a state with an expert axis (:class:`ExpertParallel`) the layer takes its axes
    from the step and the state splits those leaves over the axis. Elsewhere, with ``axis_name``, call it inside
    ``spmd``/``jax.shard_map`` with dimension 0 of every ``"experts"`` leaf split over that axis (``P(axis_name)``)
    and the tokens split too: the result equals the layer on one device on the global batch (:func:`moe`).
    Initialise it outside (it then runs as one device, every expert local). Each call sows its :class:`MoEStats`
    into the ``"moe"`` collection (``MOE_COLLECTION``); a loss function reads them with ``y, state =
    model.apply(variables, x, mutable=["moe"])`` and adds, for example, 0.01 times the sum of every
    ``load_balancing_loss`` under ``state["moe"]`` (one entry per layer and call, under the layer's path).

    Attributes:
      expert: the expert, an unbound Flax module mapping ``[rows, d]`` to ``[rows, d_out]`` row by row.
      experts: ``E``, over all devices.
      k: experts per token (default 2).
      routing: ``"softmax_topk"`` (default) or ``"topk_softmax"``.
      capacity_factor: ``None`` (dropless, default) or the factor of the GShard/Switch capacity rule, which drops
        in one device's order on the global batch: every first choice before any second choice, then the rows, then
        each row's positions in the original sequence order (also when a context axis splits every sequence, in
        either layout: the layer then takes ``x`` as ``[rows, tokens, ..., d]``).
      axis_name: the mesh axis the experts are split over, or ``None`` (every expert on this device).
      token_axes: every axis that splits the tokens, in the global batch's order (default: ``axis_name``).
      implementation: of the all-to-alls: ``"auto"``, ``"native"`` or ``"padded"``.
      router_init: the router kernel's initializer.
      grouped: run each local expert on the rows it received only (default; the work of the routed rows:
        :mod:`~spmdcomm.parallel.expert.grouped`), or, ``False``, on a static buffer of ``B`` rows per expert
        (``n T`` rows dropless: the work of every expert on every token of the expert axis), which forward-mode
        differentiation (``jax.jvp``) also takes.
      parent: Flax's module parent.
      name: Flax's module name.

    Examples:
      >>> layer = sc.MoE(nn.Dense(4), experts=4, k=2)
      >>> variables = jax.jit(layer.init)(jax.random.key(0), jnp.ones((3, 4)))
      >>> kernel = nn.unbox(variables["params"])["experts"]["kernel"]  # boxed with the logical name "expert"
      >>> kernel.shape, jax.jit(layer.apply)(variables, jnp.ones((3, 4))).shape
      ((4, 4, 4), (3, 4))
    """

    expert: nn.Module
    experts: int
    k: int = 2
    routing: RoutingName = "softmax_topk"
    capacity_factor: float | None = None
    axis_name: str | None = None
    token_axes: tuple[str, ...] | None = None
    implementation: RaggedImplementation = "auto"
    router_init: Callable[..., Any] = nn.initializers.normal(0.02)
    grouped: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Routes every real position of ``x`` (features last) to its experts and returns their weighted outputs.

        Args:
          x: ``[..., d]``.
          mask: which positions are real (:func:`token_mask`): ``None``, or bool / 0-1 numbers of shape
            ``x.shape[:j]`` for some ``j < x.ndim`` (``[rows]`` or ``[rows, tokens]``); inside a step with a
            masked batch, the step's row mask also applies.

        Returns:
          ``[..., d_out]``, in ``x``'s dtype; zeros at the positions that are not real.
        """
        check_routing("MoE", experts=self.experts, k=self.k, routing=self.routing, capacity_factor=self.capacity_factor)
        x = jnp.asarray(x)
        h = x.reshape(-1, x.shape[-1])
        router = self.param("router", self.router_init, (x.shape[-1], self.experts), jnp.float32)
        expert = self.expert.clone(parent=None)
        if not self.has_variable("params", "experts"):
            keys = jax.random.split(self.make_rng("params"), self.experts)
            created = jax.vmap(lambda key: expert.init(key, h[:1])["params"])(keys)
            self.param("experts", lambda _: stacked_boxes("MoE", created))
        # Read without Flax's shape check: inside a mapping this device holds E / n of the experts.
        params = meta.unbox(self.get_variable("params", "experts"))
        one = lambda p, rows: cast(jax.Array, expert.apply({"params": p}, rows))
        run = Experts(params, one) if self.grouped else lambda buf: jax.vmap(one)(params, buf)
        axis, tokens, context = None, None, None
        if not self.is_initializing():
            axis, tokens, context = step_split("MoE", self.axis_name, self.token_axes)
        _check_held(jax.tree.leaves(params)[0].shape[0], self.experts, axis)
        # Named for sc.explain, which attributes this layer's all-to-alls (forward and backward) to its path.
        real = None if self.is_initializing() else token_mask("MoE", x, mask)
        with jax.named_scope(LAYER_SCOPE + ".".join(str(p) for p in self.path)):
            y, stats = moe_rows(
                self, x, router, run, experts=self.experts, axis=axis, tokens=tokens, mask=real, context=context
            )
        # Not while initialising: applying the whole init output would append to the init's entry and count twice.
        for field, value in [] if self.is_initializing() else stats._asdict().items():
            self.sow(MOE_COLLECTION, field, value)
        return y


def moe_rows(
    layer: Any,
    x: jax.Array,
    router: jax.Array,
    run: Experts | Callable[[jax.Array], jax.Array],
    *,
    experts: int,
    axis: str | None,
    tokens: tuple[str, ...] | None,
    mask: jax.Array | None = None,
    context: ContextParallel | None = None,
) -> tuple[jax.Array, MoEStats]:
    """:func:`moe` of ``x`` (``[..., features]``, every position a token, ``mask`` of ``x.shape[:-1]`` the real ones)
    routed by ``x @ router`` in float32, with ``layer``'s ``k``, ``routing``, ``capacity_factor`` and
    ``implementation``: the call the Linen and NNX layers share. With the step's ``context`` split and a capacity,
    ``x`` is ``[rows, tokens, ..., features]``, dimension 1 this device's positions of every sequence (the capacity
    drops in one device's token order: :class:`~spmdcomm.parallel.expert.capacity.SequenceSplit`). Returns
    ``[..., d_out]`` and the statistics."""
    h = x.reshape(-1, x.shape[-1])
    sequence = None
    if context is not None and layer.capacity_factor is not None:
        fn = "MoE" if isinstance(layer, nn.Module) else "nnx.MoE"
        sequence = SequenceSplit.of(fn, context.axis, context.layout, x.shape, layer.capacity_factor)
    y, stats = moe(
        h,
        h.astype(jnp.float32) @ router,
        run,
        experts=experts,
        k=layer.k,
        routing=layer.routing,
        capacity_factor=layer.capacity_factor,
        axis_name=axis,
        token_axes=tokens,
        implementation=layer.implementation,
        mask=None if mask is None else mask.reshape(-1),
        sequence=sequence,
    )
    return y.reshape(*x.shape[:-1], y.shape[-1]), stats


def token_mask(fn: str, x: jax.Array, mask: Any) -> jax.Array | None:
    """Which positions of ``x`` (``[..., d]``) a MoE layer routes: ``x.shape[:-1]`` bools, or ``None`` for all.

    ``mask`` (the caller's: bool, or numbers where nonzero is real) of shape ``x.shape[:j]``, ``j < x.ndim``,
    covers the positions below it. Inside a train or eval step given a masked batch, the step's row mask
    (:func:`~spmdcomm.parallel.real_rows.real_rows`) applies to dimension 0 of ``x`` as well; where ``x``'s
    dimension 0 is not the batch's rows (a model that reshapes them), the caller's ``mask`` is used alone, and
    without one the layer raises rather than route padding.

    Raises:
      ShapeError: for a ``mask`` whose shape is not a prefix of ``x.shape[:-1]``.
      SpmdError: inside a step with a masked batch, for an ``x`` whose rows are not the batch's and no ``mask``.
    """
    positions = x.shape[:-1]
    given = None
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != positions[: mask.ndim] or mask.ndim == 0 and positions == ():
            raise ShapeError(
                describe(
                    fn,
                    f"mask has shape {mask.shape}, but x has shape {x.shape}: the mask must cover the leading "
                    f"dimensions of x.shape[:-1] = {positions}.",
                    fix=f"pass a mask of shape {positions[:1]} (rows) or {positions} (tokens), True or 1 where real.",
                )
            )
        given = mask if mask.dtype == jnp.bool_ else mask != 0
        given = jnp.broadcast_to(given.reshape(mask.shape + (1,) * (len(positions) - mask.ndim)), positions)
    found = real_rows()
    if found is None:
        return given
    rows = None if isinstance(found, Unknown) else found
    if rows is None or positions[:1] != rows.shape:
        if given is not None:
            return given
        raise SpmdError(
            describe(
                fn,
                f"the step's batch is masked (padding rows), but this layer's input {x.shape} does not hold the "
                "batch's rows on dimension 0"
                + ("" if rows is None else f" ({rows.shape[0]} rows)")
                + ", so the layer cannot tell which of its tokens are padding, and routing them would change the "
                "capacity, the losses and the counts.",
                fix="pass the layer mask=, True where a token is real (e.g. the batch's mask or token weights, "
                "reshaped as you reshaped the rows), or keep the rows on dimension 0.",
            )
        )
    step = jnp.broadcast_to(rows.reshape(rows.shape + (1,) * (len(positions) - 1)), positions)
    return step if given is None else step & given


def stacked_boxes(fn: str, created: Any) -> Any:
    """The stacked experts' leaves ``[E, ...]`` boxed with the logical name ``"expert"`` on dimension 0 (which the
    state maps to its expert axis, or keeps whole without one), after the expert's own logical names."""

    def box(leaf: Any) -> Any:
        if isinstance(leaf, nn.LogicallyPartitioned):
            return leaf.replace(names=(EXPERT, *leaf.names))
        if isinstance(leaf, meta.AxisMetadata):
            raise SpmdError(
                describe(
                    fn,
                    f"an expert parameter is boxed with {type(leaf).__name__} (mesh axes {getattr(leaf, 'names', '?')}"
                    "); the stacked experts take logical names only.",
                    fix="give the expert's parameters logical names (nn.with_logical_partitioning(init, ('embed', "
                    "'mlp'))) and map them with logical_axis_rules, e.g. [('mlp', 'model'), ('embed', None)].",
                )
            )
        return nn.LogicallyPartitioned(leaf, (EXPERT,) + (None,) * (leaf.ndim - 1))

    return jax.tree.map(box, created, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


#: Expert parallelism's entry of the registry (:mod:`spmdcomm.parallel.registry`): a mesh axis named ``"expert"``
#: (or ``expert=ExpertParallel(axis=...)``) splits the batch's rows as a data axis and owns the stacked experts,
#: placed there by their logical name; the MoE layers read the axes from the context the steps install.
PARALLELISM = Parallelism(
    role="expert",
    keyword="expert",
    config=ExpertParallel,
    axis_words="the expert axis",
    example="sc.ExpertParallel()",
    by_name="expert",
    stacks=True,
    logical=EXPERT,
    step_context=expert_split,
    explain=expert_report,
)


def _check_held(held: int, experts: int, axis: str | None) -> None:
    """:class:`ShapeError` unless this device holds ``experts / n`` of the stacked experts."""
    n = 1 if axis is None else lax.axis_size(axis)
    if held * n != experts:
        where = "on one device" if axis is None else f"on each of the {n} devices of expert axis {axis!r}"
        raise ShapeError(
            describe(
                "MoE",
                f"the stacked expert parameters hold {held} experts {where} ({held * n} in all), but "
                f"experts={experts}.",
                fix="split dimension 0 of every 'experts' leaf over the expert axis (P(axis_name)), and pass the "
                "parameters of a layer with the same number of experts.",
            )
        )
