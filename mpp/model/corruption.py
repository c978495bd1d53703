"""Corruption of patch embeddings (appendix B.1.2): choose a fixed share of the patches, scattered
(the paper) or in contiguous blocks (BEiT's block-wise masking), then replace each chosen one by a
learnable [mask] embedding, by another random patch's embedding, or keep it as it is. The choice is drawn before the patches are embedded, so that a
hybrid encoder's pixels can be masked before its stem too.

Every image gets the same number of corrupted patches, so all shapes are static: no
boolean indexing, no per-sample Python loop and no host-device synchronisation, which
keeps the step friendly to `torch.compile` and CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from einops import repeat
from torch import Tensor

from mpp.model.vit import pick

MASKED, REPLACED, KEPT = 0, 1, 2


@dataclass(frozen=True)
class CorruptionConfig:
    """How patches are corrupted; the defaults are the paper's.

    Args:
        ratio: share of patches corrupted per image (the paper: 0.5; 0.15 was slightly worse).
        mask: share of corrupted patches replaced by the [mask] embedding.
        random: share replaced by the embedding of a random other patch of the same image.
        keep: share left as they are (still predicted).
        mask_pixels: for a hybrid encoder, also set the pixels of each [mask]ed patch's region to 0
            (the normalised mean) before the stem, whose receptive field would otherwise carry their
            colour into the neighbours' features. Replaced and kept patches keep their pixels:
            a replaced one still takes another patch's embedding, a kept one is meant to be seen.
        layout: `scattered`: a uniform random subset of the patches (the paper); `blocks`: rectangles
            of patches (BEiT's block-wise masking), see `block_positions`. Either way round(ratio · N).
    """

    ratio: float = 0.5
    mask: float = 0.8
    random: float = 0.1
    keep: float = 0.1
    mask_pixels: bool = False
    layout: Literal["scattered", "blocks"] = "scattered"

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"corruption.ratio must be in (0, 1], got {self.ratio}")
        for name in ("mask", "random", "keep"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"corruption.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.layout not in ("scattered", "blocks"):
            raise ValueError(f"corruption.layout must be scattered or blocks, got {self.layout!r}")
        total = self.mask + self.random + self.keep
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"corruption.mask + corruption.random + corruption.keep must sum to 1, got {total:g} "
                f"({self.mask} + {self.random} + {self.keep})"
            )

    def num_corrupted(self, num_patches: int) -> int:
        """round(ratio · N), at least one patch."""
        return max(1, round(self.ratio * num_patches))


class CorruptionChoice(NamedTuple):
    """Which patches are corrupted and how, drawn before any patch is embedded.

    positions: (B, M) indices of the corrupted patches, M = round(ratio · N).
    kinds: (B, M) what happens to each: MASKED, REPLACED or KEPT.
    sources: (B, M) the patch whose embedding a REPLACED patch receives (its own index otherwise).
    """

    positions: Tensor
    kinds: Tensor
    sources: Tensor


class CorruptedPatches(NamedTuple):
    """The output of `corrupt_patches`: `CorruptionChoice`'s fields, and

    tokens: (B, N, D) patch embeddings after corruption.
    """

    tokens: Tensor
    positions: Tensor
    kinds: Tensor
    sources: Tensor


def block_positions(
    batch: int,
    grid: tuple[int, int],
    count: int,
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, count) patch indices per image, row-major on `grid`, that lie in rectangles of patches.

    As BEiT's block-wise masking: each rectangle covers between N · 16 / 196 patches (BEiT's 16 of
    ViT-B/16's 196) and `count`, at an aspect ratio log-uniform in [0.3, 1 / 0.3], at a uniform place.
    BEiT adds rectangles until enough patches are covered, a number of steps that differs per image;
    here every image draws the same number of rectangles, enough to cover `count` patches twice over
    at their smallest, and takes its first `count` patches in rectangle order (the first rectangle's,
    then the patches the second adds, ...; at random within one), then at random if they cover fewer.
    """
    height, width = grid
    smallest = max(1, round(height * width * 16 / 196))
    blocks = math.ceil(2 * count / smallest)

    def uniform() -> Tensor:
        return torch.rand(batch, blocks, 1, 1, device=device, generator=generator)

    area = smallest + uniform() * (max(count, smallest) - smallest)
    aspect = torch.exp(math.log(0.3) + uniform() * 2 * math.log(1 / 0.3))
    rows = (area * aspect).sqrt().round().clamp(1, height)
    columns = (area / aspect).sqrt().round().clamp(1, width)
    top = (uniform() * (height - rows + 1)).floor()
    left = (uniform() * (width - columns + 1)).floor()
    row = torch.arange(height, device=device).view(1, 1, height, 1)
    column = torch.arange(width, device=device).view(1, 1, 1, width)
    inside = (row >= top) & (row < top + rows) & (column >= left) & (column < left + columns)  # (B, K, H, W)
    rank = torch.arange(blocks, device=device).view(1, blocks, 1, 1)
    first_block = torch.where(inside, rank, blocks).amin(dim=1).flatten(1)  # (B, N): K where no block covers
    order = first_block + torch.rand(batch, height * width, device=device, generator=generator)
    return order.argsort(dim=1)[:, :count]


def choose_corruption(
    batch: int,
    num_patches: int,
    *,
    config: CorruptionConfig = CorruptionConfig(),  # noqa: B008 (frozen: one shared default is safe)
    grid: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> CorruptionChoice:
    """Draw M = round(ratio · N) corrupted patches for each of `batch` images, and what becomes of each.

    Args:
        batch: images B.
        num_patches: patches N per image.
        config: the corruption rate, layout and the mask / random / keep split.
        grid: the patches' (rows, columns), N in all; needed by the `blocks` layout.
        device: where the draws are made and kept.
        generator: a seeded generator on `device` for reproducible draws.
    """
    num_corrupted = config.num_corrupted(num_patches)

    if config.layout == "blocks":
        if grid is None or grid[0] * grid[1] != num_patches:
            raise ValueError(f"the blocks layout needs the grid of the {num_patches} patches, got {grid}")
        positions = block_positions(batch, grid, num_corrupted, device=device, generator=generator)
    else:  # A uniform random subset of M positions per image: the M smallest of N uniform draws.
        noise = torch.rand(batch, num_patches, device=device, generator=generator)
        positions = noise.argsort(dim=1)[:, :num_corrupted]  # (B, M)

    # Each corrupted patch independently becomes masked / replaced / kept (as BERT does).
    draw = torch.rand(batch, num_corrupted, device=device, generator=generator)
    kinds = torch.full_like(positions, KEPT)
    kinds = torch.where(draw < config.mask + config.random, REPLACED, kinds)
    kinds = torch.where(draw < config.mask, MASKED, kinds)

    # "A random other patch": an offset in [1, N) never lands on the patch itself and is
    # uniform over the N - 1 others.
    if num_patches > 1:
        offsets = torch.randint(1, num_patches, positions.shape, device=device, generator=generator)
    else:
        offsets = torch.zeros_like(positions)
    others = (positions + offsets) % num_patches
    return CorruptionChoice(positions, kinds, torch.where(kinds == REPLACED, others, positions))


def apply_corruption(patches: Tensor, choice: CorruptionChoice, *, mask_token: Tensor) -> CorruptedPatches:
    """(B, N, D) patch embeddings, before position embeddings -> `CorruptedPatches`: the [mask] embedding
    (D,) at MASKED positions, the source patch's embedding at REPLACED ones."""
    dim = patches.shape[-1]
    replacement = torch.where(
        (choice.kinds == MASKED).unsqueeze(-1),
        mask_token.to(patches.dtype).expand(*choice.positions.shape, dim),
        pick(patches, choice.sources),  # a patch's own embedding where it is not replaced
    )
    tokens = patches.scatter(1, choice.positions.unsqueeze(-1).expand(-1, -1, dim), replacement)
    return CorruptedPatches(tokens, *choice)


def corrupt_patches(
    patches: Tensor,
    *,
    mask_token: Tensor,
    config: CorruptionConfig = CorruptionConfig(),  # noqa: B008
    grid: tuple[int, int] | None = None,
    generator: torch.Generator | None = None,
) -> CorruptedPatches:
    """(B, N, D) patch embeddings -> `CorruptedPatches` with M = round(ratio · N) per image.

    Args:
        patches: patch embeddings, before position embeddings are added.
        mask_token: the learnable [mask] embedding, shape (D,).
        config: the corruption rate, layout and the mask / random / keep split.
        grid: the patches' (rows, columns); needed by the `blocks` layout.
        generator: a seeded generator on `patches.device` for reproducible draws.
    """
    batch, num_patches, _ = patches.shape
    choice = choose_corruption(batch, num_patches, config=config, grid=grid, device=patches.device, generator=generator)
    return apply_corruption(patches, choice, mask_token=mask_token)


def mask_pixels(images: Tensor, choice: CorruptionChoice, grid: tuple[int, int]) -> Tensor:
    """(B, C, H, W) normalised images -> the same with the pixels of every MASKED token's region set to
    0, the normalised mean; `grid` is the encoder's token grid over the image."""
    masked = torch.zeros(choice.positions.shape[0], grid[0] * grid[1], dtype=torch.bool, device=images.device)
    masked = masked.scatter(1, choice.positions, choice.kinds == MASKED)
    height, width = images.shape[-2:]
    pixels = repeat(masked, "b (gh gw) -> b 1 (gh th) (gw tw)", gh=grid[0], th=height // grid[0], tw=width // grid[1])
    return images.masked_fill(pixels, 0.0)
