"""Per-step metrics written to a JSON-lines file and, optionally, to TensorBoard.

:class:`MetricsWriter` takes one dict of numbers per step (losses, the seconds per phase from
:class:`spmdcomm.PhaseTimer`, ...) and appends it as one JSON object per line, and with ``tensorboard_dir``
as TensorBoard scalars through `tensorboardX <https://github.com/lanpa/tensorboardX>`_ (``pip install
'spmdcomm[tensorboard]'``). Each process writes its own numbers: put ``{process}`` in a path to get one
file per process.

>>> import json, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "metrics.{process}.jsonl")
>>> with sc.MetricsWriter(path) as writer:
...     writer.write(0, {"loss": 0.5, "time/data": 0.25})
>>> with open(path.format(process=0)) as lines:
...     json.loads(next(lines))["loss"]
0.5
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from spmdcomm.errors import SpmdError, describe
from spmdcomm.runtime.process import process_index

__all__ = ["MetricsWriter"]


class MetricsWriter:
    """Appends one record per step to a JSON-lines file at ``path`` and/or TensorBoard event files.

    Each line is ``{"step": STEP, "time": UNIX_SECONDS, NAME: VALUE, ...}``; the file is opened for appending,
    so a resumed run continues it (a step re-run after a restart appears again: keep the last record of each
    step). Values are written as Python floats; NaN and infinities as Python's ``json`` writes them (``NaN``,
    ``Infinity``). With ``tensorboard_dir`` each value is also a TensorBoard scalar named after its key,
    written by ``tensorboardX.SummaryWriter``. ``{process}`` in either path becomes this process's index.
    Lines are flushed as written; TensorBoard files on :meth:`close`, every ``flush_seconds`` and when
    tensorboardX's queue is full. A context manager: leaving the ``with`` block closes it.

    Args:
      path: the JSON-lines file to append to (its directory is created); None for none.
      tensorboard_dir: the directory of TensorBoard event files (needs tensorboardX); None for none.
      flush_seconds: seconds between flushes of the TensorBoard files (rounded, at least 1).

    Raises:
      SpmdError: when neither ``path`` nor ``tensorboard_dir`` is given, or ``tensorboard_dir`` is given and
        tensorboardX is not installed.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        tensorboard_dir: str | os.PathLike | None = None,
        flush_seconds: float = 30.0,
    ):
        if path is None and tensorboard_dir is None:
            raise SpmdError(
                describe(
                    "MetricsWriter",
                    "was given neither `path` nor `tensorboard_dir`, so it has nowhere to write.",
                    fix="pass a JSON-lines file path (e.g. 'logs/metrics.{process}.jsonl'), a "
                    "tensorboard_dir, or both.",
                )
            )
        self._tensorboard = None
        if tensorboard_dir is not None:
            self._tensorboard = _summary_writer(_for_process(tensorboard_dir), flush_seconds)
        self._file = None
        if path is not None:
            target = _for_process(path)
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            self._file = open(target, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records ``metrics`` (names to numbers: Python, NumPy or 0-d JAX values) for step ``step``.

        Args:
          step: the step number, written as an int (the ``"step"`` field and TensorBoard's global step).
          metrics: metric name to a number that ``float()`` accepts (not a string).

        Raises:
          SpmdError: when a name is not a str or a value is not a number; nothing is written then.
        """
        values = {name: _number(name, value) for name, value in metrics.items()}
        if self._file is not None:
            self._file.write(json.dumps({"step": int(step), "time": time.time(), **values}) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=int(step))

    def close(self) -> None:
        """Flushes and closes the file and the TensorBoard writer."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------


def _for_process(path: str | os.PathLike) -> str:
    # str.replace, not str.format: a path may contain other braces.
    return os.fspath(path).replace("{process}", str(process_index()))


def _number(name: str, value: Any) -> float:
    number = None
    if isinstance(name, str) and not isinstance(value, str | bytes):  # float("1.5") would accept text
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if number is None:
        shown = f"{type(value).__name__} {value!r}"[:120]
        raise SpmdError(
            describe(
                "MetricsWriter.write",
                f"metric {name!r} is {shown}, not a number.",
                fix="pass a dict of names (str) to numbers: Python or NumPy scalars, or 0-d arrays.",
            )
        )
    return number


def _summary_writer(logdir: str, flush_seconds: float) -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise SpmdError(
            describe(
                "MetricsWriter",
                f"tensorboard_dir={logdir!r} needs the tensorboardX package, which is not installed.",
                fix="pip install 'spmdcomm[tensorboard]' (or tensorboardX), or leave tensorboard_dir out.",
            )
        ) from None
    return SummaryWriter(logdir=logdir, flush_secs=max(1, round(flush_seconds)))
