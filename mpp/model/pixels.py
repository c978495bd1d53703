"""Pixel conventions shared by the modules: batches arrive as uint8 (or float in [0, 1]);
targets are computed from those raw pixels and the encoder sees normalised ones; images are
cut into patches (and put back together) in one order, row-major with pixels (p_h, p_w, c)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor, nn

Size2d = tuple[int, int]


def to_unit_range(images: Tensor) -> Tensor:
    """(B, C, H, W) uint8 in [0, 255] or float in [0, 1] -> float32 in [0, 1]."""
    if images.dtype == torch.uint8:
        return images.float().div_(255.0)
    return images.float()


class Normalise(nn.Module):
    """(B, C, H, W) in [0, 1] -> (x - mean) / std, per channel; `invert` undoes it.

    Args:
        mean: one value for every channel, or one per channel.
        std: likewise.
    """

    mean: Tensor  # (1, C, 1, 1) buffers
    std: Tensor

    def __init__(self, *, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"normalisation mean {list(mean)} and std {list(std)} differ in length")
        if any(s <= 0 for s in std):
            raise ValueError(f"normalisation std must be positive, got {list(std)}")
        # Non-persistent: the values belong to the config, not to the checkpoint.
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    def check_channels(self, channels: int) -> None:
        """Fail early, naming the setting, when mean/std fit neither 1 nor `channels` channels."""
        if self.mean.shape[1] not in (1, channels):
            raise ValueError(
                f"normalisation has {self.mean.shape[1]} values but the encoder has {channels} channels: "
                "give one value or one per channel"
            )

    def forward(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        return (images - self.mean) / self.std

    def invert(self, images: Tensor) -> Tensor:
        """(B, C, H, W) normalised -> (B, C, H, W) in [0, 1]."""
        return images * self.std + self.mean


def pair(value: int | tuple[int, int] | list[int]) -> Size2d:
    """An int or a (height, width) pair as a (height, width) tuple."""
    if isinstance(value, int):
        return (value, value)
    height, width = value
    return (int(height), int(width))


def patchify(images: Tensor, patch_size: int | tuple[int, int]) -> Tensor:
    """(B, C, H, W) -> (B, N, P_h·P_w·C), patches in row-major order, pixels (p_h, p_w, c)."""
    patch_h, patch_w = pair(patch_size)
    return rearrange(images, "b c (gh ph) (gw pw) -> b (gh gw) (ph pw c)", ph=patch_h, pw=patch_w)


def unpatchify(patches: Tensor, grid: tuple[int, int], patch_size: tuple[int, int], channels: int) -> Tensor:
    """(B, N, P_h·P_w·C) -> (B, C, H, W), the inverse of `patchify`."""
    return rearrange(
        patches, "b (gh gw) (ph pw c) -> b c (gh ph) (gw pw)", gh=grid[0], gw=grid[1], ph=patch_size[0], c=channels
    )
