"""What a trained ViT has learned, as in Figure 7 of Dosovitskiy et al. (2021, section 4.5): the
principal components of the patch-embedding filters (for a hybrid, of its stem's first
convolution), the similarity of the position embeddings, the mean attention distance of every
head, and the class token's attention over a few images.

The pure computations take weights, embeddings or attention tensors, so that known answers can
be fed to them; `analyse` reads an encoder and runs them, with the attention weights its blocks
form on request (`Block(..., return_attention=True)`). mpp.eval.figures draws an Analysis;
EncoderAnalysis (mpp.eval.analysis_callback) analyses during training, mpp analyse checkpoints.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mpp.data.module import ShardDataModule, ShardSpec
from mpp.model.pixels import Size2d, to_unit_range
from mpp.model.vit import ViT, ViTConfig


@dataclass(frozen=True)
class AnalysisSettings:
    """The defaults of the analyses, for EncoderAnalysis and mpp analyse alike (what each
    means: EncoderAnalysis's Args). The paper averages attention distances over 128 images."""

    num_images: int = 128
    components: int = 28
    map_images: int = 4
    batch_size: int = 32
    every_n_steps: int = 1000
    eval_crop_fraction: float = 1.0


DEFAULTS = AnalysisSettings()


def filter_components(weight: Tensor, count: int = DEFAULTS.components) -> tuple[Tensor, Tensor]:
    """(D, C, P_h, P_w) patch-projection filters -> the top `count` principal components (K, C, P_h, P_w)
    and the share of the filters' variance each explains (K,), K = min(count, D, C·P_h·P_w).

    Each component's sign is chosen so that its largest entry is positive: pictures do not flip
    between runs of the same weights."""
    flat = weight.detach().float().flatten(1)  # (D, C·P_h·P_w)
    centred = flat - flat.mean(0, keepdim=True)
    _, singular, directions = torch.linalg.svd(centred, full_matrices=False)
    variance = singular.square()
    explained = variance / variance.sum().clamp_min(torch.finfo(variance.dtype).tiny)
    count = min(count, len(singular))
    top = directions[:count]
    signs = top.gather(1, top.abs().argmax(1, keepdim=True)).sign()
    top = top * torch.where(signs == 0, torch.ones_like(signs), signs)
    return top.reshape(count, *weight.shape[1:]), explained[:count]


def position_similarity(positions: Tensor, grid: Size2d) -> Tensor:
    """(N, D) patch position embeddings, class token left out -> (gh, gw, gh, gw) cosine similarity:
    [r, c] is the map of position (r, c)'s similarity to every position."""
    unit = nn.functional.normalize(positions.detach().float(), dim=-1)
    return rearrange(unit @ unit.T, "(r c) (gh gw) -> r c gh gw", r=grid[0], gh=grid[0])


def patch_attention(weights: Tensor) -> Tensor:
    """(B, heads, 1 + N, 1 + N) attention with the class token first -> (B, heads, N, N) among the
    patches alone, each row renormalised to sum 1."""
    patches = weights[..., 1:, 1:]
    return patches / patches.sum(-1, keepdim=True).clamp_min(torch.finfo(patches.dtype).tiny)


def patch_centres(grid: Size2d, patch_size: Size2d) -> Tensor:
    """(N, 2) pixel coordinates (row·P_h + P_h/2, col·P_w + P_w/2) of the patch centres, row-major."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([rows * patch_size[0] + patch_size[0] / 2, cols * patch_size[1] + patch_size[1] / 2], -1)
    return centres.flatten(0, 1).float()


def mean_attention_distance(attention: Tensor, grid: Size2d, patch_size: Size2d) -> Tensor:
    """(B, heads, N, N) attention among patches, rows summing to 1 -> (heads,): the attention-weighted
    pixel distance from a query patch to the patches it attends to, averaged over queries and images."""
    centres = patch_centres(grid, patch_size).to(attention.device)
    distances = torch.cdist(centres, centres)  # (N, N)
    return (attention.float() * distances).sum(-1).mean((0, 2))


def class_token_maps(weights: Tensor, grid: Size2d) -> Tensor:
    """(B, heads, 1 + N, 1 + N) attention with the class token first -> (B, gh, gw): the class token's
    attention to the patches, averaged over heads and renormalised to sum 1 over the patches."""
    to_patches = weights[:, :, 0, 1:].float().mean(1)
    to_patches = to_patches / to_patches.sum(-1, keepdim=True).clamp_min(torch.finfo(to_patches.dtype).tiny)
    return rearrange(to_patches, "b (gh gw) -> b gh gw", gh=grid[0])


@dataclass(frozen=True)
class Analysis:
    """The analyses of one encoder, on the CPU in float32."""

    components: Tensor  # (K, C, P_h, P_w) principal components of the filters that see the pixels
    explained: Tensor  # (K,) share of the filters' variance each component explains
    similarity: Tensor  # (gh, gw, gh, gw) cosine similarity of the position embeddings
    distances: Tensor  # (depth, heads) mean attention distance in pixels
    images: Tensor  # (M, C, H, W) in [0, 1]: the first images analysed
    maps: Tensor  # (M, gh, gw) the last block's class-token attention over those images
    patch_size: Size2d  # the pixels of one token
    num_images: int

    def numbers(self) -> dict[str, Any]:
        """The numbers as JSON-able data; the position similarities are left out (gh²·gw² values
        for each encoder: 38,416 for ViT-B/16 at 224 px), as the positions picture shows them."""
        return {
            "grid": list(self.similarity.shape[:2]),
            "patch_size": list(self.patch_size),
            "num_images": self.num_images,
            "filters": {"explained_variance_ratio": self.explained.tolist()},
            "attention_distance": {
                "unit": "pixels",
                "per_head": self.distances.tolist(),
                "per_block": self.distances.mean(1).tolist(),
            },
        }


@torch.no_grad()
def analyse(
    encoder: ViT,
    images: Tensor,
    *,
    normalise: nn.Module,
    components: int = DEFAULTS.components,
    map_images: int = DEFAULTS.map_images,
    batch_size: int = DEFAULTS.batch_size,
) -> Analysis:
    """(B, C, H, W) images, uint8 or in [0, 1], of the encoder's size -> the encoder's Analysis.

    Runs on the encoder's device, in float32 whatever the autocast or the weights' dtype (weights
    that are not float32 are copied to float32), in eval mode, `batch_size` images at a time; the
    encoder's mode is restored after."""
    if len(images) == 0:
        raise ValueError("no images to analyse the encoder's attention on")
    if min(components, map_images, batch_size) < 1:
        raise ValueError(
            f"components ({components}), map_images ({map_images}) and batch_size ({batch_size}) must be at least 1"
        )
    weights = next(encoder.parameters())
    if weights.dtype != torch.float32:
        encoder = copy.deepcopy(encoder).float()
    was_training = encoder.training
    encoder.eval()
    grid, patch = encoder.grid, encoder.config.token_size  # a token's pixels, whatever the stem
    distances = torch.zeros(encoder.config.depth, encoder.config.heads, device=weights.device)
    maps = []
    try:
        with torch.autocast(weights.device.type, enabled=False):
            for start in range(0, len(images), batch_size):
                batch = to_unit_range(images[start : start + batch_size].to(weights.device))
                tokens = encoder.add_positions(encoder.embed_patches(normalise(batch)))
                for index, block in enumerate(encoder.blocks):
                    tokens, attention = block(tokens, return_attention=True)
                    distances[index] += mean_attention_distance(patch_attention(attention), grid, patch) * len(batch)
                    if index == encoder.config.depth - 1 and start < map_images:
                        maps.append(class_token_maps(attention[: map_images - start], grid))
    finally:
        encoder.train(was_training)
    filters, explained = filter_components(encoder.pixel_filters(), components)
    return Analysis(
        components=filters.cpu(),
        explained=explained.cpu(),
        similarity=position_similarity(encoder.pos_embed[0, 1:], grid).cpu(),
        distances=(distances / len(images)).cpu(),
        images=to_unit_range(images[:map_images]).cpu(),
        maps=torch.cat(maps).cpu(),
        patch_size=patch,
        num_images=len(images),
    )


def analysis_data(images: ShardSpec, *, batch_size: int) -> ShardDataModule:
    """The shards analysed, read as the `val` split in the calling process: evaluation transform, shard order."""
    return ShardDataModule(
        val=images,
        batch_size=batch_size,
        num_workers=0,
        eval_crop_fraction=DEFAULTS.eval_crop_fraction,
        shard_shuffle=False,
        shuffle_buffer=0,
    )


def read_images(data: ShardDataModule, count: int) -> Tensor:
    """The first `count` images (N, C, H, W) uint8 of a set-up analysis_data module (fewer if the shards
    hold fewer)."""
    batches, seen = [], 0
    for batch in data.val_dataloader():
        batches.append(batch["image"][: count - seen])
        seen += len(batches[-1])
        if seen >= count:
            break
    if not seen:
        raise ValueError(f"no images in the shards {data.specs['val']!r} to analyse the encoder on")
    return torch.cat(batches)


def sized_images(images: ShardSpec, encoder: ViTConfig, count: int, *, batch_size: int = DEFAULTS.batch_size) -> Tensor:
    """The first `count` images of shards, at the encoder's image size and channels, uint8 (N, C, H, W)."""
    data = analysis_data(images, batch_size=batch_size)
    data.setup(rank=0, world_size=1, encoder=encoder)
    return read_images(data, count)
