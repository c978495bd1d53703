"""What masked patch prediction predicts for each patch (appendix B.1.2).

The paper's choice is the 3-bit mean colour of the patch (512 classes for RGB). Its two
alternatives, a 4×4 downsized patch in 3-bit colours and L2 regression on the pixels,
are here too. All targets are computed from un-normalised pixels in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mpp.model.pixels import Normalise, pair, patchify

TargetKind = Literal["mean_colour", "downsized_colour", "pixels"]


def unnormalise(images: Tensor, mean: Sequence[float] | None, std: Sequence[float] | None) -> Tensor:
    """(B, C, H, W) normalised images -> the same images in [0, 1] (no-op without mean/std)."""
    if mean is None and std is None:
        return images
    if mean is None or std is None:
        raise ValueError("pass both mean and std to undo a normalisation, or neither")
    return Normalise(mean=mean, std=std).to(images.device).invert(images)


def quantise_colours(values: Tensor, bits: int) -> Tensor:
    """(..., C) intensities in [0, 1] -> (...) colour classes, channel 0 most significant.

    Each channel becomes min(floor(2^bits · value), 2^bits - 1); for RGB at 3 bits the class
    is r·64 + g·8 + b, one of 512.
    """
    levels = 2**bits
    quantised = (values * levels).floor().clamp_(0, levels - 1).long()
    weights = levels ** torch.arange(values.shape[-1] - 1, -1, -1, device=values.device)
    return (quantised * weights).sum(dim=-1)


def mean_colour_targets(
    images: Tensor,
    *,
    patch_size: int | tuple[int, int],
    bits: int = 3,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Tensor:
    """(B, C, H, W) images in [0, 1] -> (B, N) class of each patch's mean colour.

    Pass the `mean` and `std` of a normalisation to compute targets from normalised images.
    """
    images = unnormalise(images, mean, std)
    patch_h, patch_w = pair(patch_size)
    # Mean over each patch in float32: bf16 would move means across level boundaries.
    means = F.avg_pool2d(images.float(), kernel_size=(patch_h, patch_w))  # (B, C, gh, gw)
    return quantise_colours(rearrange(means, "b c gh gw -> b (gh gw) c"), bits)


def downsized_colour_targets(
    images: Tensor, *, patch_size: int | tuple[int, int], cells: int = 4, bits: int = 3
) -> Tensor:
    """(B, C, H, W) images in [0, 1] -> (B, N, cells²) colour class of each cell of each
    patch downsized to cells × cells (the paper's 4×4, 16 predictions per patch)."""
    patch_h, patch_w = pair(patch_size)
    if patch_h % cells or patch_w % cells:
        raise ValueError(f"patch size {(patch_h, patch_w)} must be divisible by target cells {cells}")
    means = F.avg_pool2d(images.float(), kernel_size=(patch_h // cells, patch_w // cells))
    cell_colours = rearrange(means, "b c (gh ch) (gw cw) -> b (gh gw) (ch cw) c", ch=cells, cw=cells)
    return quantise_colours(cell_colours, bits)


def pixel_targets(images: Tensor, *, patch_size: int | tuple[int, int], normalise: bool = True) -> Tensor:
    """(B, C, H, W) images in [0, 1] -> (B, N, P_h·P_w·C) pixels of each patch, optionally
    normalised per patch to zero mean and unit variance (as MAE found helpful)."""
    pixels = patchify(images.float(), patch_size)
    if normalise:
        mean = pixels.mean(dim=-1, keepdim=True)
        var = pixels.var(dim=-1, keepdim=True, unbiased=False)
        pixels = (pixels - mean) / (var + 1e-6).sqrt()
    return pixels


@dataclass(frozen=True)
class TargetConfig:
    """Which target to predict for every corrupted patch.

    Args:
        kind: `mean_colour` (the paper's best), `downsized_colour` or `pixels` (L2).
        bits: colour bits per channel for the colour targets.
        cells: the downsized patch is cells × cells for `downsized_colour`.
        normalise_pixels: per-patch normalised pixels for `pixels`.
    """

    kind: TargetKind = "mean_colour"
    bits: int = 3
    cells: int = 4
    normalise_pixels: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("mean_colour", "downsized_colour", "pixels"):
            raise ValueError(f"target.kind must be mean_colour, downsized_colour or pixels, got {self.kind!r}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"target.bits must be in 1..8, got {self.bits}")
        if self.cells < 1:
            raise ValueError(f"target.cells must be at least 1, got {self.cells}")

    def predictions_per_patch(self) -> int:
        """How many predictions the head makes per patch: 1 or cells²."""
        return self.cells**2 if self.kind == "downsized_colour" else 1

    def outputs_per_prediction(self, *, channels: int, patch_size: int | tuple[int, int]) -> int:
        """Classes per prediction (2^(bits·C)), or regressed values (P_h·P_w·C) for pixels."""
        if self.kind == "pixels":
            patch_h, patch_w = pair(patch_size)
            return patch_h * patch_w * channels
        return 2 ** (self.bits * channels)

    def compute(self, images: Tensor, *, patch_size: int | tuple[int, int]) -> Tensor:
        """(B, C, H, W) in [0, 1] -> (B, N) classes, (B, N, cells²) classes or (B, N, P²C) pixels."""
        if self.kind == "mean_colour":
            return mean_colour_targets(images, patch_size=patch_size, bits=self.bits)
        if self.kind == "downsized_colour":
            return downsized_colour_targets(images, patch_size=patch_size, cells=self.cells, bits=self.bits)
        return pixel_targets(images, patch_size=patch_size, normalise=self.normalise_pixels)


def prediction_loss(predictions: Tensor, targets: Tensor) -> Tensor:
    """Mean loss over every prediction: cross-entropy for classes, L2 for pixels.

    predictions: (B, M, K) logits with targets (B, M); (B, M, S, K) logits with targets
    (B, M, S); or (B, M, P²C) values with float targets of the same shape.
    """
    if targets.is_floating_point():
        return F.mse_loss(predictions.float(), targets)
    return F.cross_entropy(predictions.flatten(0, -2).float(), targets.flatten())


def prediction_accuracy(predictions: Tensor, targets: Tensor) -> Tensor:
    """Share of class predictions that are right (a scalar tensor; no host sync)."""
    return (predictions.argmax(dim=-1) == targets).float().mean()


def class_colours(classes: Tensor, *, bits: int, channels: int) -> Tensor:
    """(...) colour classes -> (..., C) the centre of each class's colour cell, in [0, 1]."""
    levels = 2**bits
    digits = [(classes // levels ** (channels - 1 - c)) % levels for c in range(channels)]
    return (torch.stack(digits, dim=-1).float() + 0.5) / levels
