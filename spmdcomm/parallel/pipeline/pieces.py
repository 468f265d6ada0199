"""What the user's loss does around a table schedule's loop (:mod:`spmdcomm.parallel.pipeline.one_f_one_b`): the
loop runs the loss on one micro-batch part in two *pieces*, and the stack inside it plays its part in each. Run in
the *pre* piece, the stack hands over its input, parameters, layer function and state, and returns its input (what
follows it is unused, and compiled away); run in the *post* piece, it returns the output the pipeline computed and
what its layers sowed for the micro-batch."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.pipeline.schedule import LayerFn
from spmdcomm.parallel.real_rows import real_rows

__all__ = ["Post", "stack_piece", "state_rebuilder", "traced_piece"]

#: The piece being traced: None (no 1F1B loop: the stack runs as GPipe), a dict (pre: the stack puts what it was
#: given there), or the stack's output (post).
_PIECE: contextvars.ContextVar[Any] = contextvars.ContextVar("spmdcomm_1f1b_piece", default=None)


@contextlib.contextmanager
def traced_piece(piece: Any) -> Iterator[None]:
    """Traces the loss in a piece: ``piece`` a dict (pre: the stack fills it) or a :class:`Post`."""
    token = _PIECE.set(piece)
    try:
        yield
    finally:
        _PIECE.reset(token)


def stack_piece(layer_fn: LayerFn, params: Any, state: Any, x: jax.Array) -> tuple[jax.Array, Any] | None:
    """What a 1F1B pipeline's stack does in the piece being traced: ``None`` outside the 1F1B loop (the eval step:
    the stack runs as GPipe); in a pre piece it hands over what it was given and returns its input (what follows
    the stack is then unused, and compiled away); in a post piece it returns the output the pipeline computed."""
    piece = _PIECE.get()
    if piece is None:
        return None
    if isinstance(piece, dict):
        # What the block sows (a MoE layer's losses): what one layer returns beyond its state. The loss sees it
        # per micro-batch, [L, 1, ...]; in the pre piece, zeros of that shape (what follows the stack is unused).
        first_params, first_state = jax.tree.map(lambda a: a[0], (params, state))
        _, out = jax.eval_shape(lambda p, st, h: layer_fn(p, st, h, jnp.int32(0), 0), first_params, first_state, x)
        sown = sorted(set(out) - set(state))
        layers = jax.tree.leaves(params)[0].shape[0] * piece["stages"]
        stand_in = jax.tree.map(lambda a: jnp.zeros((layers, 1, *a.shape), a.dtype), {c: out[c] for c in sown})
        piece.update(layer_fn=layer_fn, params=params, state=state, x=x, sown=sown, rows=real_rows(), like=stand_in)
        return x, {**state, **stand_in}
    # The loop carries integer values (an expert's token counts) as floats: each back to its own dtype.
    return piece.h, {**state, **jax.tree.map(lambda a, like: a.astype(like.dtype), piece.sown, piece.like)}


class Post(NamedTuple):
    """What the stack returns in a post piece: the pipeline's output and what its layers sowed for the micro-batch,
    ``[L, 1, ...]``."""

    h: jax.Array
    sown: dict[str, Any]
    like: dict[str, Any]


def state_rebuilder(given: Any, returned: Any, stack_state: Any, schedule: str) -> Any:
    """``f(new stack state) -> model state``: the tree the loss returns (``returned``, from ``given``) with the stack's
    state in it replaced. Raises :class:`SpmdError` when the loss changes the model state outside the stack: the
    layers before and after the stack run once per micro-batch, at units of their own, where GPipe runs them once on
    the device's rows, so their statistics would be other numbers."""
    stack = {id(a): i for i, a in enumerate(jax.tree.leaves(stack_state))}
    leaves, treedef = jax.tree.flatten(returned)
    before = jax.tree.leaves(given)
    where = [stack.get(id(a)) for a in leaves]
    moved = [
        i for i, (a, w) in enumerate(zip(leaves, where, strict=True)) if w is None and not any(a is b for b in before)
    ]
    if moved:
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(returned)[0]]
        raise SpmdError(
            describe(
                "make_train_step",
                f"loss_fn updates the model state outside the PipelineStack ({', '.join(paths[i] for i in moved[:3])}) "
                f"under schedule={schedule!r}: this schedule runs the layers before and after the stack once per "
                "micro-batch, at different units of its loop, where GPipe runs them once on the device's rows, so a "
                "BatchNorm there would normalise by other statistics.",
                fix="move the layers with state into the stack (sc.PipelineStack), or use schedule='gpipe'.",
            )
        )

    def rebuild(new: Any) -> Any:
        fresh = jax.tree.leaves(new)
        return jax.tree.unflatten(treedef, [a if w is None else fresh[w] for a, w in zip(leaves, where, strict=True)])

    return rebuild
