"""The training loop: runs a train step over batches with a bounded number of steps in flight, and with a
``checkpoint_dir`` saves and resumes the run (state and data position) so that a restarted job continues
where it stopped."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import jax

from spmdcomm.checkpoint._async import CheckpointSave, checked_timeout
from spmdcomm.checkpoint.checkpoint import checkpoint_extra, latest_checkpoint_step, restore_checkpoint, save_checkpoint
from spmdcomm.data.iterators import IteratorLoader, as_resumable, restore_position, saved_position
from spmdcomm.errors import SpmdError, describe
from spmdcomm.reliability.metrics import MetricsWriter
from spmdcomm.reliability.phases import PhaseTimer
from spmdcomm.reliability.preemption import PREEMPTED_EXIT_CODE, Preemption
from spmdcomm.reliability.watchdog import DEFAULT_COMPILE_TIMEOUT, Watchdog
from spmdcomm.train.hooks import Hook, check_hooks, data_epoch, due_hooks, optional_positive, run_hooks
from spmdcomm.train.state import TrainState
from spmdcomm.train.train_step import TrainStep

__all__ = ["fit", "Preempted"]


def fit(
    step: TrainStep,
    state: TrainState,
    data: Iterable[Any],
    *,
    max_steps: int | None = None,
    hooks: Sequence[Hook] = (),
    callback: Callable[[int, dict[str, float]], None] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    save_every: int | None = None,
    max_to_keep: int | None = None,
    async_save: bool = False,
    save_timeout: float | None = None,
    watchdog_timeout: float | None = None,
    watchdog_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
    watchdog_first_step_timeout: float | None = None,
    watchdog_interval: float = 1.0,
    preemption: bool | None = None,
    metrics_log: str | os.PathLike[str] | None = None,
    tensorboard_dir: str | os.PathLike[str] | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Runs ``step`` over the batches of ``data`` and returns the final state and this call's metrics.

    Metrics are fetched to the host one in-flight window late (the step's ``max_in_flight``), so the
    loop never stalls on the newest step and never queues more executions than XLA:CPU can hold.

    With ``checkpoint_dir``, the run survives being killed and restarted: ``fit`` first restores the
    latest complete checkpoint there, if any (the state, whose ``rng`` and ``step`` fix every later
    random draw, and the data position), then skips the batches that state has trained on, saves every
    ``save_every`` steps (counted by ``state.step``, so a restarted run saves at the same steps) and at
    the end. A restarted run then ends with bitwise the parameters of one that never stopped. ``data`` must
    then be able to resume: an object with ``state_dict()`` (a JSON-serialisable position of the next batch not
    yet handed out) and ``load_state_dict()``, such as :class:`spmdcomm.Loader` or
    :class:`spmdcomm.IteratorLoader`, or a Grain ``DataLoader``, ``MapDataset``, ``IterDataset`` or iterator (any
    iterable whose iterator has ``get_state()`` and ``set_state()``: its state is saved in the checkpoint). A list,
    generator or other iterable without them raises (wrap it in ``IteratorLoader(data, resume="skip")`` when the
    script builds the same batches on every start). ``state`` is the template the checkpoint is restored into
    (see :func:`spmdcomm.restore_checkpoint`). Each save is atomic (a process killed while saving leaves the
    previous checkpoint as the latest), and every process must call ``fit`` alike: each writes its own shards, and
    process 0's data position is saved (an ``IteratorLoader``'s or Grain source's: every process's, as each reads
    its own shard; a restart then needs the same number of processes). With ``async_save=True`` each save writes
    in the background while the next steps run (see :func:`spmdcomm.save_checkpoint`); a save waits for the
    previous one and raises its error, and ``fit`` waits for the last one before it returns or stops for a
    preemption.

    Where each step's time goes: every step's metrics also hold the seconds it spent in each phase,
    ``"time/data"`` (waiting for data), ``"time/compile"`` (tracing and compiling a step: the first, a new batch
    shape), ``"time/dispatch"``, ``"time/devices"`` (waiting for the devices, one in-flight window back),
    ``"time/sync"`` (in a barrier), ``"time/save"``, ``"time/hooks"`` and ``"time/other"``
    (:class:`spmdcomm.PhaseTimer`; a phase unused in a step is 0.0).

    Args:
      step: the train step, from :func:`~spmdcomm.make_train_step`.
      state: the state to train from; with ``checkpoint_dir``, also the template a checkpoint is restored into.
      data: an iterable of batches (resumable with ``checkpoint_dir``, see above; a Grain source is read without
        prefetch: wrap it in :class:`spmdcomm.IteratorLoader` with ``prefetch=2`` to place batches ahead).
      max_steps: ends the run once ``state.step`` (the global step count, restored with a checkpoint) reaches it,
        even with batches left; the data's position then names the first batch not trained on. ``None``
        (default): run until ``data`` ends.
      hooks: :class:`Hook` s run on the host between steps: every ``n`` global steps or at the end of every ``n``
        epochs (evaluation, logging, sample generation), as ``fn(state, *, step, epoch)`` with a 0-based
        ``epoch``; what they return joins that step's metrics.
      callback: ``callback(i, metrics)`` sees each step's metrics in order (``i`` counts this call's steps from 0).
      checkpoint_dir: a directory every process can reach, to resume from and save to (see above); ``None``
        (default): no checkpoints.
      save_every: save every this many steps (by ``state.step``); ``None`` (default): only at the end. Needs
        ``checkpoint_dir``.
      max_to_keep: keep the newest this many checkpoints; ``None`` (default): all. Needs ``checkpoint_dir``.
      async_save: ``True``: a save blocks the loop only while the state is copied to host memory, and writes in
        the background (at most one save in flight: the next save first waits for it); ``"time/save"`` then counts
        that copy and any wait. ``False`` (default): each save blocks until complete. Needs ``checkpoint_dir``.
      save_timeout: with ``async_save``, the seconds each background save may take on every process
        (``save_checkpoint(..., timeout=)``; default 1200 s). In a job of several processes, a save that fails on
        one process is raised on every process (by the next save or at the end), naming that process, at once when
        its write raised and after ``save_timeout`` when a process does not finish.
      watchdog_timeout: seconds; starts a :class:`spmdcomm.Watchdog`: when a step takes longer, compilation left
        out, every process prints one table naming the stuck process(es), what each process was doing and for
        how long, and exits with status :data:`spmdcomm.STUCK_EXIT_CODE` (75), so that ``spmdcomm-launch
        --max-restarts`` restarts the job. ``None`` (default): no watchdog.
      watchdog_compile_timeout: seconds a compilation of the train or eval step may take on any process before
        the watchdog calls it stuck (30 minutes by default); while one process compiles, the others wait for it.
      watchdog_first_step_timeout: seconds the first step of this call may take, from the start of ``fit``
        (restoring a checkpoint and compiling left out); ``None`` (default): 10x ``watchdog_timeout``, for a
        data source's start (worker processes, opening files, filling a prefetch queue).
      watchdog_interval: seconds between the watchdog's checks and publications of this process's state (1 s by
        default): a stall is reported between ``watchdog_timeout`` and ``watchdog_timeout + watchdog_interval``
        after it began, at a cost of two small coordination-service calls per interval.
      preemption: makes SIGTERM stop every process at one agreed step, save a checkpoint there and raise
        :class:`Preempted` (default: on with a ``checkpoint_dir``; create ``fit`` in the main thread). ``True``
        needs ``checkpoint_dir``.
      metrics_log: a JSON-lines file each step's metrics, phase times included, are appended to
        (:class:`spmdcomm.MetricsWriter`; ``{process}`` in the path is the process index); ``None`` (default): none.
      tensorboard_dir: a directory TensorBoard scalars are written to (:class:`spmdcomm.MetricsWriter`;
        ``{process}`` in the path is the process index); ``None`` (default): none.

    Returns:
      ``(state, history)``: the final state, and one dict of Python floats per step this call ran (its metrics,
      phase times and what the hooks returned).

    Raises:
      Preempted: after a preemption stop saved its checkpoint: a ``SystemExit`` with status
        :data:`spmdcomm.PREEMPTED_EXIT_CODE` (143); uncaught, the process ends with that status (the launcher
        and schedulers read it as "preempted, restart me"); the next start resumes from the checkpoint.
      SpmdError: for an invalid argument (``max_steps``, ``save_every`` or ``max_to_keep`` not a positive int,
        either of the last two or ``preemption=True`` without ``checkpoint_dir``, ``data`` that cannot resume (or a
        checkpoint's data position saved by another kind of source or number of processes),
        a hook that is not a :class:`Hook`, or an epoch hook over data that counts no epochs), a checkpoint
        without a data position, a hook whose result is not a dict or names a metric already reported, or (with
        ``async_save``) a save that failed in the background, naming its step and directory (raised by the next
        save or at the end; when the loop raises first, the save's error is added to that exception as a note).

    Examples:
      >>> import optax
      >>> def loss_fn(params, batch, *, apply_fn, model_state, rng, mask):
      ...     return sc.masked_mean((batch - params["c"]) ** 2, mask)
      >>> state = sc.TrainState.create(params={"c": np.float32(0.0)}, tx=optax.sgd(0.25))
      >>> batches = [np.full(8, 4.0, np.float32)] * 20
      >>> state, history = sc.fit(sc.make_train_step(loss_fn), state, batches)
      >>> len(history), round(float(state.params["c"]), 4)
      (20, 4.0)
    """
    max_steps = optional_positive("max_steps", max_steps)
    hooks = check_hooks(hooks, data)
    checkpoints = None
    if checkpoint_dir is not None:
        checkpoints = _Checkpoints(
            checkpoint_dir,
            data,
            save_every=save_every,
            max_to_keep=max_to_keep,
            asynchronous=async_save,
            timeout=save_timeout,
        )
        data = checkpoints.data  # a Grain source, wrapped to save its iterator's state
        state = checkpoints.resume(state)
    elif save_every is not None or max_to_keep is not None or async_save or save_timeout is not None:
        raise SpmdError(
            describe(
                "fit",
                "save_every, max_to_keep, async_save and save_timeout need a checkpoint_dir.",
                fix="pass checkpoint_dir=<a directory every process can reach>, or leave them out.",
            )
        )
    timer = PhaseTimer()
    pending: collections.deque[tuple[int, Any]] = collections.deque()
    times: dict[int, dict[str, float]] = {}
    history: list[dict[str, float]] = []
    hooked: dict[int, dict[str, Any]] = {}  # what the hooks returned after step i, joined to its metrics
    first = checkpoints.step if checkpoints is not None else int(jax.device_get(state.step))
    epoch = data_epoch(data)
    with contextlib.ExitStack() as stack:
        # Closed in reverse: the writer, the preemption handlers and the watchdog's threads end with the loop;
        # a loader's prefetch threads stop even when the loop ends early (an exception here or in a callback).
        if watchdog_timeout is not None:
            watchdog = Watchdog(
                timer,
                timeout=watchdog_timeout,
                first_step_timeout=(
                    10 * watchdog_timeout if watchdog_first_step_timeout is None else watchdog_first_step_timeout
                ),
                compile_timeout=watchdog_compile_timeout,
                interval=watchdog_interval,
            )
            stack.enter_context(watchdog)
        elif watchdog_first_step_timeout is not None:
            raise SpmdError(
                describe(
                    "fit",
                    "watchdog_first_step_timeout is the first step's allowance of the watchdog that "
                    "watchdog_timeout starts, and watchdog_timeout is None.",
                    fix="pass watchdog_timeout=<seconds a step may take> too, or leave out "
                    "watchdog_first_step_timeout.",
                )
            )
        stop = stack.enter_context(Preemption()) if _wants_preemption(preemption, checkpoints) else None
        writer = None
        if metrics_log is not None or tensorboard_dir is not None:
            writer = stack.enter_context(MetricsWriter(metrics_log, tensorboard_dir=tensorboard_dir))
        source = iter(data)
        stack.callback(getattr(source, "close", lambda: None))
        if checkpoints is not None:  # closed first: a save in flight ends before the watchdog and the loader stop
            stack.push(checkpoints.exit)

        def drain(keep: int) -> None:
            with timer.phase("devices"):
                while len(pending) > keep:
                    i, metrics = pending.popleft()
                    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    host.update({f"time/{k}": v for k, v in times.pop(i).items()})
                    host.update({k: float(v) for k, v in jax.device_get(hooked.pop(i, {})).items()})
                    history.append(host)
                    if writer is not None:
                        writer.write(first + i + 1, host)
                    if callback is not None:
                        callback(i, host)

        for i in itertools.count():
            if stop is not None and stop.should_stop(first + i):
                assert checkpoints is not None  # _wants_preemption watches for a stop only with checkpoints
                drain(0)
                with timer.phase("save"):
                    if not checkpoints.saved_last:  # a stop right after a periodic save (or the resume) keeps that one
                        checkpoints.save(state)
                    checkpoints.wait()  # the process exits next: not before its checkpoint is complete
                raise Preempted(first + i)
            if max_steps is not None and first + i >= max_steps:
                break
            with timer.phase("data"):
                batch = next(source, _END)
            if batch is _END:
                break
            with timer.phase("dispatch"):
                state, metrics = step(state, batch)
            pending.append((i, metrics))
            if hooks:
                ended, epoch = epoch, data_epoch(data)
                due = due_hooks(hooks, first + i + 1, ended, ended_epoch=epoch != ended)
                if due:
                    with timer.phase("hooks"):
                        hooked[i] = run_hooks(due, state, first + i + 1, ended, taken=metrics)
            drain(step.max_in_flight)  # the metrics of the step one in-flight window back
            saving = checkpoints is not None and checkpoints.stepped()
            if saving:
                assert checkpoints is not None  # saving is False without checkpoints
                # The steps before this one are reported before their state is saved: a run killed after the
                # save does not train them again, so their records must not wait in the window.
                drain(1)
                with timer.phase("save"):  # blocks until the checkpoint is complete (or copied, with async_save)
                    checkpoints.save(state)
            times[i] = timer.end_step(first + i + 1)
            if saving:
                drain(0)
        drain(0)
        if checkpoints is not None:
            with timer.phase("save"):
                if not checkpoints.saved_last:
                    checkpoints.save(state)
                checkpoints.wait()
    return state, history


