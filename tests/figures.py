"""What a drawn figure must show: an image of a real size with something drawn on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def assert_drawn(path: Path, min_width: int = 300, min_height: int = 200) -> np.ndarray:
    """``path`` decodes as a PNG of at least ``min_width`` x ``min_height`` pixels holding
    more than a blank canvas: many colours (lines, text, a colour map) and ink on a good
    share of its rows. Returns the image, (H, W, channels) floats in [0, 1]."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert width >= min_width and height >= min_height, (path, image.shape)
    rgb = image[..., :3].reshape(-1, 3)
    colours = np.unique((rgb * 255).round().astype(np.uint8), axis=0)
    assert len(colours) > 16, f"{path}: {len(colours)} colours, a nearly blank image"
    inked_rows = (image[..., :3].min(axis=2) < 0.9).any(axis=1).mean()
    assert inked_rows > 0.3, f"{path}: ink on only {inked_rows:.0%} of the rows"
    return image
