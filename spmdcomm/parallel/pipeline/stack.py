"""A Flax Linen layer stack that runs as a plain scan, or as a pipeline over a stage axis inside the steps of a
state with a :class:`~spmdcomm.Pipeline` (:mod:`spmdcomm.parallel.pipeline.pipeline`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax.core import meta

from spmdcomm.parallel.pipeline.schedule import run_stack
from spmdcomm.parallel.rng import sub_block_key

__all__ = ["PipelineStack", "StageStacked", "StageStackedLogical", "Stacked"]


class StageStacked(meta.Partitioned):
    """The partitioning box of a stacked layer parameter: dimension 0 holds the layers, split over the state's
    stage axis when it has a :class:`~spmdcomm.Pipeline` and whole otherwise; the other names are the block's own
    (model axes)."""


class StageStackedLogical(nn.LogicallyPartitioned):
    """As :class:`StageStacked`, for a block whose parameters have logical names (``nn.with_logical_partitioning``):
    the other names are mapped by the rules."""


class Stacked:
    """A parameter spec entry for a pipeline's stacked layers (``TrainState.create`` reads it from the boxes above
    and from NNX ``pipeline_stacked`` metadata): dimension 0 on the state's stage axis (whole without a pipeline),
    the other dimensions as ``rest`` says (a ``PartitionSpec``, or logical names to map by the rules)."""

    def __init__(self, rest: Any) -> None:
        self.rest = rest


class PipelineStack(nn.Module):
    """``layers`` copies of ``block`` applied in turn, their parameters stacked ``[layers, ...]``.

    ``h = block_l(h, *args)`` for ``l = 0 .. layers - 1``; the parameters live under ``"layers"`` in the shape
    ``nn.scan`` gives, each layer initialised from its own key. Outside a train or eval step, and in the steps of a
    state without a pipeline, the stack is a ``lax.scan`` over the layers. In the steps of a state created with
    ``pipeline=sc.Pipeline(...)`` on a mesh with the stage axis, each stage holds its share of the layers and the
    batch flows through the stages in micro-batches (:mod:`spmdcomm.parallel.pipeline`); the result is the scan's.
    ``block`` must map an array to one of its shape, one example per row of dimension 0, and may use the
    ``"dropout"`` RNG stream, keyed by layer and example (with ``rng="per_example"`` the masks are one device's,
    whatever the stages). Its other collections (BatchNorm's ``batch_stats``) are stacked ``[layers, ...]`` beside
    the parameters, whole on every device; in a pipeline a BatchNorm normalises each micro-batch by its own
    statistics and updates the running ones once per micro-batch, in order, never in a bubble: the result equals
    one device with ``accum_steps=m`` (GPipe's rule; ``docs/pipeline.md``). What the block sows into a collection
    the caller makes mutable (a MoE layer's losses into ``"moe"``) comes out under the stack's ``"layers"``, each
    value ``[L, m, ...]``: per layer and per micro-batch (``m = 1`` outside a pipeline;
    ``[L, 1, ...]`` per call of the loss under the table schedules, which run it once per micro-batch).

    Attributes:
      block: the layer, an unbound Flax module (e.g. ``Block(width=256)``), called as ``block(h, *args)``.
      layers: how many layers, ``L``.
      remat: rematerialise each layer in the backward pass of the plain scan (the pipeline has its own setting).
      parent: Flax's module parent.
      name: Flax's module name (unnamed, it is auto-named ``PipelineStack_0``, ...).

    Examples:
      >>> stack = sc.PipelineStack(nn.Dense(4), layers=3)
      >>> variables = stack.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> variables["params"]["layers"]["kernel"].value.shape, stack.apply(variables, jnp.ones((2, 4))).shape
      ((3, 4, 4), (2, 4))
    """

    block: nn.Module
    layers: int
    remat: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        """Applies the ``layers`` blocks to ``x`` (rows first) and returns an array of ``x``'s shape.

        Args:
          x: the input, one example per row of dimension 0.
          *args: passed to every block call (flags; not per-row arrays, which a pipeline cannot cut into
            micro-batches).

        Returns:
          The last block's output.
        """
        block = self.block.clone(parent=None)
        if not self.has_variable("params", "layers"):
            # Every collection the block creates (params, batch_stats) from one vmapped init, stacked [L, ...].
            created = _stacked_init(block, self.layers)(self.make_rng("params"), x, *args)
            self.param("layers", lambda _: created["params"])
            for collection in sorted(c for c in created if c != "params"):
                self.variable(collection, "layers", lambda c=collection: created[c])
        # Read without Flax's shape check: inside a pipeline this stage holds L / p of the layers.
        params = meta.unbox(self.get_variable("params", "layers"))
        held = sorted(c for c, v in self.variables.items() if c != "params" and "layers" in v)
        state: dict[str, Any] = {c: self.get_variable(c, "layers") for c in held}
        initializing = self.is_initializing()
        mutable = [c for c in held if initializing or self.is_mutable_collection(c)]
        rng = self.make_rng("dropout") if self.has_rng("dropout") else None
        sown = lambda c: c != "params" and self.is_mutable_collection(c)

        def layer(layer_params: Any, layer_state: Any, h: jax.Array, index: jax.Array, row: jax.Array) -> Any:
            # Keyed by layer and example, not by stage or micro-batch: a per-example key draws one device's bits.
            key = None if rng is None else sub_block_key(jax.random.fold_in(rng, index), shift=row, rows=h.shape[0])
            rngs = {} if key is None else {"dropout": key}
            variables = {"params": layer_params, **layer_state}
            if initializing:
                out, updated = block.apply(variables, h, *args, rngs=rngs, mutable=mutable)
                return out, {**layer_state, **updated}
            # Every collection, to hand on what the block sows (a MoE layer's losses) where the caller asked for it.
            out, updated = block.apply(variables, h, *args, rngs=rngs, mutable=True)
            kept = {c: v for c, v in updated.items() if c in mutable or (c not in held and sown(c))}
            return out, {**layer_state, **kept}

        out, new_state = run_stack(layer, params, x, state=state, remat=self.remat)
        # While initialising, the state keeps its initial values (Flax's BatchNorm does not update them either).
        for collection in [] if initializing else sorted(new_state):
            if collection in mutable or collection not in held:
                self.put_variable(collection, "layers", new_state[collection])
        return out


def _stacked_init(block: nn.Module, layers: int) -> Any:
    """The initializer of the stacked variables: ``block.init`` under ``vmap`` over ``layers`` keys, every collection
    stacked ``[layers, ...]``; each parameter boxed as :class:`StageStacked` (dimension 0 the layers, then the block's
    own partitioning names). Other collections (BatchNorm's ``batch_stats``) stay whole on every device."""

    def init(rng: jax.Array, x: jax.Array, *args: Any) -> Any:
        # A block with dropout draws while it initialises too: it gets a stream of its own.
        init_one = lambda key: block.init({"params": key, "dropout": jax.random.fold_in(key, 1)}, x, *args)
        variables = dict(jax.vmap(init_one)(jax.random.split(rng, layers)))

        def box(leaf: Any) -> Any:
            if isinstance(leaf, nn.LogicallyPartitioned):
                return StageStackedLogical(leaf.value, names=("stage", *leaf.names), rules=leaf.rules)
            if isinstance(leaf, meta.Partitioned):
                return StageStacked(leaf.value, names=("stage", *leaf.names))
            return StageStacked(leaf, names=("stage",) + (None,) * (leaf.ndim - 1))

        params = jax.tree.map(box, variables["params"], is_leaf=lambda v: isinstance(v, meta.Partitioned))
        return {**variables, "params": params}

    return init
