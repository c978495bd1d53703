"""The pictures of mpp.eval.analyses, as (H, W, 3) uint8 arrays for PNG files and W&B: the filters'
principal components, the position-embedding similarities, the mean attention distances (Figure 7
of the ViT paper) and the class token's attention drawn over images.

Figures are drawn with matplotlib's object API on an Agg canvas, never through pyplot, so that
drawing in a training process touches no global figure state or GUI backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image
from torch import Tensor
from torch.nn import functional as F

from mpp.eval.analyses import Analysis

FILTER_COLUMNS = 7  # 28 components as the paper's 4 x 7


def rendered(figure: Figure) -> np.ndarray:
    """A drawn figure as (H, W, 3) uint8 pixels."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def mosaic(tiles: Tensor, columns: int, *, fill: float) -> Tensor:
    """(n, h, w, c) tiles -> (rows·(h + 1) - 1, columns·(w + 1) - 1, c), row-major, one `fill` pixel between."""
    count, height, width, channels = tiles.shape
    rows = -(-count // columns)
    sheet = torch.full((rows * (height + 1) - 1, columns * (width + 1) - 1, channels), fill)
    for index, tile in enumerate(tiles):
        top, left = (index // columns) * (height + 1), (index % columns) * (width + 1)
        sheet[top : top + height, left : left + width] = tile
    return sheet


def as_rgb(images: Tensor) -> Tensor:
    """(n, C, h, w) with C 1 (grey) or 3 -> (n, h, w, 3)."""
    if images.shape[1] not in (1, 3):
        raise ValueError(f"pictures are drawn in grey (1 channel) or RGB (3 channels), not {images.shape[1]} channels")
    return images.expand(-1, 3, -1, -1).permute(0, 2, 3, 1)


def filters_figure(components: Tensor, explained: Tensor, *, title: str = "") -> np.ndarray:
    """(K, C, P_h, P_w) principal components and their (K,) explained variance -> a picture of one tile
    per component in the image's channels, each scaled to its own range."""
    low = components.flatten(1).min(1).values.view(-1, 1, 1, 1)
    high = components.flatten(1).max(1).values.view(-1, 1, 1, 1)
    tiles = as_rgb((components - low) / (high - low).clamp_min(1e-12))
    columns = min(len(tiles), FILTER_COLUMNS)
    rows = -(-len(tiles) // columns)
    figure = Figure(figsize=(1.0 + 0.9 * columns, 0.9 + 0.9 * rows), dpi=100)
    axes = figure.add_subplot()
    axes.imshow(mosaic(tiles, columns, fill=1.0).numpy(), interpolation="nearest")
    axes.set_axis_off()
    axes.set_title(
        f"{title}{': ' if title else ''}top {len(tiles)} principal components of the filters on the pixels\n"
        f"({100 * float(explained.sum()):.1f}% of their variance)",
        fontsize=9,
    )
    return rendered(figure)


def positions_figure(similarity: Tensor, *, title: str = "") -> np.ndarray:
    """(gh, gw, gh, gw) position-embedding similarities -> a gh x gw grid of gh x gw maps, with a colour bar."""
    grid_h, grid_w = similarity.shape[:2]
    tiles = similarity.flatten(0, 1).unsqueeze(-1)  # (N, gh, gw, 1)
    sheet = mosaic(tiles, grid_w, fill=float("nan"))[..., 0].numpy()
    longest = max(sheet.shape)
    figure = Figure(
        figsize=(1.8 + 5 * sheet.shape[1] / longest, 1.0 + 5 * sheet.shape[0] / longest), dpi=100, layout="constrained"
    )
    axes = figure.add_subplot()
    colours = colormaps["viridis"].with_extremes(bad="white")
    image = axes.imshow(sheet, cmap=colours, vmin=-1, vmax=1, interpolation="nearest")
    centres_h, centres_w = (
        np.arange(grid_h) * (grid_h + 1) + grid_h / 2 - 0.5,
        np.arange(grid_w) * (grid_w + 1) + grid_w / 2 - 0.5,
    )
    axes.set_xticks(centres_w, [str(c + 1) for c in range(grid_w)], fontsize=7)
    axes.set_yticks(centres_h, [str(r + 1) for r in range(grid_h)], fontsize=7)
    axes.tick_params(length=0)
    axes.set_xlabel("input patch column")
    axes.set_ylabel("input patch row")
    axes.set_title(f"{title}{': ' if title else ''}position embedding similarity", fontsize=9)
    figure.colorbar(image, ax=axes, label="cosine similarity", shrink=0.8)
    return rendered(figure)


def distance_figure(distances: Mapping[str, Tensor]) -> np.ndarray:
    """{encoder name: (depth, heads) mean attention distances} -> distance against block, a dot per head."""
    figure = Figure(figsize=(5.0, 3.8), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    spread = 0.12  # encoders side by side at each block, not on top of one another
    for index, (name, values) in enumerate(distances.items()):
        depth, heads = values.shape
        blocks = torch.arange(1, depth + 1).repeat_interleave(heads) + (index - (len(distances) - 1) / 2) * spread
        axes.scatter(blocks.numpy(), values.flatten().numpy(), s=14, alpha=0.8, label=name)
    deepest = max(values.shape[0] for values in distances.values())
    highest = max(float(values.max()) for values in distances.values())
    axes.set_xlim(0.5, deepest + 0.5)
    axes.set_xticks(range(1, deepest + 1, max(1, deepest // 12)))
    axes.set_ylim(0, 1.08 * highest if highest > 0 else 1.0)
    axes.set_xlabel("network depth (block)")
    axes.set_ylabel("mean attention distance (pixels)")
    axes.legend(fontsize=8)
    return rendered(figure)


def maps_figure(rows: Mapping[str, tuple[Tensor, Tensor]]) -> np.ndarray:
    """{encoder name: ((M, C, H, W) images in [0, 1], (M, gh, gw) class-token attention)} -> a row per
    encoder of its images, each with its map upsampled (bilinear) to the image and drawn over it."""
    columns = max(len(images) for images, _ in rows.values())
    aspect = max(images.shape[-2] / images.shape[-1] for images, _ in rows.values())  # height / width
    figure = Figure(
        figsize=(1.8 * columns + 0.4, (1.8 * aspect + 0.1) * len(rows) + 0.3), dpi=100, layout="constrained"
    )
    grid = figure.subplots(len(rows), columns, squeeze=False)
    for row, (name, (images, maps)) in zip(grid, rows.items()):
        upsampled = F.interpolate(maps[:, None].float(), size=images.shape[-2:], mode="bilinear", align_corners=False)
        low, high = upsampled.amin((1, 2, 3), keepdim=True), upsampled.amax((1, 2, 3), keepdim=True)
        upsampled = (upsampled - low) / (high - low).clamp_min(1e-12)  # each map to its own range
        for axes, image, attention in zip(row, as_rgb(images), upsampled[:, 0]):
            axes.imshow(image.clamp(0, 1).numpy())
            axes.imshow(attention.numpy(), cmap="inferno", alpha=0.55, vmin=0, vmax=1)
        for axes in row:
            axes.set_xticks([])
            axes.set_yticks([])
        row[0].set_ylabel(name, fontsize=9)
    figure.suptitle("class token attention in the last block (mean over heads)", fontsize=9)
    return rendered(figure)


def encoder_figures(analysis: Analysis, *, name: str) -> dict[str, np.ndarray]:
    """One encoder's four pictures: filters, positions, attention_distance, attention_maps."""
    return {
        "filters": filters_figure(analysis.components, analysis.explained, title=name),
        "positions": positions_figure(analysis.similarity, title=name),
        "attention_distance": distance_figure({name: analysis.distances}),
        "attention_maps": maps_figure({name: (analysis.images, analysis.maps)}),
    }


def save_pictures(pictures: dict[str, Any], folder: Path) -> None:
    """Write each (H, W, 3) uint8 picture as <folder>/<name>.png."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, picture in pictures.items():
        Image.fromarray(picture).save(folder / f"{name}.png")
