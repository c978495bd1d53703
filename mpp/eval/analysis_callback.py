"""EncoderAnalysis: the analyses of mpp.eval.analyses during training, every so many steps and at the
end, written as PNGs and JSON (mpp.eval.figures draws them) and logged to the run's loggers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytorch_lightning as pl
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.strategies import FSDPStrategy
from torch import Tensor, nn

from mpp.data.module import ShardDataModule, ShardSpec, run_shards
from mpp.eval.analyses import DEFAULTS, Analysis, analyse, analysis_data, read_images
from mpp.eval.figures import encoder_figures, save_pictures
from mpp.model.vit import ViT


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
