"""Pictures of what the pretraining module sees and predicts, one row per image:
original | corrupted input | predicted targets | true targets; PredictionPictures draws them
during training, for PNG files and W&B.

In the corrupted input, masked patches are drawn as a grey checkerboard and replaced
patches show the pixels of the patch whose embedding they received. In the two target
panels the corrupted patches show their (predicted or true) 3-bit colours and the other
patches are dimmed copies of the original.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from einops import rearrange
from PIL import Image
from pytorch_lightning.loggers import WandbLogger
from torch import Tensor

from mpp.model.corruption import MASKED, REPLACED, CorruptedPatches
from mpp.model.pixels import pair, patchify, to_unit_range, unpatchify
from mpp.model.targets import TargetConfig, class_colours
from mpp.model.vit import pick
from mpp.train.pretrain import MaskedPatchPretraining


def target_patches(
    values: Tensor, target: TargetConfig, patch_size: tuple[int, int], channels: int, reference: Tensor
) -> Tensor:
    """(B, M, ...) predictions as classes/pixels -> (B, M, P_h·P_w·C) pixels that show them.

    `reference` (B, M, P_h·P_w·C) is the true patches, used to undo per-patch pixel normalisation.
    """
    if target.kind == "pixels":
        if target.normalise_pixels:
            mean = reference.mean(-1, keepdim=True)
            std = reference.var(-1, keepdim=True, unbiased=False).add(1e-6).sqrt()
            values = values * std + mean
        return values.clamp(0, 1)
    colours = class_colours(values, bits=target.bits, channels=channels)  # (B, M[, S], C)
    if target.kind == "mean_colour":
        return colours.unsqueeze(2).expand(-1, -1, patch_size[0] * patch_size[1], -1).flatten(2)
    # Downsized colour: S = cells² cells, each a block of the patch.
    cells = target.cells
    blocks = rearrange(colours, "b m (ch cw) c -> b m ch cw c", ch=cells)
    blocks = blocks.repeat_interleave(patch_size[0] // cells, 2).repeat_interleave(patch_size[1] // cells, 3)
    return blocks.flatten(2)


def checkerboard(patch_size: tuple[int, int], channels: int) -> Tensor:
    """(P_h·P_w·C) a grey checkerboard that marks a masked patch."""
    rows, cols = torch.meshgrid(torch.arange(patch_size[0]), torch.arange(patch_size[1]), indexing="ij")
    board = 0.35 + 0.3 * (((rows // 2) + (cols // 2)) % 2).float()
    return board.unsqueeze(-1).expand(-1, -1, channels).flatten()


def prediction_panel(
    images: Tensor,
    corrupted: CorruptedPatches,
    predictions: Tensor,
    *,
    target: TargetConfig,
    patch_size: int | tuple[int, int],
    max_images: int = 4,
    min_height: int = 96,
) -> np.ndarray:
    """(B, C, H, W) images in [0, 1] with their corruption and predictions -> (H', W', 3) uint8;
    `patch_size` is the pixels one token stands for (the encoder's `token_size`)."""
    images = images[:max_images].detach().float().cpu()
    batch, channels, height, width = images.shape
    patch = pair(patch_size)
    grid = (height // patch[0], width // patch[1])
    positions = corrupted.positions[:batch].cpu()
    kinds, sources = corrupted.kinds[:batch].cpu(), corrupted.sources[:batch].cpu()
    predictions = predictions[:batch].detach().float().cpu()
    if target.kind != "pixels":
        predictions = predictions.argmax(-1)

    original = patchify(images, patch)  # (B, N, P²C)
    index = positions.unsqueeze(-1).expand(-1, -1, original.shape[-1])
    chosen = original.gather(1, index)
    source_pixels = original.gather(1, sources.unsqueeze(-1).expand_as(chosen))
    shown = torch.where((kinds == REPLACED).unsqueeze(-1), source_pixels, chosen)
    shown = torch.where((kinds == MASKED).unsqueeze(-1), checkerboard(patch, channels).expand_as(chosen), shown)
    corrupted_input = original.scatter(1, index, shown)

    truth = pick(target.compute(images, patch_size=patch), positions)
    dimmed = original * 0.35
    panels = [
        images,
        unpatchify(corrupted_input, grid, patch, channels),
        unpatchify(
            dimmed.scatter(1, index, target_patches(predictions, target, patch, channels, chosen)),
            grid,
            patch,
            channels,
        ),
        unpatchify(
            dimmed.scatter(1, index, target_patches(truth, target, patch, channels, chosen)), grid, patch, channels
        ),
    ]
    if channels == 1:
        panels = [panel.expand(-1, 3, -1, -1) for panel in panels]
    elif channels != 3:
        panels = [panel[:, :3] for panel in panels]
    scale = max(1, -(-min_height // height))
    gap = torch.ones(batch, 3, height, 1)  # a white line between panels
    rows = torch.cat([torch.cat([p, gap], dim=-1) for p in panels], dim=-1)[..., :-1]
    rows = rows.repeat_interleave(scale, -1).repeat_interleave(scale, -2)
    picture = torch.cat([torch.cat([r, torch.ones(3, scale, r.shape[-1])], dim=-2) for r in rows], dim=-2)
    return (picture.permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()


class PredictionPictures(pl.Callback):
    """Every `every_n_steps` steps, draws original | corrupted | predicted | true targets for a
    few training images, saves the PNG under `<default_root_dir>/pictures/` and logs it to W&B.

    Args:
        every_n_steps: how often to draw.
        max_images: how many images (rows) per picture.
    """

    def __init__(self, *, every_n_steps: int = 500, max_images: int = 4) -> None:
        if every_n_steps < 1:
            raise ValueError(f"PredictionPictures.every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.max_images = max_images

    @torch.no_grad()
    def draw(self, pl_module: MaskedPatchPretraining, images: torch.Tensor) -> Any:
        """(B, C, H, W) raw batch images -> (H', W', 3) uint8 picture of the module's predictions."""
        images = to_unit_range(images[: self.max_images])
        was_training = pl_module.training
        pl_module.eval()
        try:
            output = pl_module(images)
        finally:
            pl_module.train(was_training)
        return prediction_panel(
            images,
            output.corrupted,
            output.predictions,
            target=pl_module.target,
            patch_size=pl_module.encoder_config.token_size,
            max_images=self.max_images,
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not trainer.is_global_zero:
            return
        if not isinstance(pl_module, MaskedPatchPretraining):
            raise TypeError(
                f"PredictionPictures draws masked patch predictions; the module is {type(pl_module).__name__}"
            )
        picture = self.draw(pl_module, batch["image"] if isinstance(batch, dict) else batch)
        folder = Path(trainer.default_root_dir) / "pictures"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(picture).save(folder / f"step_{step:07d}.png")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(
                    key="pictures/predictions",
                    images=[picture],
                    step=step,
                    caption=["original | corrupted | predicted | true"],
                )
