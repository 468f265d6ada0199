"""Fully sharded data parallelism: :class:`FSDP`, the strategy that splits the parameters too.

Its place among the strategies, and what they share: :mod:`spmdcomm.parallel.data.strategies`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from spmdcomm.errors import SpmdError, describe
from spmdcomm.parallel.data.layout import TreeLayout, manual_spec
from spmdcomm.parallel.data.strategy import ReduceContext, Strategy, psum_whole

__all__ = ["FSDP"]


@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    """Fully sharded data parallelism (torch FSDP2 ``fully_shard``, ZeRO stage 3).

    Parameters, gradients and optimizer state are split per leaf over the data axis; ``state.params`` is the
    model's tree of sharded arrays. The step all-gathers each split leaf for the forward pass; the backward pass
    (the transpose of that all-gather) reduce-scatters each gradient straight into blocks; the optimizer updates
    the blocks in the global view. :meth:`TrainState.full_params <spmdcomm.TrainState.full_params>` gathers the
    whole tree.

    XLA:CPU in jax 0.10 merges the backward pass's second gathers with the first (it drops the rematerialisation
    barrier before its common-subexpression pass), so on CPU both values of ``reshard_after_forward`` compile alike.

    Args:
      reshard_after_forward: ``True`` (default, as torch's): the gathered parameters are not kept for the backward
        pass, which gathers again each one it needs (a ``jax.checkpoint`` policy that keeps every computed value,
        the activations, and drops only what was moved: gathers and the reshapes and casts after them; no layer
        is recomputed). ``False`` keeps the gathered parameters from the forward to the backward pass (one
        all-gather per leaf instead of up to two).
      param_dtype: ``None`` (default) computes with the parameters' own dtype. A float dtype (e.g.
        ``jnp.bfloat16``): the model computes with low-precision copies of the gathered parameters while the
        blocks, the gradients and the optimizer stay float32 (torch's ``MixedPrecisionPolicy(param_dtype=...)``):
        the blocks are gathered in ``param_dtype`` (half the bytes for bfloat16) and the gradients
        reduce-scattered in it, or in the step's ``reduce_dtype`` when given.

    Raises:
      SpmdError: when ``param_dtype`` is not a float dtype.

    Examples:
      >>> sc.FSDP(param_dtype=jnp.bfloat16)
      FSDP(reshard_after_forward=True, param_dtype=dtype(bfloat16))
    """

    name: ClassVar[str] = "fsdp"
    shards_params: ClassVar[bool] = True
    shards_optimizer: ClassVar[bool] = True
    reshard_after_forward: bool = True
    param_dtype: Any = None

    def __post_init__(self) -> None:
        if self.param_dtype is not None:
            dtype = jnp.dtype(self.param_dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise SpmdError(
                    describe("FSDP", f"param_dtype={dtype} is not a float dtype.", fix="pass e.g. jnp.bfloat16.")
                )
            object.__setattr__(self, "param_dtype", dtype)

    @property
    def remat_policy(self) -> Any:
        # Only the gathered parameters are dropped after the forward pass (torch's resharding): activations are
        # kept, so the backward pass gathers again but recomputes no layer.
        return _keep_computed_values if self.reshard_after_forward else None

    def full_params(self, layout: TreeLayout, mesh: Mesh, params: Any) -> Any:
        model_axes = tuple(a for a in mesh.axis_names if a not in layout.axes)
        whole = [NamedSharding(mesh, manual_spec(s, model_axes)) for s in layout.param_leaf_specs]
        cut = jax.jit(
            lambda p: layout.unpadded(p, "params", mesh), out_shardings=jax.tree.unflatten(layout.treedef, whole)
        )
        return cut(params)

    def compute_params(self, ctx: ReduceContext, layout: TreeLayout, params: Any) -> Any:
        # Split leaves are gathered in the compute dtype; the backward pass reduce-scatters their gradient in the
        # step's reduce_dtype (else the compute dtype). Replicated leaves are cast to the compute dtype here.
        whole = layout.gather_params(params, self.param_dtype, ctx.reduce_dtype)
        if self.param_dtype is not None:
            leaves = jax.tree.leaves(whole)
            leaves = [
                x if split or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(self.param_dtype)
                for x, split in zip(leaves, layout.is_split("params"), strict=True)
            ]
            whole = jax.tree.unflatten(layout.treedef, leaves)
        return whole

    def reduce(self, ctx: ReduceContext, layout: TreeLayout, grads: Any, stats: jax.Array) -> tuple[jax.Array, Any]:
        return psum_whole(ctx, layout, grads, stats, across_replicas=True)


# --------------------------------------------------------------------------------------------------


def _keep_computed_values(prim: Any, *args: Any, **params: Any) -> bool:
    """A ``jax.checkpoint`` policy that keeps what the forward pass computed (activations) and drops what it only
    moved: gathers and the reshapes, slices, casts and transposes between a gather and its use. The backward pass
    then gathers each parameter again instead of keeping it (naming the gathered values is not enough: the
    policy would keep the reshape they were named from)."""
    return prim.name not in _MOVED


_MOVED = frozenset(
    {
        "all_gather",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "reshape",
        "transpose",
        "slice",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "concatenate",
        "copy",
        "copy_p",
        "name",
        "pvary",
        "pcast",
    }
)
