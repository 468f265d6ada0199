"""The train state: parameters, optimizer state, model state and RNG, placed on a mesh by a strategy.

The state is the one home of the data-parallel configuration: the mesh, the data axis and the
:mod:`~spmdcomm.parallel.data.strategies` strategy are given once, to :meth:`TrainState.create`, and every step built
with :func:`~spmdcomm.make_train_step` / :func:`~spmdcomm.make_eval_step` reads them from the state it gets.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, cast

import flax.struct
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm.data import placement
from spmdcomm.parallel._logical_rules import LogicalRules
from spmdcomm.parallel._mesh_axes import (
    check_data_axes,
    data_axes,
    model_partitioning,
    nnx_logical_specs,
)
from spmdcomm.parallel.context import ContextParallel
from spmdcomm.parallel.data.strategies import DDP, Strategy, resolve_strategy
from spmdcomm.parallel.pipeline.pipeline import Pipeline
from spmdcomm.parallel.pipeline.schedule import SEQUENTIAL, Schedule
from spmdcomm.parallel.registry import logical_rules
from spmdcomm.parallel.rng import data_to_keys, keys_to_data, raw_key
from spmdcomm.parallel.roles import MeshRoles, active, by_keyword, mesh_roles, parallel_configs, with_data_axis
from spmdcomm.runtime.host_collectives import broadcast_tree
from spmdcomm.runtime.mesh import default_mesh
from spmdcomm.train.loss_scale import resolve_loss_scale
from spmdcomm.train.memory import StateMemory, device_bytes

__all__ = ["TrainState"]


@flax.struct.dataclass
class TrainState:
    """Everything one training step reads and writes, placed on the mesh (a pytree).

    Build it with :meth:`create` (or :meth:`create_nnx`); the steps return new states. Under every strategy
    ``params`` is the model's parameter tree and ``opt_state`` is ``tx.init(params)``, as on one device; only the
    leaves' shardings differ. The fields from ``apply_fn`` on are static (not pytree leaves).

    Attributes:
      step: the global step count (an int32 scalar, replicated).
      params: the trained parameters.
      opt_state: the optax state.
      model_state: the mutable model state (Flax ``batch_stats``, NNX ``BatchStat``, NNX RNG stream keys and
        counts ...; ``{}`` when none).
      rng: a raw ``uint32[2]`` base key.
      loss_scale: the dynamic loss scale (a Flax ``DynamicScale``, replicated; ``None`` without scaling, see
        :mod:`spmdcomm.train.loss_scale`).
      apply_fn: a Flax ``Module.apply``, an NNX ``GraphDef`` or any callable handed to ``loss_fn``.
      tx: the optax ``GradientTransformation``.
      mesh: the mesh the state lives on.
      axis: the data axis: one mesh axis, or a tuple of them (hybrid sharding).
      strategy: the :class:`~spmdcomm.train.Strategy` that placed the state.
      layout: the strategy's layout: the ``PartitionSpec`` of every leaf, over the data axes and the model axes
        (the mesh's other axes).
      logical_axis_rules: the Flax logical axis rules in force when the state was created (given to
        :meth:`create` or from the active ``nn.logical_axis_rules`` context), as a tuple of pairs; ``None`` when
        there were none. The steps trace the model under them, without their data axes.
      pipeline: the :class:`~spmdcomm.Pipeline` that splits the model's stacked layers over the stage axis
        (``None``: no pipeline); see :mod:`spmdcomm.parallel.pipeline.pipeline`.
      context: the :class:`~spmdcomm.ContextParallel` that splits every sequence of the batch over the context axis
        (``None``: none); see :mod:`spmdcomm.parallel.context`.
      parallel: the configs of the other parallelisms the state runs (:mod:`spmdcomm.parallel.registry`), in
        registration order (``()``: none).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    loss_scale: Any = None
    apply_fn: Any = flax.struct.field(pytree_node=False, default=None)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False, default=None)
    mesh: Mesh = flax.struct.field(pytree_node=False, default=None)
    axis: str | tuple[str, ...] = flax.struct.field(pytree_node=False, default="data")
    strategy: Strategy = flax.struct.field(pytree_node=False, default=None)
    layout: Any = flax.struct.field(pytree_node=False, default=None)
    logical_axis_rules: Any = flax.struct.field(pytree_node=False, default=None)
    pipeline: Pipeline | None = flax.struct.field(pytree_node=False, default=None)
    context: ContextParallel | None = flax.struct.field(pytree_node=False, default=None)
    parallel: tuple[Any, ...] = flax.struct.field(pytree_node=False, default=())

    if TYPE_CHECKING:  # flax.struct.dataclass adds it when the class is built; declared for type checkers

        def replace(self, **changes: Any) -> TrainState: ...

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
        axis: str | tuple[str, ...] = "data",
        strategy: Strategy | str = DDP.name,
        param_specs: Any = None,
        loss_scale: Any = None,
        logical_axis_rules: Any = None,
        pipeline: Pipeline | None = None,
        context: ContextParallel | None = None,
        missing_logical_rules: Literal["warn", "error"] = "warn",
        **parallelisms: Any,
    ) -> TrainState:
        """Builds the state and places it on ``mesh`` as ``strategy`` says (default: replicated, DDP).

        With several data axes, e.g. ``mesh=sc.make_mesh({"replica": 2, "shard": 4}), axis=("replica", "shard")``,
        ZeRO and FSDP split over the last one and replicate over the others (hybrid sharding, torch's
        ``HYBRID_SHARD`` on a 2-D mesh): lay the last axis inside a node. Mesh axes that are not data axes are
        model axes: the strategy's data split is added on another dimension than a parameter's model split, and
        the step leaves the model axes to XLA.

        With several processes, process 0's ``params``, ``model_state`` and ``rng`` are broadcast so every
        replica starts identical (DDP's init-time broadcast), after a timed check that every process passed
        the same tree structure, shapes and dtypes. Typed key leaves (``jax.random.key``, NNX ``RngKey``) stay
        typed keys; they travel as their key data.

        Args:
          params: the model's parameter tree (Flax ``nn.with_partitioning`` boxes give each leaf's model spec;
            ``nn.with_logical_partitioning`` boxes give logical names, mapped by ``logical_axis_rules``).
          tx: the optax transformation; the optimizer state is ``tx.init(params)``.
          apply_fn: what ``loss_fn`` gets as ``apply_fn`` (a Flax ``Module.apply``, an NNX ``GraphDef``, any
            callable); ``None`` by default.
          model_state: the mutable model state (e.g. Flax ``batch_stats``); ``None`` (default) stores ``{}``.
          rng: an int seed, a key, or ``None`` (seed 0).
          mesh: the mesh to place the state on; ``None`` (default): every device on one ``"data"`` axis.
          axis: the mesh axis the batch is split over, or a tuple of mesh axes (the batch is split over all of
            them); ``"data"`` by default. With a ``pipeline`` the mesh need not have it (``{"stage": 8}``,
            ``{"stage": 4, "model": 2}``): the state's :attr:`mesh` is then ``mesh`` with ``axis`` in front at
            size 1, on the same devices.
          strategy: ``"ddp"`` (default), ``"zero1"``, ``"zero2"``, ``"fsdp"`` or a
            :class:`~spmdcomm.train.Strategy` object such as ``sc.DDP(bucket_bytes=...)`` (see
            :mod:`spmdcomm.parallel.data.strategies`).
          param_specs: a tree like ``params`` of ``PartitionSpec`` over the model axes (``None`` for a leaf not
            split): how each parameter is split over them; NNX sharding metadata, through :meth:`create_nnx`,
            gives the same. ``None`` (default): no model split, or the boxes' specs.
          loss_scale: ``"dynamic"`` (or a Flax ``DynamicScale``) makes every train step scale the loss, unscale
            the reduced gradients, skip a non-finite step and adapt the scale (float16 training, torch's
            ``GradScaler``; see :mod:`spmdcomm.train.loss_scale`); ``None`` (default): no scaling.
          logical_axis_rules: Flax's rules from logical axis names to mesh axes, e.g. ``[("batch", "data"),
            ("embed", None), ("mlp", "model")]``: each pair a logical name and a mesh axis, a tuple of mesh axes
            or ``None`` (not split). They map the names of ``nn.with_logical_partitioning`` boxes and of NNX
            sharding metadata as Flax's ``nn.logical_to_mesh_axes`` does (in order; a rule whose mesh axes another
            dimension already uses is passed over; a name with no rule leaves its dimension whole, with one
            :class:`~spmdcomm.MissingLogicalRuleWarning` naming each parameter, name and rule to add); data axes
            are dropped (the strategy splits parameters over those). ``None`` (default): the active
            ``nn.logical_axis_rules`` context's rules, kept for the steps' tracing (:attr:`logical_axis_rules`).
          pipeline: ``sc.Pipeline(microbatches=m, axis="stage", repeats=v)`` splits the leaves stacked by
            ``sc.PipelineStack`` (or given the spec ``P("stage", ...)``) over the stage axis, and the steps run them
            as a pipeline; the batch is split over the data axes and the stage axis. ``None`` (default): none.
          context: ``sc.ContextParallel(axis="context")`` splits dimension 1 (the tokens) of every batch leaf of two
            or more dimensions over the context axis inside the steps; the model's attention goes through
            ``sc.context_attention``. ``None`` (default): none.
          missing_logical_rules: ``"warn"`` (default: the warning above) or ``"error"``: a name with no rule raises.
          **parallelisms: the config of any other registered parallelism, by its keyword
            (:mod:`spmdcomm.parallel.registry`); one whose axis name is on the mesh runs without it, with its
            default config. Its logical axis name, if it has one, is mapped to its axis after the rules above.

        Returns:
          The new :class:`TrainState` at step 0, every leaf placed as the strategy's layout says.

        Raises:
          AxisError: when ``axis`` is not a mesh axis (or tuple of distinct ones), a parameter spec names a
            data axis or an axis the mesh lacks, or a logical name maps to an axis the mesh lacks (or has no rule,
            with ``missing_logical_rules="error"``).
          ShapeError: when a parameter spec has more entries than its leaf has dimensions, or splits a dimension
            its axes do not divide.
          SpmdError: for an unknown ``strategy``, an unusable ``loss_scale``, ``param_specs`` whose structure
            is not ``params``'s (or that come with boxed ``params``), rules that are not (name, axes) pairs, a
            keyword no parallelism registered or a parallelism's config of the wrong type.
          ProcessMismatchError: when a process passed another tree structure, shapes or dtypes (it is named).
          BarrierTimeoutError: when a process does not reach the check within the sync timeout (it is named).

        Examples:
          >>> import optax
          >>> s = sc.TrainState.create(params={"w": np.ones(3, np.float32)}, tx=optax.adam(1e-3))
          >>> int(s.step), s.params["w"].sharding.is_fully_replicated, s.strategy
          (0, True, DDP(bucket_bytes=None))
          >>> import flax.linen as nn
          >>> boxed = {"w": nn.LogicallyPartitioned(np.ones((4, 8), np.float32), ("embed", "mlp"))}
          >>> rules = [("embed", None), ("mlp", "model")]  # or the active nn.logical_axis_rules(rules) context
          >>> mesh = sc.make_mesh({"data": 4, "model": 2})
          >>> s = sc.TrainState.create(params=boxed, tx=optax.sgd(0.1), mesh=mesh, logical_axis_rules=rules)
          >>> s.params["w"].sharding.spec
          P(None, 'model')
        """
        fn = "TrainState.create"
        mesh = default_mesh() if mesh is None else mesh
        configs = parallel_configs(fn, mesh, {"pipeline": pipeline, "context": context, **parallelisms})
        mesh = with_data_axis(fn, mesh, axis, configs)
        axis = check_data_axes(fn, mesh, axis)
        roles = mesh_roles(fn, mesh, axis, configs)
        strategy = resolve_strategy(fn, strategy)
        rules = LogicalRules(fn, logical_axis_rules, missing=missing_logical_rules)
        rules.add(*logical_rules(configs))
        params, model_specs = model_partitioning(fn, params, param_specs, mesh, roles.data, rules, stage=roles.stage)
        model_state = {} if model_state is None else model_state
        rng = raw_key(rng)
        loss_scale = resolve_loss_scale(fn, loss_scale)
        # Typed key leaves (Flax NNX RngKey) cross the host as their uint32 key data: NumPy and the
        # multi-process broadcast only move plain arrays.
        host, key_impls = keys_to_data((params, model_state, rng, loss_scale))
        host = broadcast_tree(fn, host)
        placed = placement.place(fn, host, NamedSharding(mesh, P()), host_input="global")
        params, model_state, rng, loss_scale = data_to_keys(placed, key_impls)
        layout = strategy.layout(params, tx, mesh, roles.data, model_specs, stacked=roles.stacked)
        for entry, config in active(configs):
            if entry.prepare is not None:
                params = entry.prepare(fn, config, params, layout)
        # The optimizer state is tx.init of the model's own tree; leaves that no dimension divides are stored padded.
        opt_state = jax.jit(
            lambda p: layout.stored(tx.init(p), "opt", mesh), out_shardings=layout.shardings(mesh, "opt")
        )(params)
        params = jax.jit(lambda p: layout.stored(p, "params", mesh), out_shardings=layout.shardings(mesh, "params"))(
            params
        )
        return cls(
            step=jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, P())),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            loss_scale=loss_scale,
            apply_fn=apply_fn,
            tx=tx,
            mesh=mesh,
            axis=axis,
            strategy=strategy,
            layout=layout,
            logical_axis_rules=rules.rules or None,
            pipeline=configs.pop("pipeline", None),
            context=configs.pop("context", None),
            parallel=tuple(configs.values()),
        )

    @classmethod
    def create_nnx(cls, model: Any, *, tx: optax.GradientTransformation, **kwargs: Any) -> TrainState:
        """Builds the state of a Flax NNX ``model``: ``nnx.split`` into graph, ``nnx.Param`` and the rest.

        ``apply_fn`` becomes the ``GraphDef``, ``model_state`` every non-``Param`` variable (e.g.
        ``BatchStat``, and the ``RngKey``/``RngCount`` of ``nnx.Rngs`` streams such as
        ``nnx.Dropout(rate, rngs=rngs)``'s). Pair it with :func:`~spmdcomm.nnx_loss_fn` and
        :func:`~spmdcomm.nnx_metric_fn`.

        Args:
          model: the Flax NNX module.
          tx: the optax transformation, as in :meth:`create`.
          **kwargs: the other arguments of :meth:`create` (``rng``, ``mesh``, ``axis``, ``strategy``,
            ``loss_scale``, ``logical_axis_rules`` ...). Without ``param_specs``, the model's sharding metadata
            (``out_sharding``) gives them when any parameter carries some: a name with a rule (in ``logical_axis_rules``
            or the active context, after the variable's own ``sharding_rules``) is mapped by it, a name without
            one must be a mesh axis.

        Returns:
          The new :class:`TrainState`, as :meth:`create` builds it.

        Raises:
          AxisError: as :meth:`create`.
          ShapeError: as :meth:`create`.
          SpmdError: as :meth:`create`.

        Examples:
          >>> from flax import nnx
          >>> import optax
          >>> s = sc.TrainState.create_nnx(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx=optax.sgd(0.1))
          >>> sorted(s.params.keys())
          ['bias', 'kernel']
        """
        from flax import nnx

        # Two filters give exactly two states, where nnx.split's type allows any number after the first.
        graphdef, params, rest = cast(
            "tuple[nnx.GraphDef[Any], nnx.State, nnx.State]", nnx.split(model, nnx.Param, ...)
        )
        if "param_specs" not in kwargs:
            # The model's sharding metadata: mesh axes, or logical names that create maps by the rules.
            specs = nnx_logical_specs(params)
            if specs is not None:
                kwargs["param_specs"] = specs
        return cls.create(params=params, tx=tx, apply_fn=graphdef, model_state=rest, **kwargs)

    @property
    def roles(self) -> MeshRoles:
        """What each mesh axis does: data axes (replicate, shard), each parallelism's axis, model axes."""
        return mesh_roles("TrainState", self.mesh, self.axis, self.configs)

    @property
    def configs(self) -> dict[str, Any]:
        """The config of each parallelism the state runs, by its ``TrainState.create`` keyword.

        In registration order: ``{"pipeline": sc.Pipeline(microbatches=4)}`` for a pipelined state."""
        return by_keyword((self.pipeline, self.context, *self.parallel))

    @property
    def schedule(self) -> Schedule:
        """How its steps run a device's block: its :class:`~spmdcomm.Pipeline`, else the sequential schedule."""
        return SEQUENTIAL if self.pipeline is None else self.pipeline

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data axes, as a tuple (``("data",)``); with a pipeline the batch is split over the stage axis too."""
        return data_axes(self.axis)

    @property
    def data_size(self) -> int:
        """How many devices the data axes span: the product of their sizes."""
        return math.prod(int(self.mesh.shape[a]) for a in self.data_axes)

    def specs(self) -> TrainState:
        """The state with a ``PartitionSpec`` in place of each array (prefix tree): how it is split.

        Returns:
          A :class:`TrainState` whose array fields hold ``PartitionSpec`` s (``P()`` for a replicated field); its
          static fields are this state's.
        """
        return self._with_specs(self.layout.param_specs, self.layout.opt_specs)

    def manual_specs(self) -> TrainState:
        """As :meth:`specs`, over the data axes only: what a ``shard_map`` manual over them takes.

        Returns:
          A :class:`TrainState` whose array fields hold ``PartitionSpec`` s naming only the data axes.
        """
        return self._with_specs(self.layout.manual_specs("params"), self.layout.manual_specs("opt"))

    def shardings(self) -> TrainState:
        """The state with the ``NamedSharding`` of each array in place of it (prefix tree).

        Returns:
          A :class:`TrainState` whose array fields hold ``NamedSharding`` s on ``mesh``, as :meth:`specs` says.
        """
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs(), is_leaf=lambda x: isinstance(x, P))

    def full_params(self) -> Any:
        """The model's parameter tree, replicated on the mesh.

        Returns:
          ``params`` itself, or, under a strategy that splits the parameters (:class:`~spmdcomm.FSDP`), ``params``
          gathered (still split over the model axes and a pipeline's stage axis, if any), padded leaves at their
          own shapes and stacked layers in canonical order.

        Examples:
          >>> import optax
          >>> s = sc.TrainState.create(params={"w": np.ones((8, 3), np.float32)}, tx=optax.sgd(0.1), strategy="fsdp")
          >>> s.params["w"].shape, s.params["w"].sharding.spec, s.full_params()["w"].sharding.spec
          ((8, 3), P('data',), P())
        """
        full = self.strategy.full_params(self.layout, self.mesh, self.params)
        if self.pipeline is None or self.pipeline.repeats == 1:
            return full
        # Stored in the circular schedule's stage order: back to the canonical layer order.
        pipeline, stacked = self.pipeline, self.layout.stacked_over(self.pipeline.axis, "params")
        reorder = lambda p: pipeline.reorder(p, stacked, self.mesh, to_stage=False)
        return jax.jit(reorder, out_shardings=jax.tree.map(lambda x: x.sharding, full))(full)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The mesh axes that are neither data axes nor a parallelism's axis (the model's own)."""
        return self.roles.model

    def memory(self) -> StateMemory:
        """The bytes of the state one device holds, by part (``sc.explain`` of a step shows them too).

        Only this process's devices are counted; each figure is that of the device holding the most of it.

        Returns:
          A :class:`StateMemory`.

        Examples:
          >>> import optax
          >>> s = sc.TrainState.create(params={"b": np.zeros(10, np.float32)}, tx=optax.sgd(0.1), strategy="fsdp")
          >>> s.memory()  # 10 entries on 8 devices: stored as 16, two per device; 6 padding entries in all
          StateMemory(params=8, opt_state=0, model_state=0, padding=3, whole=0)
        """
        layout = self.layout
        return StateMemory(
            params=device_bytes(self.params),
            opt_state=device_bytes(self.opt_state),
            model_state=device_bytes(self.model_state),
            padding=layout.padding_bytes("params") + layout.padding_bytes("opt"),
            whole=layout.replicated_bytes("params"),
        )

    def _with_specs(self, params: Any, opt_state: Any) -> TrainState:
        # Everything but the parameters and the optimizer state is replicated.
        return self.replace(step=P(), params=params, opt_state=opt_state, model_state=P(), rng=P(), loss_scale=P())
