"""The example's data: the Python standard library's own source files as a byte-level corpus (no download).

Every machine that runs the example has a Python installation, and its standard library is megabytes of real text.
``load_corpus`` reads its ``.py`` files in sorted order of their paths (installed packages left out) until
``max_bytes`` are read, and sends every ``val_every``-th file to the validation split, the others to the training
split: the split is by file, so no validation line was seen in training, and it is the same on every process and
every run of one Python version. Bytes are the tokens (a vocabulary of 256).

Training batches are ``seq_len + 1``-byte windows of the training bytes at random offsets (:class:`Windows`, drawn
from the seed); validation batches are fixed windows spread over the validation bytes (:func:`eval_windows`).
With ``packed`` rows (:func:`packed_bytes`) every window is cut into documents of different lengths, padded at
the end, with segment ids and positions that restart in each document, so that rows hold different numbers of real
bytes and attention stays inside a document. ``unigram_bits_per_byte`` is the baseline a language model must beat:
the cross-entropy of the training bytes' frequencies on the validation bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 256  # bytes are the tokens
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages"})  # installed packages differ between machines


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The two splits as ``uint8`` byte streams (each the concatenation of its files) and the files of each."""

    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def stdlib_root() -> Path:
    """The folder of this Python's standard library (where ``os.py`` is)."""
    return Path(os.path.dirname(os.__file__))


def source_files(root: str | os.PathLike[str]) -> list[str]:
    """Every ``.py`` file under ``root`` as a POSIX path relative to it, sorted, installed packages left out."""
    root = Path(root)
    found = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(p.as_posix() for p in found if not SKIPPED_DIRS & set(p.parts))


def load_corpus(max_bytes: int, *, val_every: int = 10, root: str | os.PathLike[str] | None = None) -> Corpus:
    """Reads ``root``'s source files (default: the standard library's) in sorted order until at least ``max_bytes``
    are read (the file that crosses it is read whole); file ``i`` of them goes to validation when ``i % val_every
    == val_every - 1``, to training otherwise.

    Raises:
      ValueError: when ``max_bytes`` or ``val_every`` is below 1 or 2, or either split ends up empty.
    """
    if max_bytes < 1 or val_every < 2:
        raise ValueError(f"max_bytes={max_bytes} must be >= 1 and val_every={val_every} >= 2")
    root = stdlib_root() if root is None else Path(root)
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    names: tuple[list[str], list[str]] = ([], [])
    total = 0
    for i, name in enumerate(source_files(root)):
        if total >= max_bytes:
            break
        data = (root / name).read_bytes()
        to_val = i % val_every == val_every - 1
        splits[to_val].append(data)
        names[to_val].append(name)
        total += len(data)
    train, val = (np.frombuffer(b"".join(parts), np.uint8) for parts in splits)
    if not train.size or not val.size:
        raise ValueError(
            f"{root}: {len(names[0])} training and {len(names[1])} validation files within {max_bytes} bytes; "
            "both splits need bytes (raise max_bytes)"
        )
    return Corpus(train, val, tuple(names[0]), tuple(names[1]))


class Windows:
    """``len(starts)`` windows of ``length`` bytes of ``stream``: ``windows[idx]`` is ``uint8[len(idx), length]``,
    row ``j`` the bytes from ``starts[idx[j]]`` on. Indexed lazily, so the sampler can draw from many windows
    without them being materialised."""

    def __init__(self, stream: np.ndarray, starts: np.ndarray, length: int):
        if len(starts) and (starts.min() < 0 or starts.max() + length > len(stream)):
            raise ValueError(
                f"windows of {length} bytes at offsets {starts.min()}..{starts.max()} overrun {len(stream)}"
            )
        self.stream, self.starts, self.length = stream, starts, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx) -> np.ndarray:
        return self.stream[self.starts[np.asarray(idx)][..., None] + np.arange(self.length)]


class Bytes:
    """Bytes ``[start, stop)`` of every window of ``windows`` (an array, or :class:`Windows`), read lazily."""

    def __init__(self, windows: Any, start: int, stop: int | None):
        self.windows, self.start, self.stop = windows, start, stop

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, idx) -> np.ndarray:
        return np.asarray(self.windows[idx])[..., self.start : self.stop]


def next_bytes(windows: Any) -> dict[str, Bytes]:
    """``windows`` of ``length + 1`` bytes as the model's ``inputs`` and the ``targets`` one byte on, each
    ``length`` bytes: separate leaves of one shape, so that a context axis splits both alike."""
    return {"inputs": Bytes(windows, 0, -1), "targets": Bytes(windows, 1, None)}


