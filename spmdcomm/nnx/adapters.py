"""Flax NNX models in the train and eval steps: adapters from ``fn(model, batch, ...)`` to their contracts.
``flax.nnx`` is imported on first use, not by ``import spmdcomm``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax.numpy as jnp

from spmdcomm.parallel.rng import is_per_example_key, stream_key_for_call
from spmdcomm.train._model_call import split_loss_output

__all__ = ["nnx_loss_fn", "nnx_metric_fn"]


def nnx_loss_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts a loss function of a Flax NNX model to :func:`make_train_step`'s ``loss_fn`` contract.

    The model is rebuilt with ``nnx.merge(apply_fn, params, model_state)``; variables the call
    changed (e.g. ``BatchStat``, ``RngCount``) come back as the new model state. Use with
    :meth:`TrainState.create_nnx`.

    RNG streams (``nnx.Rngs``, ``nnx.Dropout(rate, rngs=...)``): for the duration of the call,
    every stream's key is replaced by :func:`~spmdcomm.parallel.rng.stream_key_for_call` of its stored key and
    the step's ``rng``, so with the default per-device ``rng`` the dropout masks differ between
    devices, micro-batches and steps (like torch DDP's per-rank generators), and with
    ``rng="per_example"`` they depend only on the seed, the step and each example's global index.
    Afterwards the stored keys are put back and the counts keep their increments, so keys and
    counts stay identical on every replica. With ``rng="per_example"`` each call draws from count 0
    (the row offset already tells micro-batches apart), so the bits do not depend on
    ``accum_steps`` either. The model runs in whatever mode it was created in (``nnx.Dropout`` is
    active by default); :func:`nnx_metric_fn` switches to evaluation mode.

    Args:
      fn: ``fn(model, batch, *, rng, mask) -> loss | (loss, metrics)``, called with the rebuilt model, the
        step's ``rng`` and the block's ``mask`` (as :func:`make_train_step`'s ``loss_fn`` gets them).

    Returns:
      ``loss_fn(params, batch, *, apply_fn, model_state, rng, mask) -> (loss, aux)`` for
      :func:`make_train_step`: ``aux`` is ``fn``'s metrics (empty without them) plus the new model state under
      ``"model_state"``.

    Examples:
      >>> from flax import nnx
      >>> import optax
      >>> state = sc.TrainState.create_nnx(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx=optax.sgd(0.1))
      >>> def mse(model, batch, *, rng, mask):
      ...     return sc.masked_mean((model(batch["x"])[:, 0] - batch["y"]) ** 2, mask)
      >>> step = sc.make_train_step(sc.nnx_loss_fn(mse))
      >>> state, m = step(state, {"x": np.ones((8, 2), np.float32), "y": np.ones(8, np.float32)})
      >>> int(state.step)
      1
    """
    from flax import nnx

    def loss_fn(params: Any, batch: Any, *, apply_fn: Any, model_state: Any, rng: Any, mask: Any) -> Any:
        model = nnx.merge(apply_fn, params, model_state, copy=True)
        streams = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngStream)]
        stored = [(s.key.get_value(), s.count.get_value()) for s in streams]
        per_example = rng is not None and is_per_example_key(rng)
        if rng is not None:
            for s, (key, count) in zip(streams, stored, strict=True):
                s.key.set_value(stream_key_for_call(key, rng))
                if per_example:
                    s.count.set_value(jnp.zeros_like(count))
        loss, aux = split_loss_output(fn(model, batch, rng=rng, mask=mask), "nnx_loss_fn")
        for s, (key, count) in zip(streams, stored, strict=True):
            s.key.set_value(key)
            if per_example:
                s.count.set_value(count + s.count.get_value())
        # Two filters give exactly two states, where nnx.split's type allows any number after the first.
        _, _, new_state = cast("tuple[nnx.GraphDef[Any], nnx.State, nnx.State]", nnx.split(model, nnx.Param, ...))
        return loss, {**aux, "model_state": new_state}

    return loss_fn


def nnx_metric_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts a metric function of a Flax NNX model to the :func:`make_eval_step` contract.

    The model is rebuilt with ``nnx.merge(apply_fn, params, model_state)`` and switched to
    evaluation mode (``model.eval()``: ``nnx.Dropout`` off, ``nnx.BatchNorm`` on its running
    statistics); the state is not changed. Use with :meth:`TrainState.create_nnx`.

    Args:
      fn: ``fn(model, batch, *, mask) -> metrics dict | scalar``, called with the rebuilt model in evaluation
        mode and the block's ``mask``.

    Returns:
      ``metric_fn(params, batch, *, apply_fn, model_state, mask)`` for :func:`make_eval_step`, returning what
      ``fn`` returns.

    Examples:
      >>> from flax import nnx
      >>> import optax
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.9, rngs=nnx.Rngs(1)))
      >>> state = sc.TrainState.create_nnx(model, tx=optax.sgd(0.1))
      >>> def mean_out(model, batch, *, mask):
      ...     return {"out": sc.masked_mean(model(batch).sum(-1), mask)}
      >>> evaluate = sc.make_eval_step(sc.nnx_metric_fn(mean_out))
      >>> x = np.ones((8, 2), np.float32)
      >>> model.eval()  # the same model without dropout, for comparison
      >>> bool(np.isclose(evaluate(state, x)["out"], model(x[:1]).sum()))
      True
    """
    from flax import nnx

    def metric_fn(params: Any, batch: Any, *, apply_fn: Any, model_state: Any, mask: Any) -> Any:
        model = nnx.merge(apply_fn, params, model_state, copy=True)
        model.eval()
        return fn(model, batch, mask=mask)

    return metric_fn
