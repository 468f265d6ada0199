"""The example's model and loss: a decoder-only byte-level transformer with its blocks stacked by ``stack``.

``Transformer``: a byte embedding plus learned positions, ``layers`` pre-LayerNorm blocks (causal self-attention,
MLP), a final LayerNorm and a head tied to the embedding. Only the blocks go through :func:`stack` (parameters
stacked ``[layers, ...]``, one compiled block); the embedding, head and loss stay outside it.

Every parameter names its dimensions logically (``nn.with_logical_partitioning``), and :func:`logical_axis_rules`
maps the names to the mesh: Megatron-style tensor parallelism over a ``"model"`` axis splits attention by heads
(query, key and value by their output columns, the output projection by its input rows) and the MLP by its hidden
units (first kernel by columns, second by rows), so each block's forward pass needs one all-reduce over ``model``
after attention and one after the MLP. The tied embedding and head are split by vocabulary rows (vocab-parallel):
each model device computes the logits of its bytes, and XLA all-reduces the looked-up embeddings and the
cross-entropy's max and sum over ``model``; a table whole on every model device would have every model device
compute the whole head, forward and backward. Without a ``"model"`` axis nothing is split over the model.

With ``experts`` every block's MLP is a mixture of experts (``sc.MoE``, top-k routing, dropless): each expert an MLP
of the same shape, its hidden units over ``"model"`` too; on a mesh with an ``"expert"`` axis the state splits the
experts over it and the batch too. These blocks are stacked the same way (their parameters ``[layers, ...]`` under
``"blocks"``, the experts ``[layers, experts, ...]``), a pipeline over a ``"stage"`` axis under any schedule
included; packed rows' padding is not routed. The stack hands out each layer's sown load-balancing loss per
micro-batch, and the loss adds their sum over the layers of their mean over the micro-batches
(:func:`balance_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from input_pipeline import VOCAB

import spmdcomm as sc

MODEL_AXIS = "model"  # the mesh axis of tensor parallelism
BALANCE = 0.01  # the weight of the MoE layers' load-balancing loss (Switch Transformer's)


def logical_axis_rules(mesh_axes: Sequence[str]) -> list[tuple[str, str | None]]:
    """Flax's rules from the model's logical names to the mesh's axes: heads, MLP units and the vocabulary over
    ``"model"`` when the mesh has it; everything else (and the stacked ``layers`` dimension) whole. The data axes
    are the strategy's, not the rules' (DDP replicates, FSDP splits each leaf on a dimension of its choosing)."""
    model = MODEL_AXIS if MODEL_AXIS in mesh_axes else None
    return [
        ("layers", None),
        # The tied embedding and head by vocabulary rows: whole, every model device would compute the whole head
        # (3.4% more matmul work than one device on data=4,model=2 at the default size; issue 47).
        ("vocab", model),
        ("length", None),
        ("embed", None),
        ("heads", model),
        ("kv", None),
        ("mlp", model),
    ]


def _init(names: tuple[str | None, ...], base: Callable | None = None) -> Callable:
    return nn.with_logical_partitioning(base or nn.initializers.lecun_normal(), names)


def _norm(dtype: Any, name: str) -> nn.LayerNorm:
    """A LayerNorm whose parameters are named too, so that every stacked parameter has ``"layers"`` first."""
    ones, zeros = nn.initializers.ones_init(), nn.initializers.zeros_init()
    return nn.LayerNorm(dtype=dtype, scale_init=_init(("embed",), ones), bias_init=_init(("embed",), zeros), name=name)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``, causal.

    ``x`` is ``[batch, length, width]``; the result has its shape (the contract of :func:`stack`). A ``segmented``
    block reads ``[batch, length, width + 1]``, the last channel each token's document (0 for padding), and attends
    only within documents; it passes that channel on unchanged.
    """

    width: int
    heads: int
    hidden: int  # the MLP's hidden units
    dtype: Any = jnp.float32
    attention: str = "ring"  # context parallelism's algorithm: "ring" or "all_to_all"
    segmented: bool = False  # packed rows: the segment ids ride in the last channel of x
    experts: int = 0  # > 0: the MLP is a mixture of this many experts (sc.MoE), each an MLP of `hidden` units
    top_k: int = 2  # experts per token

    @nn.compact
    def __call__(self, x):
        segments = None
        if self.segmented:
            # In the activation, not beside it: a pipeline cuts x into micro-batches and passes other per-row arrays
            # whole (sc.PipelineStack's contract). Small ints are exact in float32 and bfloat16.
            x, carried = x[..., :-1], x[..., -1:]
            segments = jnp.round(carried[..., 0]).astype(jnp.int32)
        head_dim = self.width // self.heads
        heads = (self.heads, head_dim)
        y = _norm(self.dtype, "attention_norm")(x)
        # [batch, length, heads, head_dim]; split by heads over the model axis (column-parallel).
        q, k, v = (
            Projection(heads, ("embed", "heads", "kv"), dtype=self.dtype, name=n)(y) for n in ("query", "key", "value")
        )
        # Exact over a sequence split over a context axis too (ring or all-to-all); plain attention otherwise.
        y = sc.context_attention(q, k, v, causal=True, segment_ids=segments, algorithm=self.attention)
        # Row-parallel: each model device sums over its heads, one all-reduce of the partial sums.
        x = x + Projection((self.width,), ("heads", "kv", "embed"), contract=2, dtype=self.dtype, name="out")(y)
        y = _norm(self.dtype, "mlp_norm")(x)
        if self.experts:
            # Each token through its top_k experts; on a mesh with an "expert" axis the experts are split over it.
            # Packed rows' padding (segment 0) is not routed: no capacity slot, no count, no load-balancing term.
            moe = sc.MoE(Mlp(self.hidden, self.width, self.dtype), experts=self.experts, k=self.top_k, name="moe")
            y = moe(y, None if segments is None else segments > 0)
        else:
            y = Mlp(self.hidden, self.width, self.dtype, name="mlp")(y)
        return x + y if segments is None else jnp.concatenate([x + y, carried], axis=-1)


