"""A transformer block with Megatron-style tensor-parallel partitioning, shared by the hybrid/model-axes tests and
their multi-process worker: query, key, value and the MLP's first kernel split by columns over ``"model"``,
the attention output and the MLP's second kernel by rows, everything else whole."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ddp_models import jit_once

import spmdcomm as sc

WIDTH, HEADS, HIDDEN, SEQ, CLASSES = 16, 4, 32, 6, 5


LECUN = nn.initializers.lecun_normal()


def _init(partitioned: bool, names: tuple, base=LECUN):
    return nn.with_partitioning(base, names) if partitioned else base


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP, then a classifier head on the mean token."""

    partitioned: bool = True

    @nn.compact
    def __call__(self, x):
        col = lambda: _init(self.partitioned, (None, "model"))
        row = lambda: _init(self.partitioned, ("model", None))
        col_bias = lambda: _init(self.partitioned, ("model",), nn.initializers.normal(0.1))
        h = nn.LayerNorm()(x)
        # No key bias: softmax ignores it, so its gradient is rounding noise that Adam would amplify.
        q, k, v = (
            nn.Dense(WIDTH, kernel_init=col(), bias_init=col_bias(), use_bias=n != "k", name=n)(h) for n in "qkv"
        )
        split = lambda t: t.reshape(t.shape[:-1] + (HEADS, WIDTH // HEADS))
        scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(WIDTH // HEADS)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", attn, split(v)).reshape(x.shape)
        x = x + nn.Dense(WIDTH, kernel_init=row(), name="out")(mixed)
        h = nn.gelu(nn.Dense(HIDDEN, kernel_init=col(), bias_init=col_bias(), name="up")(nn.LayerNorm()(x)))
        x = x + nn.Dense(WIDTH, kernel_init=row(), name="down")(h)
        return nn.Dense(CLASSES, name="head")(x.mean(axis=1))


def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
    logits = apply_fn({"params": params}, batch["x"])
    return sc.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask), {}


def boxed_params():
    """The block's parameters with their ``nn.Partitioned`` boxes (as ``Module.init`` returns them)."""
    return _init_block(jax.random.PRNGKey(0), np.zeros((1, SEQ, WIDTH), np.float32))["params"]


# One compiled program for every call in a process (eagerly, each initializer shape compiles its own), without
# XLA:CPU's backend optimisation: every test (and the worker) trains from and compares with these same values.
_init_block = jit_once(Block().init)


def plain_params():
    return jax.tree.map(np.asarray, nn.unbox(boxed_params()))


def batches(steps: int, rows: int = 32, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((rows, SEQ, WIDTH)).astype(np.float32),
            "y": rng.integers(0, CLASSES, rows).astype(np.int32),
        }
        for _ in range(steps)
    ]
