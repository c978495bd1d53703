"""MaskedPatchPretraining: the self-supervised objective of section 4.6 as a LightningModule.

shards -> batch -> targets (raw pixels) -> normalise -> embed patches -> corrupt
-> add positions -> blocks -> head on corrupted positions -> loss
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from mpp.model.corruption import CorruptedPatches, CorruptionConfig, corrupt_patches
from mpp.model.pixels import Normalise, to_unit_range
from mpp.model.targets import TargetConfig, prediction_accuracy, prediction_loss
from mpp.model.vit import ViT, ViTConfig, pick
from mpp.train.guards import LossGuard, LossGuardCheck, Policy
from mpp.train.optim import (
    OptimizerConfig,
    configure_optimizer,
    global_batch_size,
    log_nothing,
    logging_step,
    total_steps,
)


class MPPOutput(NamedTuple):
    """predictions: (B, M, K), (B, M, S, K) or (B, M, P²C); targets: (B, M), (B, M, S)
    or (B, M, P²C); corrupted: which patches were corrupted and how."""

    predictions: Tensor
    targets: Tensor
    corrupted: CorruptedPatches


def as_config(value: Any, cls: type) -> Any:
    """A config dataclass from itself or from its dict (as checkpoints store it)."""
    return value if isinstance(value, cls) else cls(**value)


class MaskedPatchPretraining(pl.LightningModule):
    """A ViT encoder pretrained by predicting a target (the 3-bit mean colour) of every
    corrupted patch from that patch's representation.

    Args:
        encoder: the ViT architecture.
        optimizer: optimiser and schedule (the paper: Adam, 2e-4, 10k warmup, cosine).
        corruption: share of patches corrupted and the mask / random / keep split.
        target: what is predicted per corrupted patch.
        pixel_mean: normalisation of the encoder's input, one value or one per channel.
        pixel_std: likewise.
        compile: compile `forward` (targets, corruption, encoder, head) with torch.compile; shapes
            are static, so it compiles once for training and once for evaluation.
        nonfinite_loss: `stop` the run on a NaN or infinite loss, or `skip` such steps (mpp.train.guards).
    """

    def __init__(
        self,
        *,
        encoder: ViTConfig,
        optimizer: OptimizerConfig,
        corruption: CorruptionConfig = CorruptionConfig(),
        target: TargetConfig = TargetConfig(),
        pixel_mean: Sequence[float] = (0.5,),
        pixel_std: Sequence[float] = (0.5,),
        compile: bool = False,
        nonfinite_loss: Policy = "stop",
    ) -> None:
        super().__init__()
        self.encoder_config = as_config(encoder, ViTConfig)
        self.optimizer_config = as_config(optimizer, OptimizerConfig)
        self.loss_guard = LossGuard(nonfinite_loss)
        self.corruption = as_config(corruption, CorruptionConfig)
        self.target = as_config(target, TargetConfig)
        # Hyperparameters are stored as plain data so that checkpoints load without unpickling
        # project classes (under the CLI, Lightning stores the parsed config instead).
        encoder, optimizer = asdict(self.encoder_config), asdict(self.optimizer_config)
        corruption, target = asdict(self.corruption), asdict(self.target)
        pixel_mean, pixel_std = list(pixel_mean), list(pixel_std)
        self.save_hyperparameters()
        self.encoder = ViT(self.encoder_config)
        self.normalise = Normalise(mean=pixel_mean, std=pixel_std)
        self.normalise.check_channels(self.encoder_config.channels)
        self.mask_token = nn.Parameter(torch.empty(self.encoder_config.dim))
        nn.init.normal_(self.mask_token, std=0.02)
        patch_size, channels = self.encoder_config.patch_size, self.encoder_config.channels
        self.predictions_per_patch = self.target.predictions_per_patch()
        self.outputs = self.target.outputs_per_prediction(channels=channels, patch_size=patch_size)
        self.head = nn.Linear(self.encoder_config.dim, self.predictions_per_patch * self.outputs)
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # Evaluation tally of target classes, for the majority-class baseline.
        self.register_buffer("target_counts", torch.zeros(self.outputs, dtype=torch.long), persistent=False)
        if compile:
            self.compile()  # in place: parameter names, and so checkpoints, stay those of the eager module

    def targets(self, images: Tensor) -> Tensor:
        """(B, C, H, W) in [0, 1] -> (B, N, ...) the target of every patch."""
        return self.target.compute(images, patch_size=self.encoder_config.patch_size)

    def predict(self, representations: Tensor) -> Tensor:
        """(B, M, D) corrupted patches' representations -> their predictions."""
        predictions = self.head(representations)
        if self.target.kind == "downsized_colour":
            predictions = predictions.unflatten(-1, (self.predictions_per_patch, self.outputs))
        return predictions

    def forward(self, images: Tensor) -> MPPOutput:
        """(B, C, H, W) images in [0, 1] -> predictions and targets of the corrupted patches."""
        targets = self.targets(images)
        patches = self.encoder.embed_patches(self.normalise(images))
        corrupted = corrupt_patches(patches, mask_token=self.mask_token, config=self.corruption)
        tokens = self.encoder.add_positions(corrupted.tokens)
        _, representations = self.encoder.encode(tokens, keep=corrupted.positions)  # (B, M, D)
        predictions = self.predict(representations)
        return MPPOutput(predictions, pick(targets, corrupted.positions), corrupted)

    def loss(self, images: Tensor) -> Tensor:
        """(B, C, H, W) uint8 or [0, 1] images -> the MPP loss of one draw of corruption."""
        output = self(to_unit_range(images))
        return prediction_loss(output.predictions, output.targets)

    def _step(self, batch: dict[str, Tensor] | Tensor, stage: str) -> Tensor | None:
        images = batch["image"] if isinstance(batch, dict) else batch
        if images.shape[0] == 0:  # a rank in step with those still evaluating (mpp.data.loader)
            names = ["loss"] if self.target.kind == "pixels" else ["loss", "mpp_accuracy"]
            log_nothing(self, stage, names)
            return None
        output = self(to_unit_range(images))
        loss = prediction_loss(output.predictions, output.targets)
        batch_size = images.shape[0]
        # No prog_bar in training: Lightning reads progress-bar values on the host every step.
        evaluating = stage != "train"
        self.log(f"{stage}/loss", loss, prog_bar=evaluating, batch_size=batch_size, sync_dist=evaluating)
        if not output.targets.is_floating_point():
            accuracy = prediction_accuracy(output.predictions, output.targets)
            self.log(f"{stage}/mpp_accuracy", accuracy, prog_bar=evaluating, batch_size=batch_size, sync_dist=evaluating)
            if evaluating:
                self.target_counts += torch.bincount(output.targets.flatten(), minlength=self.outputs)
        if stage == "train" and logging_step(self.trainer):
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=batch_size)
        return loss

    def training_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor | None:
        return self.loss_guard(self._step(batch, "train"), self.trainer)

    def validation_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor | None:
        return self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor | None:
        return self._step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self.target_counts.zero_()

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._log_majority_accuracy("val")

    def on_test_epoch_end(self) -> None:
        self._log_majority_accuracy("test")

    def _log_majority_accuracy(self, stage: str) -> None:
        """The baseline for `mpp_accuracy`: always predicting the most common target class."""
        counts = self.trainer.strategy.reduce(self.target_counts.float(), reduce_op="sum")
        if counts.sum() > 0:
            # The same on every rank, reduced already: sync_dist only says so to Lightning.
            self.log(f"{stage}/majority_accuracy", counts.max() / counts.sum(), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_optimizer(self, self.optimizer_config, total_steps(self.trainer),
                                   global_batch_size(self.trainer))

    def configure_callbacks(self) -> list[pl.Callback]:
        return [LossGuardCheck(self.loss_guard)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Fine-tuning rebuilds the encoder from this alone.
        checkpoint["encoder_config"] = asdict(self.encoder_config)
