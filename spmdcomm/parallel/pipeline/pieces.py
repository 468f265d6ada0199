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

from spmdcomm._jax_compat import outputs_depending_on
from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.pipeline.schedule import LayerFn, check_model_state
from spmdcomm.parallel.real_rows import real_rows

__all__ = ["OutsideState", "Post", "stack_piece", "traced_piece"]

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
        # A tag added to the output shows which of the loss's results depend on it (OutsideState).
        return x + piece["tag"] if "tag" in piece else x, {**state, **stand_in}
    # The loop carries integer values (an expert's token counts) as floats: each back to its own dtype.
    return piece.h, {**state, **jax.tree.map(lambda a, like: a.astype(like.dtype), piece.sown, piece.like)}


class Post(NamedTuple):
    """What the stack returns in a post piece: the pipeline's output and what its layers sowed for the micro-batch,
    ``[L, 1, ...]``."""

    h: jax.Array
    sown: dict[str, Any]
    like: dict[str, Any]


class OutsideState(NamedTuple):
    """The model state a table schedule's loop threads outside the stack's (BatchNorm in the embedding or the head).

    The layers before the stack run at the input events (one micro-batch each, in micro-batch order), the layers
    after it at the loss events (in order too): the leaves each side updates, ``before`` and ``after`` (indices into
    the model state's leaves), move on there, from the device that holds the micro-batch's rows, as one device's
    micro-batches would move them one after another. A leaf the layers after the stack update is an ``after`` leaf
    even if the layers before update it too (the post piece runs both, in that order)."""

    treedef: Any
    given: list[Any]
    stack: list[int | None]  # per leaf: its index among the stack's state leaves, or None
    before: tuple[int, ...]
    after: tuple[int, ...]

    @staticmethod
    def trace(
        given: Any, pre: tuple[Any, Any], post: Any, stack_state: Any, x: jax.Array, schedule: str
    ) -> tuple[OutsideState, Any]:
        """From the model state ``given`` to the loss; ``pre``: the model state the pre piece returned, and the pre
        piece as ``f(tag) -> model state`` (``tag`` added to the stack's output ``x``); ``post() -> (metrics, model
        state)``: the post piece; the stack's state. Returns the threaded leaves and the metrics' shapes."""
        returned: list[Any] = []

        def metrics() -> Any:
            out, new_state = post()
            returned.append(new_state)
            return out

        shapes = jax.eval_shape(metrics)
        # Which of the pre piece's returned leaves depend on the stack's output: the layers after it update those.
        after_stack = outputs_depending_on(lambda t: jax.tree.leaves(pre[1](t)), x)
        return OutsideState._of(given, pre[0], returned[0], stack_state, after_stack, schedule), shapes

    @staticmethod
    def _of(given: Any, pre: Any, post: Any, stack_state: Any, after_stack: list[bool], schedule: str) -> OutsideState:
        leaves, treedef = jax.tree.flatten(given)
        pre_leaves, post_leaves = jax.tree.leaves(pre), jax.tree.leaves(post)
        check_model_state(given, pre)
        check_model_state(given, post)
        in_stack = {id(a): i for i, a in enumerate(jax.tree.leaves(stack_state))}
        stack = [in_stack.get(id(a)) for a in pre_leaves]
        outside = [i for i, w in enumerate(stack) if w is None]
        before = tuple(i for i in outside if pre_leaves[i] is not leaves[i] and not after_stack[i])
        after = tuple(i for i in outside if post_leaves[i] is not leaves[i] and after_stack[i])
        odd = [i for i in before + after if not jnp.issubdtype(leaves[i].dtype, jnp.number)]
        if odd:
            paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(given)[0]]
            raise SpmdError(
                describe(
                    "make_train_step",
                    f"loss_fn updates model state leaves that are not numbers ({', '.join(paths[i] for i in odd[:3])}) "
                    f"outside the PipelineStack under schedule={schedule!r}, which moves such state between stages.",
                    fix="keep that state in the stack (sc.PipelineStack) or use schedule='gpipe'.",
                )
            )
        return OutsideState(treedef, leaves, stack, before, after)

    def take(self, tree: Any, which: tuple[int, ...]) -> list[Any]:
        leaves = jax.tree.leaves(tree)
        return [leaves[i] for i in which]

    def build(self, before: list[Any], after: list[Any] | None = None, stack_state: Any = None) -> Any:
        """The model state: the given leaves, with ``before``, ``after`` and the stack's state (those given) in
        place."""
        leaves = list(self.given)
        for which, values in ((self.before, before), (self.after, after)):
            for i, a in zip(which, [] if values is None else values, strict=values is not None):
                leaves[i] = a
        if stack_state is not None:
            fresh = jax.tree.leaves(stack_state)
            leaves = [a if w is None else fresh[w] for a, w in zip(leaves, self.stack, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)