class Mlp(nn.Module):
    """The MLP of a block, or one expert of a mixture: ``width -> hidden -> width`` with a GELU, its hidden units
    named ``"mlp"`` (split over ``"model"``)."""

    hidden: int
    width: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, y):
        zeros = nn.initializers.zeros_init()
        y = nn.Dense(
            self.hidden, kernel_init=_init(("embed", "mlp")), bias_init=_init(("mlp",), zeros), dtype=self.dtype
        )(y)
        return nn.Dense(
            self.width, kernel_init=_init(("mlp", "embed")), bias_init=_init(("embed",), zeros), dtype=self.dtype
        )(nn.gelu(y))


class Projection(nn.Module):
    """``x``'s last ``contract`` dimensions times a kernel of shape ``x.shape[-contract:] + features`` (no bias),
    whose dimensions have the logical ``names``. (Flax's ``DenseGeneral`` initialises through a flattened
    kernel, which its parameter shape check runs again inside the step, where the rules constrain a
    two-dimensional value by a three-dimensional spec.)"""

    features: tuple[int, ...]
    names: tuple[str, ...]
    contract: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        inputs = tuple(range(self.contract))
        outputs = tuple(range(self.contract, self.contract + len(self.features)))
        init = nn.initializers.lecun_normal(in_axis=inputs, out_axis=outputs)
        kernel = self.param("kernel", _init(self.names, init), x.shape[-self.contract :] + self.features)
        return jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=self.contract)


def stack(block: nn.Module, layers: int, *, name: str | None = None) -> nn.Module:
    """``layers`` copies of ``block``: ``stack(block, layers)(x)`` applies each as ``block(x)``, their parameters
    stacked ``[layers, ...]``: ``sc.PipelineStack``, a scan, or a pipeline over the state's stage axis."""
    return sc.PipelineStack(block, layers, name=name)


class Transformer(nn.Module):
    """A decoder-only byte-level language model: ``tokens`` ``int32[batch, length]`` (``length <= max_len``) to
    next-byte logits ``float32[batch, length, 256]``. ``dtype`` is the computation's; parameters are float32.

    Packed rows pass ``segments`` (each token's document, 0 for padding: attention stays inside a document) and
    ``positions`` (each token's position in its document); without them every row is one sequence."""

    width: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    max_len: int = 128
    dtype: Any = jnp.float32
    attention: str = "ring"  # context parallelism's algorithm
    experts: int = 0  # > 0: every block's MLP is a mixture of this many experts
    top_k: int = 2  # experts per token

    @nn.compact
    def __call__(self, tokens, segments=None, positions=None):
        embed = nn.Embed(
            VOCAB, self.width, embedding_init=_init(("vocab", "embed"), nn.initializers.normal(0.02)), name="embed"
        )
        table = self.param(
            "positions", _init(("length", "embed"), nn.initializers.normal(0.02)), (self.max_len, self.width)
        )
        if positions is None:
            # Every window is a sequence of its own, counted from its first token; with a context axis this device
            # holds other tokens than the first, so the positions are the global ones.
            positions = sc.context_positions(tokens.shape[1])
        x = embed(tokens).astype(self.dtype) + table[positions].astype(self.dtype)
        segmented = segments is not None
        block = Block(
            self.width,
            self.heads,
            self.mlp_ratio * self.width,
            self.dtype,
            self.attention,
            segmented,
            self.experts,
            self.top_k,
            parent=None,
        )
        if segmented:
            x = jnp.concatenate([x, segments[..., None].astype(x.dtype)], axis=-1)
        # MoE blocks too: the stack hands out what their layers sow, per layer and micro-batch (balance_loss).
        x = stack(block, self.layers, name="blocks")(x)
        x = x[..., :-1] if segmented else x
        x = _norm(self.dtype, "final_norm")(x)
        return embed.attend(x).astype(jnp.float32)  # the head is the embedding, transposed


