"""Dynamic loss scaling for float16 training, carried in the train state and applied by the train step.

Float16 gradients underflow to zero (small values) or overflow to Inf (large ones). Dynamic loss scaling multiplies
the loss by a large factor before differentiating, divides the gradients by it after the data-parallel reduction,
and adapts the factor: a step whose gradient holds a NaN or Inf anywhere (on any replica) is skipped and the scale
shrinks; after a run of finite steps it grows. The state is Flax's own
:class:`flax.training.dynamic_scale.DynamicScale` (``scale`` and ``fin_steps``, with static growth settings), so a
ported program keeps its configuration, and the rule is Flax's:

* finite step: ``fin_steps + 1``; when ``fin_steps`` already equalled ``growth_interval``, the scale is multiplied by
  ``growth_factor`` (capped at the float32 maximum) and ``fin_steps`` restarts at 0;
* non-finite step: parameters, optimizer state and model state are kept, the scale is multiplied by
  ``backoff_factor`` (not below ``minimum_scale``) and ``fin_steps`` restarts at 0.

Every replica decides on the reduced gradient, so every replica skips, grows and shrinks alike. Each device's loss
is weighed by its share of the global batch (its real-example count over the global count; 1 / blocks without a
mask) before it is scaled and differentiated, so each example's backward values are those of one device running
``scale * mean loss`` over the whole batch: the skipped steps, the scale after every step and the parameters (to
float16 rounding) are that program's, masked or not, on any number of devices and under every strategy. One
difference remains by construction: a weight gradient that one device sums over the whole batch in float16 can
overflow where each device's partial sum does not (the partial sums are added in float32, or ``reduce_dtype``).

``TrainState.create(loss_scale=...)`` takes:

* ``"dynamic"``: Flax's defaults, ``DynamicScale()``: initial scale ``2**16`` = 65536, ``growth_factor=2.0``,
  ``backoff_factor=0.5``, ``growth_interval=2000`` (Flax grows when ``fin_steps`` equals it, so after 2001 finite
  steps, where torch's ``GradScaler`` default grows after 2000), ``minimum_scale`` the smallest normal float32;
* a dict of ``DynamicScale`` fields to set, the others keeping those defaults:
  ``{"scale": 2.0**12, "growth_interval": 1999, "growth_factor": 2.0, "backoff_factor": 0.5, "minimum_scale": 1.0}``;
* a ``flax.training.dynamic_scale.DynamicScale``.

torch's ``GradScaler(init_scale=s, growth_factor=g, backoff_factor=b, growth_interval=n)`` grows after ``n`` finite
steps, which is ``{"scale": s, "growth_factor": g, "backoff_factor": b, "growth_interval": n - 1}``.

>>> import optax
>>> state = sc.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1),
...                              loss_scale={"scale": 1024.0, "growth_interval": 99})
>>> float(state.loss_scale.scale), int(state.loss_scale.fin_steps), state.loss_scale.growth_interval
(1024.0, 0, 99)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdcomm.errors import SpmdError, describe

__all__ = ["resolve_loss_scale", "next_loss_scale", "SETTINGS"]

#: The settings a ``loss_scale`` dict may give: ``DynamicScale``'s fields but its step count.
SETTINGS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "minimum_scale")


def resolve_loss_scale(fn: str, loss_scale: Any) -> Any:
    """``loss_scale`` as a host ``DynamicScale`` (float32 ``scale``, int32 ``fin_steps``), or ``None``.

    Accepts ``None`` (no scaling), ``"dynamic"`` (Flax's defaults: scale 65536, x2 after 2001 finite steps, x0.5
    on a non-finite one), a dict of ``DynamicScale`` fields (:data:`SETTINGS`) or a ``DynamicScale``.
    """
    from flax.training.dynamic_scale import DynamicScale

    if loss_scale is None:
        return None
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        loss_scale = DynamicScale()
    if isinstance(loss_scale, Mapping):
        unknown = sorted(str(k) for k in loss_scale if k not in SETTINGS)
        if unknown:
            raise SpmdError(
                describe(
                    fn,
                    f"loss_scale={dict(loss_scale)!r} sets {unknown}, which are not loss-scale settings.",
                    fix=f"set only {list(SETTINGS)} (e.g. {{'scale': 2.0**12, 'growth_interval': 1999}}).",
                )
            )
        loss_scale = DynamicScale(**loss_scale)
    if not isinstance(loss_scale, DynamicScale):
        raise SpmdError(
            describe(
                fn,
                f"loss_scale={loss_scale!r} is not a loss scale.",
                fix='pass loss_scale="dynamic", a dict of settings such as {"scale": 2.0**12, "growth_interval": '
                "1999}, a flax.training.dynamic_scale.DynamicScale, or None (no scaling).",
            )
        )
    scale = np.asarray(loss_scale.scale, np.float32)
    fin_steps = np.asarray(loss_scale.fin_steps)
    problems = []
    if scale.shape != () or not math.isfinite(float(scale)) or float(scale) <= 0:
        problems.append(f"scale={loss_scale.scale!r} must be a positive finite scalar")
    if fin_steps.shape != () or not np.issubdtype(fin_steps.dtype, np.integer) or int(fin_steps) < 0:
        problems.append(f"fin_steps={loss_scale.fin_steps!r} must be a non-negative int")
    if not loss_scale.growth_factor >= 1:
        problems.append(f"growth_factor={loss_scale.growth_factor!r} must be >= 1")
    if not 0 < loss_scale.backoff_factor <= 1:
        problems.append(f"backoff_factor={loss_scale.backoff_factor!r} must be in (0, 1]")
    if isinstance(loss_scale.growth_interval, bool) or not isinstance(loss_scale.growth_interval, (int, np.integer)):
        problems.append(f"growth_interval={loss_scale.growth_interval!r} must be an int")
    if problems:
        raise SpmdError(
            describe(fn, f"loss_scale is not a usable DynamicScale: {'; '.join(problems)}.", fix="e.g. DynamicScale().")
        )
    return loss_scale.replace(scale=scale, fin_steps=fin_steps.astype(np.int32))


def next_loss_scale(loss_scale: Any, finite: jax.Array) -> Any:
    """The scale for the next step after one whose gradient was ``finite`` (Flax's ``DynamicScale`` rule)."""
    scale, fin_steps = loss_scale.scale, loss_scale.fin_steps
    grow = fin_steps == loss_scale.growth_interval
    grown = jnp.minimum(scale * loss_scale.growth_factor, jnp.finfo(jnp.float32).max)
    shrunk = scale * loss_scale.backoff_factor
    if loss_scale.minimum_scale is not None:
        shrunk = jnp.maximum(shrunk, loss_scale.minimum_scale)
    new_scale = jnp.where(finite, jnp.where(grow, grown, scale), shrunk).astype(scale.dtype)
    new_fin_steps = jnp.where(grow | ~finite, 0, fin_steps + 1).astype(fin_steps.dtype)
    return loss_scale.replace(scale=new_scale, fin_steps=new_fin_steps)
