"""Per-leaf sharding of the model's tree: which dimension of each leaf a strategy splits over the data axes,
and the collectives that move such leaves (ZeRO's packed in one buffer per dtype, FSDP's leaf by leaf).

The state's data axes are one mesh axis or several (``("replica", "fsdp")``: hybrid sharding, torch's
``HYBRID_SHARD``): a sharding strategy splits over the LAST data axis (the shard axis, inside a node) and
replicates over the others (the replica axes, across nodes). A leaf is split over the shard axis on its FIRST
dimension that no model axis already splits and whose size is a multiple of the shard axis size (torch FSDP2
splits dimension 0; the first divisible one keeps the split contiguous wherever it can). A leaf of at least as many
elements as the shard axis has devices but no such dimension (a bias of 10 entries on 8 devices, a 50257-row
embedding on 512) is stored padded with zeros on the free dimension where padding adds the fewest elements, as
torch FSDP2 pads its uneven shards: every device holds one equal block (``TreeLayout.padding_bytes``). Only smaller
leaves (scalars, counts) stay replicated (``TreeLayout.replicated_bytes``).

Padding is a storage matter. The model sees each leaf gathered and cut to its own shape; the optimizer runs in the
global view on the leaves cut to their own shapes (XLA keeps them split unevenly, with no data movement), so masks,
norms, trust ratios and factored statistics are one device's; checkpoints hold the unpadded leaves, so they restore
onto any device count. ``TreeLayout.stored`` / ``TreeLayout.unpadded`` move a tree between the two forms.

Mesh axes that are not data axes belong to the model: a leaf's model spec (``P(None, "model")``) is kept in its
spec, the step leaves those axes to XLA (partial-manual ``shard_map``), and only the data axes are manual.
The specs say what ``NamedSharding`` the state's arrays carry, so everything outside the step (optax in the
global view, checkpoints, ``explain``) sees an ordinary sharded tree.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdcomm.parallel.data import _blocks
from spmdcomm.parallel.data._flat import cast
from spmdcomm.parallel.data._specs import dim as _dim
from spmdcomm.parallel.data._specs import manual_spec, mirrored, names, path_key, shard_dim, shard_spec

__all__ = ["TreeLayout", "shard_spec", "shard_dim"]


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """Where a strategy keeps each leaf: the spec of every stored parameter, of every reduced gradient leaf
    (what the optimizer is handed) and of every optimizer-state leaf, as flattened tuples (hashable: the
    layout is a static field of the state), over the mesh's data ``axes`` (the last one splits; ``size`` is its
    size) and its model axes. ``bucket_bytes`` is DDP's flat-buffer size (None: leaf by leaf)."""

    axes: tuple[str, ...]
    size: int
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    param_leaf_specs: tuple[P, ...]
    grad_leaf_specs: tuple[P, ...]
    opt_treedef: Any
    opt_leaf_specs: tuple[P, ...]
    opt_shapes: tuple[tuple[int, ...], ...] = ()
    opt_dtypes: tuple[str, ...] = ()
    bucket_bytes: int | None = None
    stacked: tuple[str, ...] = ()
    mesh_axes: tuple[str, ...] = ()
    mesh_sizes: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        params: Any,
        tx: Any,
        mesh: Mesh,
        axes: tuple[str, ...],
        *,
        model_specs: tuple[P, ...] | None = None,
        stacked: tuple[str, ...] = (),
        shard_params: bool,
        shard_grads: bool,
        bucket_bytes: int | None = None,
    ) -> TreeLayout:
        """``model_specs``: each parameter leaf's spec over the model axes and the ``stacked`` axes (None: none),
        checked already; ``stacked``: the axes whose parallelism owns the leaves split over them on dimension 0 (a
        pipeline's stage axis: each device holds its block of the layers)."""
        n = int(mesh.shape[axes[-1]])
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        shapes = tuple(tuple(np.shape(x)) for _, x in flat)
        model = model_specs if model_specs is not None else tuple(P() for _ in shapes)
        split = tuple(shard_spec(s, axes[-1], n, m) for s, m in zip(shapes, model, strict=True))
        grads = split if shard_grads else model
        abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for _, x in flat])
        opt_flat, opt_treedef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, abstract))
        # An optimizer leaf that mirrors a parameter (a moment, a trace: the parameter's path ends its path, with
        # the parameter's shape) is laid out as that parameter's gradient; any other leaf (factored statistics,
        # counts, hyperparameters) is split by its own shape over the shard axis, and replicated over model axes.
        # A leaf of a stacked parameter's statistics (Adafactor's factored moments of [L, a, b]: [L, a]) keeps the
        # layers on dimension 0, split over the stacked axis as the parameter's.
        by_path = {path_key(path): i for i, (path, _) in enumerate(flat)}
        opt_specs = []
        for path, leaf in opt_flat:
            i = mirrored(by_path, path, np.shape(leaf), shapes)
            if i is not None:
                opt_specs.append(grads[i])
                continue
            owner = mirrored(by_path, path, None, shapes)
            own = P()
            if owner is not None and names(model[owner], 0) in stacked:
                if np.ndim(leaf) and np.shape(leaf)[0] == shapes[owner][0]:
                    own = P(names(model[owner], 0))
            opt_specs.append(shard_spec(np.shape(leaf), axes[-1], n, own) if shard_grads else own)
        return cls(
            axes=tuple(axes),
            size=n,
            treedef=treedef,
            shapes=shapes,
            dtypes=tuple(jnp.dtype(x.dtype).name for _, x in flat),
            param_leaf_specs=split if shard_params else model,
            grad_leaf_specs=grads,
            opt_treedef=opt_treedef,
            opt_leaf_specs=tuple(opt_specs),
            opt_shapes=tuple(tuple(np.shape(x)) for _, x in opt_flat),
            opt_dtypes=tuple(jnp.dtype(x.dtype).name for _, x in opt_flat),
            bucket_bytes=bucket_bytes,
            stacked=tuple(stacked),
            mesh_axes=tuple(mesh.axis_names),
            mesh_sizes=tuple(int(mesh.shape[a]) for a in mesh.axis_names),
        )

    @property
    def shard_axis(self) -> str:
        """The data axis that sharding strategies split over (the last)."""
        return self.axes[-1]

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The data axes a split leaf is replicated over (hybrid sharding): every data axis but the last."""
        return self.axes[:-1]

    def manual_specs(self, which: str) -> Any:
        """The specs of ``"params"``, ``"grads"`` or ``"opt"`` over the manual axes only (the data axes and the
        stacked axes): a ``shard_map`` that is manual over them and leaves the model axes to XLA takes these (a
        tree)."""
        specs, treedef = self._specs(which)
        return jax.tree.unflatten(treedef, [manual_spec(s, self.manual_axes) for s in specs])

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes the steps map by hand that split leaves: the data axes, then the stacked axes."""
        return self.axes + self.stacked

    def stacked_over(self, axis: str, which: str) -> tuple[bool, ...]:
        """For each leaf of ``"params"``, ``"grads"`` or ``"opt"``: whether it is split over ``axis`` on dimension 0
        (a pipeline's stacked layers over the stage axis)."""
        return tuple(axis in self.stacked and names(s, 0) == axis for s in self._specs(which)[0])

    @property
    def param_specs(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.param_leaf_specs)

    @property
    def grad_specs(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.grad_leaf_specs)

    @property
    def opt_specs(self) -> Any:
        return jax.tree.unflatten(self.opt_treedef, self.opt_leaf_specs)

    def shardings(self, mesh: Mesh, which: str) -> Any:
        """``NamedSharding``s of ``"params"``, ``"grads"`` or ``"opt"`` on ``mesh`` (a tree)."""
        specs, treedef = self._specs(which)
        return jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs])

    def replicated_bytes(self, which: str = "grads") -> int:
        """Bytes of parameter leaves that the shard axis does not split in the layout of ``"grads"`` (default:
        leaves of fewer elements than it has devices) or ``"params"`` (also every parameter under DDP and ZeRO),
        kept whole on every device of a shard group; model axes, if any, still split them."""
        return sum(
            math.prod(s) * jnp.dtype(d).itemsize
            for s, d, split in zip(self.shapes, self.dtypes, self.is_split(which), strict=True)
            if not split
        )

    def padding_bytes(self, which: str) -> int:
        """Bytes of padding one device stores for ``"params"``, ``"grads"`` or ``"opt"``: each padded leaf's
        padding over the shard axis size (every device holds one equal block of the padded leaf)."""
        specs, _ = self._specs(which)
        shapes, dtypes = self.own_shapes(which), self.opt_dtypes if which == "opt" else self.dtypes
        return sum(
            -(-(math.prod(self._stored(shape, spec)) - math.prod(shape)) * jnp.dtype(dtype).itemsize // self.size)
            for spec, shape, dtype in zip(specs, shapes, dtypes, strict=True)
        )

    def own_shapes(self, which: str) -> tuple[tuple[int, ...], ...]:
        """The model's own shape of each leaf of ``"params"``, ``"grads"`` or ``"opt"``."""
        return self.opt_shapes if which == "opt" else self.shapes

    @property
    def pads(self) -> bool:
        """Whether any leaf is stored padded."""
        return any(self.stored_shapes(w) != self.own_shapes(w) for w in ("params", "grads", "opt"))

    def stored_shapes(self, which: str) -> tuple[tuple[int, ...], ...]:
        """The shape each leaf of ``"params"``, ``"grads"`` or ``"opt"`` is stored in: its own, or padded on the
        dimension the shard axis splits to a multiple of the shard axis size."""
        specs, _ = self._specs(which)
        return tuple(self._stored(shape, spec) for shape, spec in zip(self.own_shapes(which), specs, strict=True))

    def stored(self, tree: Any, which: str, mesh: Mesh) -> Any:
        """In the global view (under ``jax.jit``): ``tree`` (leaves of their own shapes) padded to
        :meth:`stored_shapes`, split as the layout says. The padding is zeros."""
        return self._reshaped(tree, which, mesh, self.stored_shapes(which), _blocks.pad_to)

    def unpadded(self, tree: Any, which: str, mesh: Mesh) -> Any:
        """In the global view (under ``jax.jit``): the stored ``tree`` cut to each leaf's own shape. A padded
        leaf stays split over the shard axis (unevenly: XLA pads inside, and the cut moves no data)."""
        return self._reshaped(tree, which, mesh, self.own_shapes(which), _blocks.cut)

    def unpadded_shardings(self, mesh: Mesh, which: str) -> Any:
        """``NamedSharding``s that hold the leaves of ``"params"``, ``"grads"`` or ``"opt"`` at their own shapes
        outside a program (a checkpoint's arrays): a padded leaf whole over the data axes (model axes still split
        it), every other leaf as stored."""
        specs, treedef = self._specs(which)
        out = []
        for spec, shape, stored in zip(specs, self.own_shapes(which), self.stored_shapes(which), strict=True):
            model_axes = tuple(a for a in mesh.axis_names if a not in self.axes)
            out.append(NamedSharding(mesh, spec if shape == stored else manual_spec(spec, model_axes)))
        return jax.tree.unflatten(treedef, out)

    # ----------------------------------------------------------------------------------------------
    # Inside the step (manual over the axis)

    def scatter_sum(self, grads: Any, reduce_dtype: Any, *, across_replicas: bool = True) -> Any:
        """Inside ``shard_map``: ``grads`` (whole local gradients) with every split leaf reduce-scattered to this
        device's block of its sum over the data axes, one reduce-scatter per dtype (and one all-reduce across
        the replica axes, unless ``across_replicas`` is False: then the sum over the shard axis only); leaves not
        split are unchanged."""
        leaves = jax.tree.leaves(grads)
        out = list(leaves)
        for idx in self._by_dtype(self.grad_leaf_specs).values():
            dims = [self._split_dim(self.grad_leaf_specs[i]) for i in idx]
            stored = [self._stored(self._local(i), self.grad_leaf_specs[i]) for i in idx]
            rows = [
                _blocks.to_blocks(_blocks.pad_to(cast(leaves[i], reduce_dtype), d, p), d, self.size)
                for i, d, p in zip(idx, dims, stored, strict=True)
            ]
            packed = jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
            # Reduce-scattered inside the shard group, then the blocks summed across groups (hybrid sharding).
            summed = lax.psum_scatter(packed, self.shard_axis, scatter_dimension=0, tiled=False)
            if self.replica_axes and across_replicas:
                summed = lax.psum(summed, self.replica_axes)
            for i, d, p, part in zip(idx, dims, stored, _blocks.split(summed, [r.shape[1] for r in rows]), strict=True):
                out[i] = part.reshape(_blocks.local_shape(p, d, self.size)).astype(leaves[i].dtype)
        return jax.tree.unflatten(self.treedef, out)

    def gather_params(self, params: Any, compute_dtype: Any = None, reduce_dtype: Any = None) -> Any:
        """Inside ``shard_map``: the whole parameter tree from this device's blocks, one all-gather per split
        leaf, floats gathered in ``compute_dtype`` (None keeps each dtype); whole leaves pass through. The
        derivative reduce-scatters each leaf's cotangent in ``reduce_dtype`` (else the gathered dtype), so the
        gradient with respect to the blocks arrives summed over the shard axis (not over replica axes). A padded
        leaf is cut to its own shape after the gather (its padding's gradient is zero).

        Leaf by leaf, not packed: a packed buffer is sliced into leaves by copies, which XLA keeps beside the
        gathered buffer (measured: 1.6 MiB more temporaries for a 1.6 MiB CNN, and FSDP's peak memory no lower
        than DDP's); per-leaf gathers hand each layer its parameters in place, and XLA may still combine them."""
        leaves = jax.tree.leaves(params)
        out = list(leaves)
        for i, spec in enumerate(self.param_leaf_specs):
            dim = self._dim(spec)
            if dim is None:
                continue
            is_float = jnp.issubdtype(leaves[i].dtype, jnp.floating)
            compute = jnp.dtype(compute_dtype if compute_dtype is not None and is_float else leaves[i].dtype)
            low = jnp.dtype(reduce_dtype) if reduce_dtype is not None and is_float else compute
            out[i] = _blocks.gather_leaf(leaves[i], self.shard_axis, dim, compute, low, self._local(i)[dim])
        return jax.tree.unflatten(self.treedef, out)

    def gather_blocks(self, blocks: Any) -> Any:
        """Inside ``shard_map``: the whole tree from this device's blocks of a tree laid out as ``grad_specs``, in
        one all-gather per dtype, typed as the same on every device (to leave ``shard_map`` as ``P()``). No
        derivative: ZeRO gathers its updated parameters with it, after the optimizer."""
        leaves = jax.tree.leaves(blocks)
        out = list(leaves)
        for idx in self._by_dtype(self.grad_leaf_specs).values():
            flat = [jnp.ravel(leaves[i]) for i in idx]
            local = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
            rows = lax.all_gather(local, self.shard_axis, tiled=False, to="invarying")
            for i, part in zip(idx, _blocks.split(rows, [x.shape[0] for x in flat]), strict=True):
                dim = self._split_dim(self.grad_leaf_specs[i])
                whole = _blocks.from_blocks(part, self._stored(self._local(i), self.grad_leaf_specs[i]), dim, self.size)
                out[i] = _blocks.cut(whole, dim, self._local(i))
        return jax.tree.unflatten(self.treedef, out)

    def is_split(self, which: str) -> tuple[bool, ...]:
        """For each leaf of ``"params"``, ``"grads"`` or ``"opt"``: whether the shard axis splits it."""
        return tuple(self._dim(s) is not None for s in self._specs(which)[0])

    def _specs(self, which: str) -> tuple[tuple[P, ...], Any]:
        specs = {"params": self.param_leaf_specs, "grads": self.grad_leaf_specs, "opt": self.opt_leaf_specs}[which]
        return specs, self.opt_treedef if which == "opt" else self.treedef

    def _reshaped(self, tree: Any, which: str, mesh: Mesh, shapes: tuple[tuple[int, ...], ...], move: Any) -> Any:
        """``tree`` with each leaf whose shape is not its entry of ``shapes`` brought to it by ``move(x, dim,
        shape)`` (padding or cutting the dimension the shard axis splits), kept split as the layout says."""
        leaves, treedef = jax.tree.flatten(tree)
        specs, _ = self._specs(which)
        out = []
        for x, spec, shape in zip(leaves, specs, shapes, strict=True):
            if tuple(x.shape) != shape:
                x = lax.with_sharding_constraint(move(x, _dim(spec, self.shard_axis), shape), NamedSharding(mesh, spec))
            out.append(x)
        return jax.tree.unflatten(treedef, out)

    def _local(self, i: int) -> tuple[int, ...]:
        """Parameter leaf ``i``'s shape inside the steps' ``shard_map``: a stacked leaf holds this device's block of
        dimension 0 (a stage's layers)."""
        shape, axis = self.shapes[i], names(self.param_leaf_specs[i], 0)
        if axis not in self.stacked:
            return shape
        return (shape[0] // dict(zip(self.mesh_axes, self.mesh_sizes, strict=True))[axis],) + shape[1:]

    def _stored(self, shape: tuple[int, ...], spec: P) -> tuple[int, ...]:
        dim = self._dim(spec)
        return shape if dim is None else _blocks.padded(shape, dim, self.size)

    def _dim(self, spec: P) -> int | None:
        return _dim(spec, self.shard_axis)

    def _split_dim(self, spec: P) -> int:
        """The dimension the shard axis splits, for a leaf that :meth:`_by_dtype` picked."""
        dim = self._dim(spec)
        assert dim is not None  # _by_dtype picks only the leaves the shard axis splits
        return dim

    def _by_dtype(self, specs: tuple[P, ...]) -> dict[tuple[str, Any], list[int]]:
        """The indices of the leaves of ``specs`` that the shard axis splits, by dtype and by the stacked axis that
        splits them (a pipeline's stacked layers differ per stage: one buffer cannot hold both kinds)."""
        buckets: dict[tuple[str, Any], list[int]] = collections.defaultdict(list)
        for i, spec in enumerate(specs):
            if self._dim(spec) is not None:
                own = names(spec, 0)
                buckets[self.dtypes[i], own if own in self.stacked else None].append(i)
        return buckets


# --------------------------------------------------------------------------------------------------
