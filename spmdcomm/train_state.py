"""The train state: parameters, optimizer state, model state and RNG, placed on a mesh by a strategy.

The state is the one home of the data-parallel configuration: the mesh, the data axis and the
:mod:`~spmdcomm.strategies` strategy are given once, to :meth:`TrainState.create`, and every step built
with :func:`~spmdcomm.make_train_step` / :func:`~spmdcomm.make_eval_step` reads them from the state it gets.
"""

from __future__ import annotations

import collections
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm import placement
from spmdcomm.mesh import check_mesh_axes, default_mesh
from spmdcomm.rng import data_to_keys, keys_to_data
from spmdcomm.strategies import Strategy, resolve_strategy
from spmdcomm.sync import broadcast_tree

__all__ = ["TrainState", "optimizer_state_bytes"]


@flax.struct.dataclass
class TrainState:
    """Everything one training step reads and writes, placed on the mesh (a pytree).

    ``step`` counts global steps, ``params`` are the trained parameters, ``opt_state`` the optax state,
    ``model_state`` the mutable model state (Flax ``batch_stats``, NNX ``BatchStat``, NNX RNG stream keys
    and counts ...; ``{}`` when none) and ``rng`` a raw ``uint32[2]`` base key. The static fields are
    ``apply_fn`` (a Flax ``Module.apply``, an NNX ``GraphDef`` or any callable handed to ``loss_fn``),
    ``tx``, the ``mesh`` and data ``axis`` the state lives on, its ``strategy`` and the strategy's
    ``layout`` (the ``PartitionSpec`` of every leaf). Under every strategy ``params`` is the model's parameter
    tree and ``opt_state`` is ``tx.init(params)``, as on one device; only the leaves' shardings differ.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    apply_fn: Any = flax.struct.field(pytree_node=False, default=None)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False, default=None)
    mesh: Mesh = flax.struct.field(pytree_node=False, default=None)
    axis: str = flax.struct.field(pytree_node=False, default="data")
    strategy: Strategy = flax.struct.field(pytree_node=False, default=None)
    layout: Any = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        tx: optax.GradientTransformation,
        apply_fn: Any = None,
        model_state: Any = None,
        rng: Any = None,
        mesh: Mesh | None = None,
        axis: str = "data",
        strategy: Strategy | str = "ddp",
    ) -> TrainState:
        """Builds the state and places it on ``mesh`` as ``strategy`` says (default: replicated, DDP).

        ``mesh`` defaults to every device on one ``"data"`` axis; ``axis`` is the mesh axis the batch
        is split over. ``strategy`` is ``"ddp"``, ``"zero1"`` or a :class:`~spmdcomm.Strategy` object such
        as ``sc.DDP(bucket_bytes=...)`` (see :mod:`spmdcomm.strategies`).

        With several processes, process 0's ``params``, ``model_state`` and ``rng`` are broadcast so every
        replica starts identical (DDP's init-time broadcast), after a timed check that every process passed
        the same tree structure, shapes and dtypes (:class:`~spmdcomm.ProcessMismatchError` names a process
        that differs; a missing process is named after the sync timeout).
        ``rng`` is an int seed, a key, or ``None`` (seed 0). Typed key leaves (``jax.random.key``, NNX
        ``RngKey``) stay typed keys; they travel as their key data.

        >>> import optax
        >>> s = sc.TrainState.create(params={"w": np.ones(3, np.float32)}, tx=optax.adam(1e-3))
        >>> int(s.step), s.params["w"].sharding.is_fully_replicated, s.strategy
        (0, True, DDP(bucket_bytes=None))
        """
        mesh = default_mesh() if mesh is None else mesh
        check_mesh_axes("TrainState.create", mesh, axis)
        strategy = resolve_strategy("TrainState.create", strategy)
        model_state = {} if model_state is None else model_state
        rng = _raw_key(rng)
        # Typed key leaves (Flax NNX RngKey) cross the host as their uint32 key data: NumPy and the
        # multi-process broadcast only move plain arrays.
        host, key_impls = keys_to_data((params, model_state, rng))
        host = broadcast_tree("TrainState.create", host)
        params, model_state, rng = data_to_keys(
            placement.place("TrainState.create", host, NamedSharding(mesh, P()), host_input="global"), key_impls
        )
        layout = strategy.layout(params, tx, mesh, axis)
        params = _reshard(params, layout.shardings(mesh, "params"))
        opt_state = jax.jit(tx.init, out_shardings=layout.shardings(mesh, "opt"))(params)
        return cls(
            step=jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, P())),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            apply_fn=apply_fn,
            tx=tx,
            mesh=mesh,
            axis=axis,
            strategy=strategy,
            layout=layout,
        )

    @classmethod
    def create_nnx(cls, model: Any, *, tx: optax.GradientTransformation, **kwargs: Any) -> TrainState:
        """Builds the state of a Flax NNX ``model``: ``nnx.split`` into graph, ``nnx.Param`` and the rest.

        ``apply_fn`` becomes the ``GraphDef``, ``model_state`` every non-``Param`` variable (e.g.
        ``BatchStat``, and the ``RngKey``/``RngCount`` of ``nnx.Rngs`` streams such as
        ``nnx.Dropout(rate, rngs=rngs)``'s). Pair it with :func:`~spmdcomm.nnx_loss_fn` and
        :func:`~spmdcomm.nnx_metric_fn`. ``kwargs`` go to :meth:`create`.

        >>> from flax import nnx
        >>> import optax
        >>> s = sc.TrainState.create_nnx(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx=optax.sgd(0.1))
        >>> sorted(s.params.keys())
        ['bias', 'kernel']
        """
        from flax import nnx

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return cls.create(params=params, tx=tx, apply_fn=graphdef, model_state=rest, **kwargs)

    def specs(self) -> TrainState:
        """The state with a ``PartitionSpec`` in place of each array (prefix tree): how it is split."""
        return self.replace(
            step=P(), params=self.layout.param_specs, opt_state=self.layout.opt_specs, model_state=P(), rng=P()
        )

    def shardings(self) -> TrainState:
        """The state with the ``NamedSharding`` of each array in place of it (prefix tree)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs(), is_leaf=lambda x: isinstance(x, P))

    def full_params(self) -> Any:
        """The model's parameter tree, replicated on the mesh: ``params`` itself, or, under a strategy that
        splits the parameters (:class:`~spmdcomm.FSDP`), ``params`` gathered.

        >>> import optax
        >>> s = sc.TrainState.create(params={"w": np.ones((8, 3), np.float32)}, tx=optax.sgd(0.1), strategy="fsdp")
        >>> s.params["w"].shape, s.params["w"].sharding.spec, s.full_params()["w"].sharding.spec
        ((8, 3), P('data',), P())
        """
        if not self.strategy.shards_params:
            return self.params
        return _reshard(self.params, NamedSharding(self.mesh, P()))


def optimizer_state_bytes(state: TrainState) -> int:
    """Bytes of ``state.opt_state`` held on one device (the largest, when devices differ).

    >>> import optax
    >>> s = sc.TrainState.create(params={"w": np.zeros(1000, np.float32)}, tx=optax.adam(1e-3))
    >>> sc.optimizer_state_bytes(s)  # two float32 moments of 1000 entries, and an int32 count
    8004
    """
    per_device: dict[Any, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(state.opt_state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values(), default=0)


# --------------------------------------------------------------------------------------------------


def _reshard(tree: Any, shardings: Any) -> Any:
    # A jitted identity moves each leaf to its sharding on the devices, in one process or many.
    return jax.jit(lambda t: t, out_shardings=shardings)(tree)


def _raw_key(rng: Any) -> np.ndarray:
    if rng is None:
        rng = 0
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return np.asarray(rng, dtype=np.uint32)
