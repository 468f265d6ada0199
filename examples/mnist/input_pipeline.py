"""The example's data: MNIST with strict IDX parsing, an optional checked download, and an offline fallback.

``load_dataset("mnist", data_dir)`` reads the four IDX files (gzipped or not, spelled
``train-images-idx3-ubyte[.gz]`` or ``train-images.idx3-ubyte``). ``download_mnist(data_dir)`` fetches them from
the standard mirrors and verifies their MD5 checksums. ``load_dataset("digits")`` is scikit-learn's bundled
8x8 handwritten digits (1,797 real images, shipped with the package), upsampled to 28x28 so the same model
trains on it; the example falls back to it when MNIST is absent and cannot be downloaded.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
FILES = {  # role -> (gzipped file name on the mirrors, md5 of that file)
    "train_images": ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train_labels": ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
    "test_images": ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
    "test_labels": ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
}
IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
DEFAULT_CACHE = Path(os.environ.get("SPMDCOMM_DATA", Path.home() / ".cache" / "spmdcomm" / "mnist"))


class DatasetError(RuntimeError):
    """A data file is missing, truncated or not what its name says."""


@dataclass(frozen=True)
class Dataset:
    """Images as float32 in [0, 1] with shape (N, 28, 28, 1) and int32 labels, train and test."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def read_idx(path: str | Path) -> np.ndarray:
    """Reads one IDX file (optionally gzipped). Raises :class:`DatasetError` unless it is exactly well-formed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DatasetError(f"{path}: cannot read ({e}); delete it and download again.") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'}).")
    dtype, ndim = np.dtype(IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated header ({len(raw)} bytes, needs {header}).")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    want = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != want:
        kind = "truncated" if len(raw) < want else "has trailing bytes"
        raise DatasetError(f"{path}: {kind}: header says shape {shape} ({want} bytes), file has {len(raw)}.")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def find_mnist(data_dir: str | Path) -> dict[str, Path] | None:
    """The paths of the four MNIST files in ``data_dir`` under any common spelling, or None if any is missing."""
    data_dir = Path(data_dir)
    found = {}
    for role, (gz_name, _) in FILES.items():
        base = gz_name[: -len(".gz")]  # e.g. train-images-idx3-ubyte
        dotted = base.replace("-idx", ".idx")  # e.g. train-images.idx3-ubyte
        candidates = [data_dir / n for n in (base, base + ".gz", dotted, dotted + ".gz")]
        hit = next((p for p in candidates if p.is_file()), None)
        if hit is None:
            return None
        found[role] = hit
    return found


def load_mnist(data_dir: str | Path) -> Dataset:
    """Loads MNIST from ``data_dir``; raises :class:`DatasetError` naming what is missing or malformed."""
    paths = find_mnist(data_dir)
    if paths is None:
        raise DatasetError(
            f"MNIST not found in {data_dir} (need the four IDX files, e.g. "
            "train-images-idx3-ubyte.gz); pass --download or --data-dir."
        )
    arrays = {role: read_idx(p) for role, p in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DatasetError(f"{data_dir}: {split} images {images.shape} and labels {labels.shape} do not match.")
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise DatasetError(f"{data_dir}: {split} labels outside 0..9.")
    return Dataset("mnist", *_unpack(arrays))


def download_mnist(data_dir: str | Path, *, timeout: float = 30.0) -> None:
    """Downloads the four gzipped IDX files into ``data_dir`` from the first mirror that works; checks MD5."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    for gz_name, md5 in FILES.values():
        target = data_dir / gz_name
        if target.is_file() and _md5(target.read_bytes()) == md5:
            continue
        errors = []
        for mirror in MIRRORS:
            try:
                with urllib.request.urlopen(mirror + gz_name, timeout=timeout) as response:
                    payload = response.read()
            except OSError as e:
                errors.append(f"{mirror}: {e}")
                continue
            if _md5(payload) != md5:
                errors.append(f"{mirror}: checksum mismatch")
                continue
            tmp = target.with_suffix(".part")
            tmp.write_bytes(payload)
            tmp.replace(target)  # atomic: a failed download never leaves a half file under the real name
            break
        else:
            raise DatasetError(f"could not download {gz_name}: " + "; ".join(errors))


def load_digits_28() -> Dataset:
    """scikit-learn's bundled 8x8 digits, upsampled to 28x28, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # values 0..16
    # 8x8 -> 24x24 by pixel repetition, padded to 28x28 like MNIST's centred 20x20 box in 28x28.
    images = np.pad(images.repeat(3, axis=1).repeat(3, axis=2), ((0, 0), (2, 2), (2, 2)))
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(order))
    tr, te = order[:cut], order[cut:]
    return Dataset("digits", images[tr, ..., None], labels[tr], images[te, ..., None], labels[te])


def load_dataset(name: str, data_dir: str | Path | None = None, *, download: bool = False) -> Dataset:
    """``"mnist"`` (from ``data_dir``, downloading if asked), ``"digits"``, or ``"auto"``: MNIST if present or
    downloadable, otherwise digits (with a message saying so)."""
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_CACHE
    if name == "digits":
        return load_digits_28()
    if name not in ("mnist", "auto"):
        raise ValueError(f"unknown dataset {name!r}; use 'mnist', 'digits' or 'auto'.")
    if find_mnist(data_dir) is None and download:
        try:
            download_mnist(data_dir)
        except DatasetError as e:
            if name == "mnist":
                raise
            print(f"MNIST download failed ({e}).")
    if find_mnist(data_dir) is None and name == "auto":
        print(
            f"MNIST not found in {data_dir}: training on scikit-learn's bundled digits instead "
            "(pass --download, or --data-dir with the IDX files, for MNIST)."
        )
        return load_digits_28()
    return load_mnist(data_dir)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Writes ``array`` (uint8) as an IDX file, gzipped when the name ends in .gz (for tests and tiny data)."""
    array = np.ascontiguousarray(array, np.uint8)
    payload = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def _prepare(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return images.astype(np.float32)[..., None] / 255.0, labels.astype(np.int32)


def _unpack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    return (
        *_prepare(arrays["train_images"], arrays["train_labels"]),
        *_prepare(arrays["test_images"], arrays["test_labels"]),
    )


def _md5(payload: bytes) -> str:
    return hashlib.md5(payload).hexdigest()  # noqa: S324 - the mirrors publish MD5 sums