class Packed:
    """The windows of ``windows`` (``length + 1`` bytes each) cut into documents, each row padded at the end.

    Row ``i`` holds documents of ``shortest`` to ``longest`` inputs drawn from ``(seed, i)``, one after another, as
    many as fit in ``length``; the positions after the last are padding (segment 0, input and target 0). Document
    ``j`` of a row takes the window's bytes ``[s_j, e_j]``: inputs ``s_j .. e_j - 1`` and their next bytes as targets,
    so consecutive documents share one byte (the last target of one is the first input of the next) and every target
    is a real byte of the stream. ``packed[idx]`` is a dict of ``int32[len(idx), length]`` arrays: ``inputs``,
    ``targets``, ``segments`` (1, 2, ... per document) and ``positions`` (counted from each document's start)."""

    FIELDS = ("inputs", "targets", "segments", "positions")

    def __init__(self, windows: Any, *, seed: int, shortest: int, longest: int):
        length = windows[np.arange(1)].shape[1] - 1
        if not 1 <= shortest <= longest <= length:
            raise ValueError(f"documents of {shortest} to {longest} bytes must fit windows of {length} (1 <= ...)")
        self.windows, self.seed, self.shortest, self.longest, self.length = windows, seed, shortest, longest, length

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, idx) -> dict[str, np.ndarray]:
        idx = np.asarray(idx)
        rows = np.asarray(self.windows[idx]).astype(np.int32)
        at = np.arange(self.length)
        segments = np.zeros((len(idx), self.length), np.int32)
        positions = np.zeros_like(segments)
        for r, i in enumerate(idx.tolist()):
            # Enough draws to fill any row; the documents that fit whole are kept.
            draws = np.random.default_rng((self.seed, i)).integers(self.shortest, self.longest + 1, self.length)
            ends = np.cumsum(draws)
            ends = ends[ends <= self.length]
            doc = np.searchsorted(ends, at, side="right")  # the document of each position, len(ends) past the last
            real = doc < len(ends)
            segments[r] = np.where(real, doc + 1, 0)
            positions[r] = np.where(real, at - np.concatenate([[0], ends])[np.minimum(doc, len(ends))], 0)
        real = segments > 0
        inputs, targets = np.where(real, rows[:, :-1], 0), np.where(real, rows[:, 1:], 0)
        return {"inputs": inputs, "targets": targets, "segments": segments, "positions": positions}


class Field:
    """One field of :class:`Packed`'s rows, indexed lazily (the loader indexes each leaf of its dataset)."""

    def __init__(self, packed: Packed, name: str):
        self.packed, self.name = packed, name

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, idx) -> np.ndarray:
        return self.packed[idx][self.name]


def packed_bytes(windows: Any, *, seed: int) -> dict[str, Field]:
    """``windows`` of ``length + 1`` bytes as :class:`Packed` rows of documents of ``length / 8`` to ``length / 2``
    inputs: the batch leaves the model and loss read, each ``length`` long, so that a context axis splits them alike
    (a row holds ``length / 2`` to ``length`` real bytes)."""
    length = windows[np.arange(1)].shape[1] - 1
    packed = Packed(windows, seed=seed, shortest=max(length // 8, 1), longest=max(length // 2, 1))
    return {name: Field(packed, name) for name in Packed.FIELDS}


def train_windows(stream: np.ndarray, seq_len: int, *, seed: int) -> Windows:
    """One window of ``seq_len + 1`` bytes (inputs and their next-byte targets) per ``seq_len + 1`` bytes of
    ``stream``, at offsets drawn uniformly from ``seed``: about one pass over the bytes per epoch, at positions
    that do not repeat the same alignment."""
    length = seq_len + 1
    if len(stream) < length:
        raise ValueError(f"{len(stream)} training bytes are fewer than one window of {length}")
    count = len(stream) // length
    starts = np.random.default_rng(seed).integers(0, len(stream) - length + 1, size=count)
    return Windows(stream, starts, length)


def eval_windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """``uint8[n, seq_len + 1]``: ``n = min(count, len(stream) // (seq_len + 1))`` fixed windows that do not overlap,
    spread evenly from the start of ``stream`` to its end."""
    length = seq_len + 1
    n = min(count, len(stream) // length)
    if n < 1:
        raise ValueError(f"{len(stream)} validation bytes are fewer than one window of {length}")
    starts = np.linspace(0, len(stream) - length, n).astype(np.int64)
    return stream[starts[:, None] + np.arange(length)]


def unigram_bits_per_byte(train: np.ndarray, targets: np.ndarray) -> float:
    """Bits per byte of the unigram model on ``targets``: ``-mean(log2 p(b))`` over the bytes ``b`` of ``targets``,
    ``p`` the byte frequencies of ``train`` with one extra count for every byte value (so a byte never seen in
    training costs finite bits)."""
    counts = np.bincount(train.ravel(), minlength=VOCAB).astype(np.float64) + 1.0
    log_p = np.log2(counts / counts.sum())
    seen = np.bincount(targets.ravel(), minlength=VOCAB)
    return float(-(seen * log_p).sum() / seen.sum())


def real_targets(data: dict[str, Any]) -> np.ndarray:
    """Every real target byte of ``data`` (:func:`next_bytes` or :func:`packed_bytes`), for the baseline."""
    rows = np.arange(len(data["targets"]))
    targets = np.asarray(data["targets"][rows])
    return targets[np.asarray(data["segments"][rows]) > 0] if "segments" in data else targets.ravel()


def bits(nats: float) -> float:
    """A loss in nats per byte as bits per byte."""
    return nats / math.log(2)
