"""What a trained ViT has learned, as in Figure 7 of Dosovitskiy et al. (2021, section 4.5): the
principal components of the patch-embedding filters (for a hybrid, of its stem's first convolution), the similarity of the position embeddings,
the mean attention distance of every head, and the class token's attention over a few images.

The pure computations take weights, embeddings or attention tensors, so that known answers can
be fed to them; `analyse` reads an encoder and runs them; EncoderAnalysis does so during
training and logs the pictures (mpp.eval.figures) to W&B; tools/analyse.py does so for checkpoints.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytorch_lightning as pl
import torch
from einops import rearrange
from PIL import Image
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.strategies import FSDPStrategy
from torch import Tensor, nn

from mpp.data.module import ShardDataModule, ShardSpec, run_shards
from mpp.eval.figures import encoder_figures
from mpp.model.pixels import Size2d, to_unit_range
from mpp.model.vit import Block, ViT, ViTConfig


@dataclass(frozen=True)
class AnalysisSettings:
    """The defaults of the analyses, for EncoderAnalysis and tools/analyse.py alike (what each
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


def attention_weights(q: Tensor, k: Tensor) -> Tensor:
    """q, k (B, heads, T, d) -> softmax(q kᵀ / √d) (B, heads, T, T), in float32."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.softmax(-1)


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


def explicit_blocks(encoder: ViT, tokens: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    """(B, 1 + N, D) tokens -> for each block in turn, its output (B, 1 + N, D) and its attention
    weights (B, heads, 1 + N, 1 + N), float32.

    Training's blocks run fused attention kernels, which never form the weights; this forward
    forms them with each block's own layers. It reads the blocks' parts (norm1, attn, norm2,
    mlp) as Block.forward composes them, in eval mode: tests compare it with `encoder.encode`,
    so a change to Block that this misses fails there."""
    for module in encoder.blocks:
        block = cast(Block, module)
        q, k, v = block.attn.split_heads(block.norm1(tokens))
        weights = attention_weights(q, k)
        mixed = rearrange(weights.to(v.dtype) @ v, "b h t d -> b t (h d)")
        tokens = tokens + block.attn.proj_drop(block.attn.proj(mixed))
        tokens = tokens + block.mlp(block.norm2(tokens))
        yield tokens, weights


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
                for index, (_, attention) in enumerate(explicit_blocks(encoder, tokens)):
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


def save_pictures(pictures: dict[str, Any], folder: Path) -> None:
    """Write each (H, W, 3) uint8 picture as <folder>/<name>.png."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, picture in pictures.items():
        Image.fromarray(picture).save(folder / f"{name}.png")


class EncoderAnalysis(pl.Callback):
    """Every `every_n_steps` steps and at the end of training, on rank zero: the analyses of the
    module's `encoder` (normalised by its `normalise`), written under
    `<default_root_dir>/analyses/step_<step>/` (PNGs and analysis.json), logged as pictures
    `analysis/<name>` to a W&B logger where there is one, and the mean attention distance of each
    block as `analysis/attention_distance/block_<i>` to every logger.

    Args:
        images: shards the attention is measured on (labels, if any, are ignored), read with the
            evaluation transform at the encoder's size and channels, in shard order; null (the
            default): the run's `data.val` (or `data.test`, else `data.train`).
        num_images: images read (the first of the shards), and averaged over.
        every_n_steps: how often to analyse.
        components: principal components of the patch filters drawn.
        map_images: images whose class-token attention is drawn.
        batch_size: images per forward pass.
    """

    def __init__(
        self,
        *,
        images: ShardSpec | None = None,
        num_images: int = DEFAULTS.num_images,
        every_n_steps: int = DEFAULTS.every_n_steps,
        components: int = DEFAULTS.components,
        map_images: int = DEFAULTS.map_images,
        batch_size: int = DEFAULTS.batch_size,
    ) -> None:
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("num_images", num_images),
            ("components", components),
            ("map_images", map_images),
            ("batch_size", batch_size),
        ):
            if value < 1:
                raise ValueError(f"EncoderAnalysis.{name} must be at least 1, got {value}")
        self.num_images, self.every_n_steps = num_images, every_n_steps
        self.components, self.map_images, self.batch_size = components, map_images, batch_size
        self.given = images
        self.data: ShardDataModule | None = None
        self.images: Tensor | None = None  # read once, at the first analysis
        self.last_step: int | None = None
        self.history: dict[int, dict[str, Any]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.prepare_run(trainer, run_shards(trainer), pl_module)

    def prepare_run(self, trainer: pl.Trainer, run: dict[str, ShardSpec | None], pl_module: pl.LightningModule) -> None:
        """Choose and check the images (`run`: the run's shards, by split) against the module's encoder;
        `mpp` calls it before the run starts too, so that what cannot work stops it before W&B does."""
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "EncoderAnalysis runs the encoder on rank zero alone, which FSDP's sharded "
                "weights do not allow: use DDP or remove the callback"
            )
        images = self.given or run.get("val") or run.get("test") or run.get("train")
        if images is None:
            raise ValueError(
                "EncoderAnalysis: the run has no data.val, data.test or data.train: give EncoderAnalysis.images"
            )
        self.data = analysis_data(images, batch_size=self.batch_size)
        try:  # the images take the size and channels of the module's encoder
            self.data.setup(rank=0, world_size=1, encoder=getattr(pl_module, "encoder_config", None))
        except ValueError as error:
            raise ValueError(f"EncoderAnalysis: {error}".replace("data.", "EncoderAnalysis.")) from None

    def analyse(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Analysis:
        """Analyse the current encoder; write, log and remember the results."""
        step = trainer.global_step
        if self.data is None:
            raise RuntimeError("EncoderAnalysis.analyse before setup")
        if self.images is None:
            self.images = read_images(self.data, self.num_images)
        encoder, normalise = cast(ViT, pl_module.encoder), cast(nn.Module, pl_module.normalise)
        analysis = analyse(
            encoder,
            self.images,
            normalise=normalise,
            components=self.components,
            map_images=self.map_images,
            batch_size=self.batch_size,
        )
        numbers = analysis.numbers()
        self.history[step], self.last_step = numbers, step
        pictures = encoder_figures(analysis, name=f"step {step}")
        folder = Path(trainer.default_root_dir) / "analyses" / f"step_{step:07d}"
        save_pictures(pictures, folder)
        (folder / "analysis.json").write_text(json.dumps(numbers, indent=1))
        metrics = {
            f"analysis/attention_distance/block_{index}": distance
            for index, distance in enumerate(numbers["attention_distance"]["per_block"])
        }
        for logger in trainer.loggers:  # straight to the loggers: `self.log` is not allowed in on_train_end
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, WandbLogger):
                for name, picture in pictures.items():
                    logger.log_image(key=f"analysis/{name}", images=[picture], step=step, caption=[f"step {step}"])
        return analysis

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step % self.every_n_steps == 0 and self.last_step != step:
            self.analyse(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.last_step != trainer.global_step:
            self.analyse(trainer, pl_module)
