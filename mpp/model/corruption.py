"""Corruption of patch embeddings (appendix B.1.2): choose a fixed share of the patches, then
replace each chosen one by a learnable [mask] embedding, by another random patch's
embedding, or keep it as it is.

Every image gets the same number of corrupted patches, so all shapes are static: no
boolean indexing, no per-sample Python loop and no host-device synchronisation, which
keeps the step friendly to `torch.compile` and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
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
    """

    ratio: float = 0.5
    mask: float = 0.8
    random: float = 0.1
    keep: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"corruption.ratio must be in (0, 1], got {self.ratio}")
        for name in ("mask", "random", "keep"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"corruption.{name} must be in [0, 1], got {getattr(self, name)}")
        total = self.mask + self.random + self.keep
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"corruption.mask + corruption.random + corruption.keep must sum to 1, got {total:g} "
                f"({self.mask} + {self.random} + {self.keep})"
            )

    def num_corrupted(self, num_patches: int) -> int:
        """round(ratio · N), at least one patch."""
        return max(1, round(self.ratio * num_patches))


class CorruptedPatches(NamedTuple):
    """The output of `corrupt_patches`.

    tokens: (B, N, D) patch embeddings after corruption.
    positions: (B, M) indices of the corrupted patches, M = round(ratio · N).
    kinds: (B, M) what happened to each: MASKED, REPLACED or KEPT.
    sources: (B, M) the patch whose embedding a REPLACED patch received (its own index otherwise).
    """

    tokens: Tensor
    positions: Tensor
    kinds: Tensor
    sources: Tensor


def corrupt_patches(
    patches: Tensor,
    *,
    mask_token: Tensor,
    config: CorruptionConfig = CorruptionConfig(),
    generator: torch.Generator | None = None,
) -> CorruptedPatches:
    """(B, N, D) patch embeddings -> `CorruptedPatches` with M = round(ratio · N) per image.

    Args:
        patches: patch embeddings, before position embeddings are added.
        mask_token: the learnable [mask] embedding, shape (D,).
        config: the corruption rate and the mask / random / keep split.
        generator: a seeded generator on `patches.device` for reproducible draws.
    """
    batch, num_patches, dim = patches.shape
    num_corrupted = config.num_corrupted(num_patches)
    device = patches.device

    # A uniform random subset of M positions per image: the M smallest of N uniform draws.
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

    original = pick(patches, positions)  # (B, M, D)
    replacement = torch.where(
        (kinds == MASKED).unsqueeze(-1),
        mask_token.to(patches.dtype).expand_as(original),
        torch.where((kinds == REPLACED).unsqueeze(-1), pick(patches, others), original),
    )
    tokens = patches.scatter(1, positions.unsqueeze(-1).expand(-1, -1, dim), replacement)
    sources = torch.where(kinds == REPLACED, others, positions)
    return CorruptedPatches(tokens=tokens, positions=positions, kinds=kinds, sources=sources)
