"""The ResNet-v2 stem of the hybrid encoder (Dosovitskiy et al. 2021, sections 3.1 and 4.2): the ViT's
patches are cut from this CNN's feature map instead of from the image.

As in BiT and the paper's hybrids: weight-standardised convolutions, GroupNorm of 32 groups, ReLU,
a 7×7 stride-2 root with a 3×3 stride-2 max pool, then stages of bottleneck blocks, the first stage
at stride 1 and every later one at stride 2 (the 3×3 convolution striding). The convolutions and
the pool pad "SAME" (TensorFlow's rule), as the reference implementation, so that a stride-2 layer
pads its even input on the bottom and right only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

GROUPS = 32  # GroupNorm groups, as BiT


@dataclass(frozen=True)
class StemConfig:
    """The ResNet-v2 stem of a hybrid encoder.

    Args:
        layers: bottleneck blocks per stage; ResNet-50's first three stages, (3, 4, 9), give the
            paper's R50 hybrid at stride 16. Empty: the root alone, at stride 4.
        width: channels of the root convolution; stage i has width·2^i channels inside its blocks
            and 4·width·2^i out. A multiple of 32, for the GroupNorm's groups.
    """

    layers: tuple[int, ...]
    width: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(blocks) for blocks in self.layers))
        if any(blocks < 1 for blocks in self.layers):
            raise ValueError(f"encoder.stem.layers must each be at least 1 block, got {list(self.layers)}")
        if self.width < GROUPS or self.width % GROUPS:
            raise ValueError(
                f"encoder.stem.width must be a multiple of {GROUPS} (the GroupNorm groups), got {self.width}"
            )

    @property
    def stride(self) -> int:
        """Pixels per feature-map cell along each axis: 4 for the root, ×2 for every stage after the first."""
        return 4 * 2 ** max(len(self.layers) - 1, 0)

    @property
    def out_channels(self) -> int:
        """Channels of the feature map the patches are cut from."""
        return 4 * self.width * 2 ** (len(self.layers) - 1) if self.layers else self.width


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of one axis so that the output has ceil(size / stride) cells."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: Tensor, kernel: int, stride: int, value: float = 0.0) -> Tensor:
    """(B, C, H, W) -> (B, C, H', W') padded "SAME" for a `kernel` × `kernel` window at `stride`."""
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """A bias-free convolution whose every filter is standardised to zero mean and unit variance
    before use (weight standardisation, which BiT pairs with GroupNorm), padded "SAME"."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, bias=False)

    def standardised_weight(self) -> Tensor:
        """(out, in, k, k) the filters as applied."""
        weight = self.weight
        mean = weight.mean((1, 2, 3), keepdim=True)
        var = weight.var((1, 2, 3), keepdim=True, unbiased=False)
        return (weight - mean) / (var + 1e-8).sqrt()  # eps as timm's hybrids: exports compute as timm does

    def forward(self, x: Tensor) -> Tensor:
        """(B, C_in, H, W) -> (B, C_out, ceil(H / stride), ceil(W / stride))."""
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, self.standardised_weight(), stride=self.stride)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=1e-5)


class Downsample(nn.Module):
    """The projection shortcut of a stage's first block: a strided 1×1 convolution and GroupNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv = StdConv2d(in_channels, out_channels, 1, stride=stride)
        self.norm = group_norm(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1×1 down to `mid` channels, 3×3 (strided), 1×1 up to `out`, each followed by GroupNorm, ReLU
    after all but the last; ReLU after the residual sum (the post-activation block the ViT hybrid uses)."""

    def __init__(self, in_channels: int, mid: int, out: int, stride: int) -> None:
        super().__init__()
        self.downsample = Downsample(in_channels, out, stride) if stride != 1 or in_channels != out else nn.Identity()
        self.conv1, self.norm1 = StdConv2d(in_channels, mid, 1), group_norm(mid)
        self.conv2, self.norm2 = StdConv2d(mid, mid, 3, stride=stride), group_norm(mid)
        self.conv3, self.norm3 = StdConv2d(mid, out, 1), group_norm(out)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C_in, H, W) -> (B, C_out, H / stride, W / stride)."""
        shortcut = self.downsample(x)
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        return F.relu(self.norm3(self.conv3(x)) + shortcut)


class Stage(nn.Module):
    """Bottleneck blocks at one resolution; the first one strides and projects the shortcut."""

    def __init__(self, in_channels: int, mid: int, *, blocks: int, stride: int) -> None:
        super().__init__()
        out = 4 * mid
        self.blocks = nn.Sequential(
            *(Bottleneck(in_channels if i == 0 else out, mid, out, stride if i == 0 else 1) for i in range(blocks))
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


class ResNetStem(nn.Module):
    """(B, C, H, W) images -> (B, out_channels, H / stride, W / stride) features (see `StemConfig`)."""

    def __init__(self, config: StemConfig, *, channels: int) -> None:
        super().__init__()
        self.conv = StdConv2d(channels, config.width, 7, stride=2)
        self.norm = group_norm(config.width)
        self.stages = nn.Sequential(
            *(
                Stage(
                    4 * config.width * 2 ** (i - 1) if i else config.width,
                    config.width * 2**i,
                    blocks=blocks,
                    stride=2 if i else 1,
                )
                for i, blocks in enumerate(config.layers)
            )
        )
        for module in self.modules():
            if isinstance(module, StdConv2d):  # as ResNets: He-normal over the fan-out
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        x = F.relu(self.norm(self.conv(images)))
        # Padding with -inf, never the maximum: the pool takes only real cells.
        x = F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, stride=2)
        return self.stages(x)
