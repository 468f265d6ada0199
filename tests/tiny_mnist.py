"""A tiny, learnable MNIST-format data set written at test time (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import input_pipeline as md  # examples/mnist/, on sys.path through tests/conftest.py
import numpy as np

__all__ = ["md", "write_tiny_mnist"]


def write_tiny_mnist(
    d: Path, *, dotted: bool = False, gz: bool = True, n_train: int = 64, n_test: int = 32, seed: int = 0
) -> None:
    """A tiny, learnable MNIST-format data set: the label decides which 7x7 block of the image is bright."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = (rng.random((n, 28, 28)) * 60).astype(np.uint8)
        for i, y in enumerate(labels):
            r, c = divmod(int(y), 4)
            images[i, 7 * r : 7 * r + 7, 7 * c : 7 * c + 7] = 250
        for kind, arr, idx in (("images", images, "idx3"), ("labels", labels, "idx1")):
            name = f"{split}-{kind}.{idx}-ubyte" if dotted else f"{split}-{kind}-{idx}-ubyte"
            md.write_idx(d / (name + (".gz" if gz else "")), arr)
