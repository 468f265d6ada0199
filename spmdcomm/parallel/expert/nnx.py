"""The Flax NNX mixture-of-experts layer: the NNX twin of :class:`spmdcomm.MoE` (:mod:`spmdcomm.parallel.expert`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from spmdcomm.collectives.ragged import RaggedImplementation
from spmdcomm.parallel.expert.layer import EXPERT, moe_rows, step_split, token_mask
from spmdcomm.parallel.expert.routing import Experts, RoutingName, check_routing

__all__ = ["MoE"]

#: The router kernel's default initializer (the Linen layer's): normal, standard deviation 0.02.
ROUTER_INIT = nnx.initializers.normal(0.02)


class MoE(nnx.Module):
    """A mixture-of-experts layer: a router choosing ``k`` of ``experts`` blocks made by ``make_expert`` per token.

    ``y[t] = sum_r w[t, r] * expert_{e[t, r]}(x[t])`` over the last dimension of ``x``, as :class:`spmdcomm.MoE`.
    The router is ``self.router``, an ``nnx.Param`` ``[features, E]`` (float32 math); the experts are created under
    ``nnx.vmap`` (each from its own keys), so every ``nnx.Param`` of ``self.experts`` has the experts on dimension 0,
    named ``"expert"`` in its ``out_sharding`` metadata (before the expert's own names). In the steps of a
    ``TrainState.create_nnx`` state with an expert axis (:class:`~spmdcomm.ExpertParallel`) the layer takes its axes
    from the step. Elsewhere, with ``axis_name``, call it inside ``spmd``/``jax.shard_map`` with dimension 0 of
    those parameters split over that axis and the tokens split too: the result equals one device on the global
    batch. Under ``nnx.capture(nnx.Intermediate)``, each call sows its
    :class:`~spmdcomm.parallel.expert.MoEStats` fields as ``nnx.Intermediate`` values named
    ``load_balancing_loss``, ``router_z_loss``, ``expert_counts`` and ``dropped_fraction`` (one entry per call):
    ``y, found = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, x)``. An expert must map
    ``[rows, features]`` to ``[rows, d_out]`` row by row and hold no RNG streams or other mutable state.

    Args:
      make_expert: ``make_expert(rngs) -> nnx.Module``, called once under ``nnx.vmap``.
      experts: ``E``, over all devices.
      features: ``d``, the last dimension of the input.
      k: experts per token (default 2).
      routing: ``"softmax_topk"`` (default) or ``"topk_softmax"``.
      capacity_factor: ``None`` (dropless, default) or the factor of the GShard/Switch capacity rule, dropping in
        one device's order on the global batch, as :class:`spmdcomm.MoE`'s (first choices first, then rows, then
        each row's positions in the original sequence order, also over a context axis).
      axis_name: the mesh axis the experts are split over, or ``None``.
      token_axes: every axis that splits the tokens, in the global batch's order (default: ``axis_name``).
      implementation: of the all-to-alls: ``"auto"``, ``"native"`` or ``"padded"``.
      router_init: the router kernel's initializer, ``init(key, (features, E), float32)`` (default: normal, 0.02).
      grouped: each local expert on the rows it received only (default), or, ``False``, on a static buffer, as
        :class:`spmdcomm.MoE`'s ``grouped``.
      rngs: the ``nnx.Rngs`` the router and experts are initialised from.

    Raises:
      SpmdError: for ``k`` outside ``[1, experts]``, an unknown routing or a capacity factor that is not positive.

    Examples:
      >>> from flax import nnx
      >>> layer = sc.nnx.MoE(lambda rngs: nnx.Linear(4, 4, rngs=rngs), experts=4, features=4, rngs=nnx.Rngs(0))
      >>> y = nnx.jit(lambda layer, x: layer(x))(layer, jnp.ones((3, 4)))  # one program, as in a train step
      >>> layer.experts.kernel[...].shape, y.shape
      ((4, 4, 4), (3, 4))
    """

    def __init__(
        self,
        make_expert: Callable[[nnx.Rngs], nnx.Module],
        experts: int,
        features: int,
        *,
        k: int = 2,
        routing: RoutingName = "softmax_topk",
        capacity_factor: float | None = None,
        axis_name: str | None = None,
        token_axes: tuple[str, ...] | None = None,
        implementation: RaggedImplementation = "auto",
        router_init: Callable[..., jax.Array] = ROUTER_INIT,
        grouped: bool = True,
        rngs: nnx.Rngs,
    ) -> None:
        check_routing("nnx.MoE", experts=experts, k=k, routing=routing, capacity_factor=capacity_factor)
        self.num_experts, self.k, self.routing, self.capacity_factor = experts, k, routing, capacity_factor
        self.axis_name, self.token_axes, self.implementation = axis_name, token_axes, implementation
        self.grouped = grouped
        self.router = nnx.Param(router_init(rngs.params(), (features, experts), jnp.float32))

        @nnx.split_rngs(splits=experts)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> nnx.Module:
            return make_expert(rngs)

        self.experts = create(rngs)
        for _, variable in nnx.iter_graph(self.experts):
            if isinstance(variable, nnx.Param):
                # Dimension 0 named for the state's rule to the expert axis, before the expert's own names.
                own = variable.get_metadata().get("out_sharding") or (None,) * (variable[...].ndim - 1)
                variable.set_metadata(out_sharding=(EXPERT, *own))

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Routes every real position of ``x`` (features last) to its experts and returns their weighted outputs.

        Args:
          x: ``[..., features]``.
          mask: which positions are real, as for :class:`spmdcomm.MoE`: ``None``, or bool / 0-1 numbers of shape
            ``x.shape[:j]``, ``j < x.ndim``; inside a step with a masked batch, the step's row mask also applies.

        Returns:
          ``[..., d_out]``, in ``x``'s dtype; zeros at the positions that are not real.
        """
        x = jnp.asarray(x)
        graphdef, state = nnx.split(self.experts)
        one = lambda s, rows: nnx.merge(graphdef, s)(rows)
        run = Experts(state, one) if self.grouped else lambda buf: jax.vmap(one)(state, buf)
        axis, tokens, context = step_split("nnx.MoE", self.axis_name, self.token_axes)
        real = token_mask("nnx.MoE", x, mask)
        y, stats = moe_rows(
            self,
            x,
            self.router[...],
            run,
            experts=self.num_experts,
            axis=axis,
            tokens=tokens,
            mask=real,
            context=context,
        )
        # Only under nnx.capture, which collects them: a sow outside it stores them on the module (deprecated).
        if hasattr(self, "__captures__"):
            for field, value in stats._asdict().items():
                self.sow(nnx.Intermediate, field, value)
        return y


# nnx.Module's metaclass hides __init__'s signature from inspect and help() (they see (*args, **kwargs)).
MoE.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(MoE.__init__).parameters.values())[1:]
)
