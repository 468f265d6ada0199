"""The Flax NNX layer stack: the NNX twin of :class:`spmdcomm.PipelineStack` (:mod:`spmdcomm.train.pipeline`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from spmdcomm.train.pipeline import run_stack

__all__ = ["PipelineStack"]


class PipelineStack(nnx.Module):
    """``layers`` blocks made by ``make_block``, applied in turn, their parameters stacked ``[layers, ...]``.

    The blocks are created under ``nnx.vmap`` (each from its own keys: ``nnx.split_rngs``), so every ``nnx.Param`` of
    ``self.layers`` has the layers on dimension 0, marked (``pipeline_stacked`` metadata) for
    ``TrainState.create_nnx``: split over the stage axis of a state with a :class:`~spmdcomm.Pipeline`, whole
    otherwise. A call runs the blocks as a scan, or as the state's pipeline inside its train and eval steps. A block
    must map an array to one of its shape, one example per row, and hold parameters only (no ``BatchStat``, no RNG
    streams: the stack refuses others).

    Args:
      make_block: ``make_block(rngs) -> nnx.Module``, called once under ``nnx.vmap``.
      layers: how many blocks, ``L``.
      rngs: the ``nnx.Rngs`` the blocks are initialised from.

    Raises:
      ValueError: when a block holds state other than ``nnx.Param``.

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
        _, rest = nnx.state(self.layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(
                "spmdcomm.nnx.PipelineStack: the block holds state other than nnx.Param "
                f"({sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_variable)})}); a stacked "
                "block must hold parameters only. Use LayerNorm or RMSNorm instead of BatchNorm, and keep RNG "
                "streams (dropout) outside the stack."
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
        graphdef, params = nnx.split(self.layers, nnx.Param)

        def layer(layer_params: Any, h: jax.Array, index: jax.Array, row: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, layer_params)(h, *args)

        return run_stack(layer, params, x, remat=False)


# nnx.Module's metaclass hides __init__'s signature from inspect and help() (they see (*args, **kwargs)).
PipelineStack.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(PipelineStack.__init__).parameters.values())[1:]
)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)
