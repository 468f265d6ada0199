"""The Flax NNX layer stack: the NNX twin of :class:`spmdcomm.PipelineStack` (:mod:`spmdcomm.parallel.pipeline`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from spmdcomm.parallel.pipeline.schedule import run_stack

__all__ = ["PipelineStack"]


class PipelineStack(nnx.Module):
    """``layers`` blocks made by ``make_block``, applied in turn, their parameters stacked ``[layers, ...]``.

    The blocks are created under ``nnx.vmap`` (each from its own keys: ``nnx.split_rngs``), so every ``nnx.Param`` of
    ``self.layers`` has the layers on dimension 0, marked (``pipeline_stacked`` metadata) for
    ``TrainState.create_nnx``: split over the stage axis of a state with a :class:`~spmdcomm.Pipeline`, whole
    otherwise. A call runs the blocks as a scan, or as the state's pipeline inside its train and eval steps. A block
    must map an array to one of its shape, one example per row, and hold no RNG streams (keep dropout outside the
    stack). Its other state (``nnx.BatchNorm``'s ``BatchStat``) is stacked too and stays whole on every device; in a
    pipeline it updates once per micro-batch, in order, never in a bubble, as one device with ``accum_steps=m``.

    Args:
      make_block: ``make_block(rngs) -> nnx.Module``, called once under ``nnx.vmap``.
      layers: how many blocks, ``L``.
      rngs: the ``nnx.Rngs`` the blocks are initialised from.

    Raises:
      ValueError: when a block holds RNG streams.

    Examples:
      >>> from flax import nnx
      >>> stack = sc.nnx.PipelineStack(lambda rngs: nnx.Linear(4, 4, rngs=rngs), layers=3, rngs=nnx.Rngs(0))
      >>> stack.layers.kernel[...].shape, stack(jnp.ones((2, 4))).shape
      ((3, 4, 4), (2, 4))
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], layers: int, *, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> nnx.Module:
            return make_block(rngs)

        self.layers = create(rngs)
        streams = nnx.state(self.layers, nnx.RngState)
        if jax.tree.leaves(streams):
            raise ValueError(
                "spmdcomm.nnx.PipelineStack: the block holds RNG streams "
                f"({sorted({type(v).__name__ for v in jax.tree.leaves(streams, is_leaf=_is_variable)})}); a "
                "stacked block must not draw from its own streams, whose counts a pipeline would advance per stage. "
                "Keep dropout (and its nnx.Rngs) outside the stack."
            )
        for _, variable in nnx.iter_graph(self.layers):
            if isinstance(variable, nnx.Param):
                variable.set_metadata(pipeline_stacked=True)

    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        """Applies the blocks to ``x`` (rows first) and returns an array of ``x``'s shape.

        Args:
          x: the input, one example per row of dimension 0.
          *args: passed to every block call.

        Returns:
          The last block's output.
        """
        graphdef, params = nnx.graphdef(self.layers), nnx.state(self.layers, nnx.Param)
        others = nnx.Not(nnx.Param)  # BatchStat and any other state of the blocks

        def layer(layer_params: Any, layer_state: Any, h: jax.Array, index: jax.Array, row: jax.Array) -> Any:
            block = nnx.merge(graphdef, layer_params, layer_state)
            out = block(h, *args)
            return out, nnx.state(block, others)

        state = nnx.state(self.layers, others)

        out, new_state = run_stack(layer, params, x, state=state, remat=False)
        nnx.update(self.layers, new_state)
        return out


# nnx.Module's metaclass hides __init__'s signature from inspect and help() (they see (*args, **kwargs)).
PipelineStack.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(PipelineStack.__init__).parameters.values())[1:]
)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)