def make_loss_fn() -> Callable:
    """spmdcomm's loss_fn contract, token-weighted: the summed next-byte cross-entropy (nats) over this device's real
    target bytes and their count, ``sc.weighted``, so that the step trains on the mean over every real byte of the
    global batch whatever bytes each device, micro-batch or context chunk holds; and the next-byte accuracy, weighted
    alike. ``batch`` holds ``"inputs"`` and ``"targets"``, ``[windows, length]`` (the targets one byte on): separate
    leaves, so that a context axis splits both the same way; packed rows add ``"segments"`` and ``"positions"``."""

    def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
        loss, right, real, balance = token_sums(apply_fn, params, batch, mask)
        # The load-balancing loss, the global batch's already, added to every real byte's loss.
        total = loss + BALANCE * balance * real
        aux = {"accuracy": sc.weighted(right, real), "balance": sc.weighted(balance * real, real)}
        return sc.weighted(total, real), aux

    return loss_fn


def make_metric_fn() -> Callable:
    """Validation loss (nats per byte) and next-byte accuracy over the real target bytes, token-weighted."""

    def metric_fn(params, batch, *, apply_fn, model_state, mask):
        loss, right, real, _ = token_sums(apply_fn, params, batch, mask)
        return {"loss": sc.weighted(loss, real), "accuracy": sc.weighted(right, real)}

    return metric_fn


def token_sums(apply_fn, params, batch, mask) -> tuple[jnp.ndarray, ...]:
    """The cross-entropy summed over the real target bytes of ``batch``'s real rows (``mask``), the correct
    next-byte guesses among them, how many there are (every byte of a plain window, the bytes of a packed row's
    documents, segment > 0), and the MoE layers' load-balancing loss (:func:`balance_loss`; 0 without experts)."""
    inputs, targets = batch["inputs"].astype(jnp.int32), batch["targets"].astype(jnp.int32)
    segments = batch.get("segments")
    logits, sown = apply_fn({"params": params}, inputs, segments, batch.get("positions"), mutable=["moe"])
    balance = balance_loss(sown.get("moe", {}))
    real = jnp.broadcast_to(jnp.asarray(mask, bool)[:, None], targets.shape)
    if segments is not None:
        real = real & (segments > 0)
    # Selects, not products: a padded position's value never reaches the sums or their gradients.
    loss = jnp.where(real, optax.softmax_cross_entropy_with_integer_labels(logits, targets), 0.0)
    right = real & (jnp.argmax(logits, -1) == targets)
    return jnp.sum(loss), jnp.sum(right, dtype=jnp.float32), jnp.sum(real, dtype=jnp.float32), balance


def balance_loss(sown: Any) -> jnp.ndarray:
    """The load-balancing loss of the MoE layers in ``sown`` (the ``"moe"`` collection; 0 without experts): the
    stack hands each layer's out per micro-batch, ``[layers, m]`` (``m`` GPipe's micro-batches; 1 outside a
    pipeline, where the stack is a scan, and in each call of the loss under the table schedules, which call it once
    per micro-batch). The sum over the layers of the mean over the micro-batches is the same loss under every
    schedule: each micro-batch adds its own layers' losses, as when accumulating."""
    found = jax.tree_util.tree_leaves_with_path(sown)
    per_layer = [v for path, v in found if path[-2].key == "load_balancing_loss"]  # [layers, m] each
    return sum((jnp.sum(jnp.mean(v, axis=1)) for v in per_layer), jnp.zeros((), jnp.float32))
