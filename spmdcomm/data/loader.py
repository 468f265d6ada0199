"""A resumable data source: a data set's batches in a :class:`~spmdcomm.ShardedSampler`'s order, prefetched.

A :class:`Loader` remembers how far the training loop has got (the epoch and the next batch it has not yet
consumed, counted as batches reach the loop, not as prefetch fetches them). ``state_dict()`` saved with a
checkpoint and ``load_state_dict()`` after restoring it make the loader yield exactly the batches the saved
state has not trained on; :func:`spmdcomm.fit` does both when given a ``checkpoint_dir``.

>>> sampler = sc.ShardedSampler(10, shard_index=0, num_shards=1, shuffle=False)
>>> loader = sc.Loader({"x": np.arange(10.0)}, sampler, batch_size=4, epochs=2, prefetch=0)
>>> it = iter(loader)
>>> next(it).data["x"].tolist(), loader.state_dict()
([0.0, 1.0, 2.0, 3.0], {'epoch': 0, 'batch': 1, 'global_batch_size': 4})
>>> again = sc.Loader({"x": np.arange(10.0)}, sc.ShardedSampler(10, shard_index=0, num_shards=1, shuffle=False),
...                   batch_size=4, epochs=2, prefetch=0)
>>> again.load_state_dict(loader.state_dict())
>>> len(again), [b.mask.sum().item() for b in again]  # the 5 batches left: 2 of epoch 0, 3 of epoch 1
(5, [4, 2, 4, 4, 2])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jax.sharding import Mesh

from spmdcomm.data.batches import MaskedBatch, take_batches
from spmdcomm.data.placement import HostInput, check_host_input
from spmdcomm.data.prefetch import Threads, prefetch_to_device
from spmdcomm.data.sampler import ShardedSampler
from spmdcomm.data.stats import PrefetchStats
from spmdcomm.errors import AxisError, SpmdError, describe
from spmdcomm.runtime.mesh import default_mesh

__all__ = ["Loader"]


class Loader:
    """A resumable iterable of a data set's batches in a :class:`~spmdcomm.ShardedSampler`'s order, prefetched.

    Iterating yields ``dataset``'s rows in ``sampler``'s batches of ``batch_size`` for ``epochs`` epochs, from
    the sampler's position on, as :class:`~spmdcomm.MaskedBatch` es placed on the mesh ``prefetch`` batches
    ahead. ``sampler`` is this process's shard and ``batch_size`` its rows per step, so every global batch is
    the processes' batches side by side, in process order: the same rows, padding in the same places, for any
    number of processes sharing one global batch size (see :class:`~spmdcomm.ShardedSampler`), so a run
    resumed on another split of the same devices trains on the same global arrays. Each pass over the loader
    starts at the position and moves it as batches reach the caller, so the position always names the next
    batch the caller has not received; the epochs after the last one yield nothing. ``len(loader)`` is the
    number of batches a pass from the current position yields; ``loader.stats`` the latest pass's
    :class:`~spmdcomm.data.PrefetchStats` (``None`` without prefetch).

    Args:
      dataset: a pytree of arrays indexed along dimension 0 (see :func:`spmdcomm.take_batches`).
      sampler: this process's :class:`~spmdcomm.ShardedSampler`; it holds the position.
      batch_size: this process's rows per step, an int >= 1.
      epochs: the number of epochs, counted from epoch 0, an int >= 0 (default 1).
      prefetch: ``k >= 1`` places batches ``k`` ahead through :func:`spmdcomm.prefetch_to_device`
        (default 2); 0 yields host batches (the train step places them).
      mesh: the mesh batches are placed on (default :func:`spmdcomm.default_mesh`).
      axis: the mesh axis (or axes) dimension 0 is split over, which must be an axis of ``mesh`` (default
        ``"data"``).
      host_input: what a batch means with several processes, as in :func:`spmdcomm.shard_batch`: ``"local"``
        (default) this process's rows, the sampler being this process's shard; ``"global"`` the whole global
        batch on every process (a sampler of one shard, the same on every process). It is passed to the
        prefetch that places the batches, so it needs ``prefetch >= 1``.
      threads: who fetches and places the batches, passed to :func:`spmdcomm.prefetch_to_device` (default
        ``"auto"``).

    Raises:
      SpmdError: when ``sampler`` is not a :class:`~spmdcomm.ShardedSampler`, ``batch_size``, ``epochs`` or
        ``prefetch`` is out of range, or ``host_input="global"`` comes with ``prefetch=0``.
      AxisError: when ``axis`` is not an axis of ``mesh`` (of the default mesh: at the first pass).

    Examples:
      >>> sampler = sc.ShardedSampler(6, shard_index=0, num_shards=1, shuffle=False)
      >>> loader = sc.Loader({"x": np.arange(6.0)}, sampler, batch_size=4, prefetch=0)
      >>> len(loader), [b.mask.tolist() for b in loader], loader.state_dict()
      (2, [[True, True, True, True], [True, True, False, False]], {'epoch': 1, 'batch': 0, 'global_batch_size': 4})
    """

    def __init__(
        self,
        dataset: Any,
        sampler: ShardedSampler,
        *,
        batch_size: int,
        epochs: int = 1,
        prefetch: int = 2,
        mesh: Mesh | None = None,
        axis: str | tuple[str, ...] = "data",
        host_input: HostInput = "local",
        threads: Threads = "auto",
    ):
        if not isinstance(sampler, ShardedSampler):
            raise SpmdError(
                describe(
                    "Loader",
                    f"sampler is a {type(sampler).__name__}, not a ShardedSampler.",
                    fix="pass sc.ShardedSampler(len(dataset), shard_index=sc.process_index(), "
                    "num_shards=sc.process_count(), seed=...).",
                )
            )
        for name, value, low in (("batch_size", batch_size, 1), ("epochs", epochs, 0), ("prefetch", prefetch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpmdError(describe("Loader", f"{name}={value!r} must be an int >= {low}."))
        if check_host_input("Loader", host_input) != "local" and not prefetch:
            raise SpmdError(
                describe(
                    "Loader",
                    f"host_input={host_input!r} with prefetch=0: the loader yields host batches and places none, "
                    "so the step that places them decides what they mean.",
                    fix=f"pass prefetch=2, or host_input={host_input!r} to make_train_step / make_eval_step.",
                )
            )
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.epochs = epochs
        self.prefetch = prefetch
        self.mesh = mesh
        self.axis = axis
        self.host_input = host_input
        self.threads = threads
        self.stats: PrefetchStats | None = None  # the latest pass's waits for data (None without prefetch)
        if prefetch and mesh is not None:
            self._check_axis(mesh)  # the default mesh waits for the first pass: it starts JAX's backends

    def __iter__(self) -> Iterator[MaskedBatch]:
        epoch, batch = self._position()
        per_epoch = self.sampler.num_batches(self.batch_size)
        batches: Iterator[MaskedBatch] = self._host_batches(epoch, batch)
        if self.prefetch:
            mesh = self._check_axis(default_mesh() if self.mesh is None else self.mesh)
            batches = prefetch_to_device(
                batches, self.prefetch, mesh=mesh, axis=self.axis, host_input=self.host_input, threads=self.threads
            )
            self.stats = batches.stats
        try:
            for item in batches:
                # Moved before the hand-over: from here on the caller holds this batch.
                epoch, batch = (epoch + 1, 0) if batch + 1 == per_epoch else (epoch, batch + 1)
                self.sampler.load_state_dict({"epoch": epoch, "batch": batch})
                yield item
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def __len__(self) -> int:
        """The number of batches a pass from the current position yields."""
        epoch, batch = self._position()
        if epoch >= self.epochs:
            return 0
        return (self.epochs - epoch) * self.sampler.num_batches(self.batch_size) - batch

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch and batch of the next batch not yet handed out.

        Returns:
          A new dict ``{"epoch": e, "batch": b, "global_batch_size": g}`` of ints, ``g`` being ``batch_size`` x
          the sampler's ``num_shards``, the global batch size that batch indices count in.
        """
        return {**self.sampler.state_dict(), "global_batch_size": self._global_batch_size()}

    def load_state_dict(self, state: Any) -> None:
        """Moves the position to ``state`` (as :meth:`state_dict` returns it).

        The global batch size must match; the number of shards (processes) may differ, since batch ``b``
        of an epoch holds the same examples for any split of one global batch size.

        Args:
          state: a dict ``{"epoch", "batch", "global_batch_size"}`` that :meth:`state_dict` returned.

        Raises:
          SpmdError: when ``state`` is not such a dict, or its ``global_batch_size`` differs from this loader's.
        """
        if not isinstance(state, dict) or "global_batch_size" not in state:
            raise SpmdError(
                describe(
                    "Loader.load_state_dict",
                    f"state={state!r} is not a Loader position.",
                    fix='pass what Loader.state_dict() returned: {"epoch", "batch", "global_batch_size"}.',
                )
            )
        if state["global_batch_size"] != self._global_batch_size():
            raise SpmdError(
                describe(
                    "Loader.load_state_dict",
                    f"the position was saved with a global batch of {state['global_batch_size']!r} examples, but "
                    f"this loader's is {self._global_batch_size()} (batch_size={self.batch_size} x "
                    f"num_shards={self.sampler.num_shards}): its batch indices would name other examples.",
                    fix="resume with the global batch size of the saved run (batch_size x number of processes).",
                )
            )
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "global_batch_size"})

    def _check_axis(self, mesh: Mesh) -> Mesh:
        """``mesh``, once every name in ``axis`` is one of its axes; else an :class:`AxisError` naming the fix."""
        names = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        missing = [name for name in names if name not in mesh.axis_names]
        if not missing:
            return mesh
        sizes = ", ".join(f"{name!r}: {2 if i < len(names) - 1 else -1}" for i, name in enumerate(names))
        example = f"sc.make_mesh({{{sizes}}})"
        if self.mesh is None:
            where = "the default mesh (no mesh= was given; sc.default_mesh())"
            fix = (
                f"pass the mesh that has it: mesh={example}, or mesh=state.mesh, axis=state.axis for a train "
                "state's mesh; or leave axis out to split over the default mesh's 'data' axis."
            )
        else:
            where = "the mesh given as mesh="
            fix = f"pass one of its axes as axis=, or a mesh that has {missing[0]!r} as mesh= (e.g. {example})."
        raise AxisError(
            describe(
                "Loader",
                f"axis={self.axis!r} places batches on mesh axis {missing[0]!r}, which is not an axis of {where}; "
                f"its axes are {tuple(mesh.axis_names)} with sizes {dict(mesh.shape)}.",
                fix=fix,
            )
        )

    def _global_batch_size(self) -> int:
        return self.batch_size * self.sampler.num_shards

    def _position(self) -> tuple[int, int]:
        """The sampler's position, with a batch index past the end of its epoch moved into the next epochs."""
        per_epoch = self.sampler.num_batches(self.batch_size)
        position = self.sampler.state_dict()
        epoch, batch = position["epoch"], position["batch"]
        if per_epoch and batch >= per_epoch:
            epoch, batch = epoch + batch // per_epoch, batch % per_epoch
        return epoch, batch

    def _host_batches(self, epoch: int, batch: int) -> Iterator[MaskedBatch]:
        for e in range(epoch, self.epochs):
            index_batches = self.sampler.batches(self.batch_size, epoch=e, start=batch if e == epoch else 0)
            yield from take_batches(self.dataset, index_batches)
