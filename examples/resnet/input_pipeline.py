"""The example's data: small colour images of six shapes, generated from a seed (no download, no files).

Each image is ``SIZE x SIZE x 3``: one shape (square, disc, triangle, cross, ring, bar) of random size, position and
colour on a random dark background, with pixel noise. The label is the shape. ``make_split(n, seed)`` always draws
the same images for the same arguments, on every process.
"""

from __future__ import annotations

import numpy as np

SIZE = 16
CLASSES = ("square", "disc", "triangle", "cross", "ring", "bar")


def make_split(n: int, seed: int) -> dict[str, np.ndarray]:
    """``{"image": float32[n, SIZE, SIZE, 3] in [0, 1], "label": int32[n]}``, balanced over the classes."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(CLASSES)).astype(np.int32)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
    images = np.empty((n, SIZE, SIZE, 3), np.float32)
    for i, label in enumerate(labels):
        r = rng.uniform(3.0, 6.5)  # half the shape's extent, in pixels
        cy, cx = rng.uniform(r, SIZE - r, size=2)
        inside = _shape(CLASSES[label], (yy - cy) / r, (xx - cx) / r, rng)
        background = rng.uniform(0.0, 0.4, size=3)
        colour = rng.uniform(0.5, 1.0, size=3)
        image = np.where(inside[..., None], colour, background)
        images[i] = np.clip(image + rng.normal(0.0, 0.08, size=image.shape), 0.0, 1.0)
    return {"image": images, "label": labels}


def _shape(name: str, y: np.ndarray, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Which pixels (coordinates scaled to [-1, 1] around the shape's centre) the shape covers."""
    if name == "square":
        return (np.abs(y) < 0.8) & (np.abs(x) < 0.8)
    if name == "disc":
        return y**2 + x**2 < 0.8
    if name == "triangle":
        return (y < 0.8) & (np.abs(x) < (y + 1.0) * 0.5)
    if name == "cross":
        return ((np.abs(y) < 0.25) & (np.abs(x) < 1.0)) | ((np.abs(x) < 0.25) & (np.abs(y) < 1.0))
    if name == "ring":
        d = y**2 + x**2
        return (d < 1.0) & (d > 0.4)
    # A bar, horizontal or vertical.
    return (np.abs(y) < 0.3) & (np.abs(x) < 1.0) if rng.random() < 0.5 else (np.abs(x) < 0.3) & (np.abs(y) < 1.0)