# ---------------------------------------------------------------------------------------------------------


_END = object()


class Preempted(SystemExit):
    """Raised by :func:`fit` after a preemption stop saved its checkpoint.

    A ``SystemExit`` whose ``code`` is :data:`spmdcomm.PREEMPTED_EXIT_CODE`, so that, uncaught, the process ends
    with the status a launcher or scheduler reads as "preempted". ``step`` is the global step the run stopped (and
    saved) at.
    """

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


def _wants_preemption(preemption: bool | None, checkpoints: Any) -> bool:
    if preemption and checkpoints is None:
        raise SpmdError(
            describe(
                "fit",
                "preemption=True saves a checkpoint at the agreed stop step, so it needs a checkpoint_dir.",
                fix="pass checkpoint_dir=..., or leave preemption out.",
            )
        )
    return checkpoints is not None if preemption is None else bool(preemption)


class _Checkpoints:
    """``fit``'s checkpoints: what to restore at the start, when to save, and the data position saved with each."""

    def __init__(
        self, directory: Any, data: Any, *, save_every: Any, max_to_keep: Any, asynchronous: Any, timeout: Any
    ):
        resumable = as_resumable(data)
        if resumable is None or (isinstance(resumable, IteratorLoader) and not resumable.resumable):
            what = f"a {type(data).__name__}"
            if isinstance(data, IteratorLoader):
                what = f"an IteratorLoader over a {type(data.source).__name__}"
            raise SpmdError(
                describe(
                    "fit",
                    f"data is {what}, which cannot resume: with checkpoint_dir, a restarted "
                    "run must skip the batches the restored state has trained on, so data needs "
                    "state_dict() and load_state_dict(), or an iterator with get_state() and set_state() (Grain's).",
                    fix="pass sc.Loader(dataset, sampler, batch_size=...), a Grain DataLoader or dataset, or "
                    "sc.IteratorLoader(data, resume='skip') if the script builds the same batches in the same order "
                    "on every start; or leave checkpoint_dir out and checkpoint yourself.",
                )
            )
        for name, value in (("save_every", save_every), ("max_to_keep", max_to_keep)):
            optional_positive(name, value)
        self.directory = directory
        self.data = resumable
        if not isinstance(asynchronous, bool):
            raise SpmdError(describe("fit", f"async_save={asynchronous!r} is not a bool.", fix="pass True or False."))
        self.timeout = checked_timeout("fit", timeout, asynchronous=asynchronous, names=("save_timeout", "async_save"))
        self.save_every = save_every
        self.max_to_keep = max_to_keep
        self.asynchronous = asynchronous
        self.in_flight: CheckpointSave | None = None
        self.step = 0  # state.step of the newest state the loop holds, counted on the host
        self.saved_last = False  # whether that state is saved

    def resume(self, state: TrainState) -> TrainState:
        """``state`` restored from the latest checkpoint, with ``data`` moved to its position; ``state`` itself
        when there is none."""
        latest = latest_checkpoint_step(self.directory)
        if latest is None:
            self.step = int(jax.device_get(state.step))
            return state
        extra = checkpoint_extra(self.directory, step=latest)
        if "data" not in extra:
            raise SpmdError(
                describe(
                    "fit",
                    f"checkpoint {latest} in {os.fspath(self.directory)!r} has no data position (it was not "
                    "saved by fit), so fit cannot tell which batches its state has trained on.",
                    fix="give fit a checkpoint_dir of its own, or restore that checkpoint with "
                    "sc.restore_checkpoint and pass data that starts at the right batch.",
                )
            )
        state = restore_checkpoint(self.directory, state, step=latest)
        restore_position(self.data, extra["data"])
        self.step, self.saved_last = int(jax.device_get(state.step)), True
        return state

    def stepped(self) -> bool:
        """Counts one step; whether a save is due after it."""
        self.step += 1
        self.saved_last = False
        return self.save_every is not None and self.step % self.save_every == 0

    def save(self, state: TrainState) -> None:
        """Saves ``state`` (in the background with ``async_save``, after the previous save is complete)."""
        options: dict[str, Any] = {"step": self.step, "max_to_keep": self.max_to_keep}
        extra = {"data": saved_position(self.data)}
        self.in_flight = None  # save_checkpoint waits for it, and raises its error
        if self.asynchronous:
            self.in_flight = save_checkpoint(
                self.directory, state, **options, extra=extra, asynchronous=True, timeout=self.timeout
            )
        else:
            save_checkpoint(self.directory, state, **options, extra=extra)
        self.saved_last = True

    def wait(self) -> None:
        """Waits for the save in flight, if any; raises its error."""
        save, self.in_flight = self.in_flight, None
        if save is not None:
            save.wait()

    def exit(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """When the loop raised: waits for the save in flight (its state was complete) and adds its error, if any,
        to the loop's exception as a note, so that neither is lost."""
        if error is None:
            return
        try:
            self.wait()
        except SpmdError as e:
            error.add_note(str(e))
