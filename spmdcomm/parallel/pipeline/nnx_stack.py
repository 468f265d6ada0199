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
    What the blocks sow under ``nnx.capture`` (a :class:`~spmdcomm.nnx.MoE` layer's losses and counts) comes out in
    the capture, under the block's paths below ``layers``, each value ``[L, m, ...]``: per layer and per micro-batch
    (``m = 1`` outside a pipeline; ``[L, 1, ...]`` per micro-batch under the table schedules), as the Linen
    :class:`~spmdcomm.PipelineStack` hands out its block's collections::

        y, found = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, x)
        (per_layer,) = found["stack"]["layers"]["moe"]["load_balancing_loss"].get_value()  # [L, m]

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

        Under ``nnx.capture``, what the blocks sow (``self.sow(nnx.Intermediate, ...)``, a MoE layer's statistics)
        is handed out where the capture finds it, under each block module's path below ``layers``: each value the
        block sowed in one call is stacked ``[L, m, ...]``, per layer (canonical order) and per micro-batch (``m = 1``
        outside a pipeline, where the stack is a scan over the whole batch), gathered over the stage axis; a second
        call under the same capture adds a second entry to the tuple, as a block called twice would. Under the table
        schedules each call of the loss sees its micro-batch's values, ``[L, 1, ...]``. Without a capture nothing is
        collected.

        Args:
          x: the input, one example per row of dimension 0.
          *args: passed to every block call.

        Returns:
          The last block's output.
        """
        # The Variable types an enclosing nnx.capture collects; its stores stay out of the blocks' state.
        kinds = tuple(type(v) for v in getattr(self, _CAPTURES, ()))
        stores = _take_captures(self.layers)
        try:
            graphdef, params = nnx.graphdef(self.layers), nnx.state(self.layers, nnx.Param)
            others = nnx.Not(nnx.Param)  # BatchStat and any other state of the blocks
            state = nnx.state(self.layers, others)
        finally:
            _put_captures(stores)

        def layer(layer_params: Any, layer_state: Any, h: jax.Array, index: jax.Array, row: jax.Array) -> Any:
            block = nnx.merge(graphdef, layer_params, layer_state[_STATE])
            if not kinds:
                return block(h, *args), {_STATE: nnx.state(block, others)}
            out, *found = nnx.capture(lambda b, h: b(h, *args), *kinds)(block, h)
            # Each kind the block sowed is a collection of its own: the schedule stacks it [L, m, ...].
            sown = {kind.__name__: f for kind, f in zip(kinds, found, strict=True) if jax.tree.leaves(f)}
            return out, {_STATE: nnx.state(block, others), **sown}

        out, new_state = run_stack(layer, params, x, state={_STATE: state}, remat=False)
        nnx.update(self.layers, new_state[_STATE])
        _hand_out(self.layers, {kind: new_state[kind.__name__] for kind in kinds if kind.__name__ in new_state})
        return out


#: The key of the blocks' own state (BatchStat) among the collections a layer of the stack returns.
_STATE = "state"
#: The attribute ``nnx.capture`` keeps a module's stores in (one Variable per type it collects) while it runs.
_CAPTURES = "__captures__"


def _take_captures(layers: nnx.Module) -> list[tuple[nnx.Module, Any]]:
    """Removes the stores an enclosing ``nnx.capture`` put on the block's modules, which the block's state must not
    carry; returns them for :func:`_put_captures`."""
    taken = []
    for _, module in nnx.iter_modules(layers):
        if hasattr(module, _CAPTURES):
            taken.append((module, getattr(module, _CAPTURES)))
            delattr(module, _CAPTURES)
    return taken


def _put_captures(taken: list[tuple[nnx.Module, Any]]) -> None:
    for module, stores in taken:
        setattr(module, _CAPTURES, nnx.data(stores))


def _hand_out(layers: nnx.Module, found: dict[Any, Any]) -> None:
    """Puts what the blocks sowed (``{kind: State}``, paths relative to the block, values ``[L, m, ...]``) into the
    enclosing capture's stores of the modules at those paths, as their own ``sow`` would (a tuple gains entries)."""
    modules = dict(nnx.iter_modules(layers))
    for kind, state in found.items():
        for path, variable in nnx.to_flat_state(state):
            stores: tuple[Any, ...] = getattr(modules[tuple(path[:-1])], _CAPTURES, ())
            for store in stores:
                if type(store) is kind:
                    name, value = path[-1], variable.get_value()
                    before = store[name] if name in store else None
                    both = isinstance(before, tuple) and isinstance(value, tuple)
                    store[name] = before + value if both else value


# nnx.Module's metaclass hides __init__'s signature from inspect and help() (they see (*args, **kwargs)).
PipelineStack.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(PipelineStack.__init__).parameters.values())[1:]
)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)
