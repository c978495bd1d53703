"""ImageClassifier: a ViT with one zero-initialised linear head on y = LN(z_L^0), fine-tuned
from a pretraining checkpoint (B.1.1) or trained from scratch (the Table 3 baseline).

The two arms differ only by config: `pretrained` (a checkpoint, or null) and the optimiser.

    shards -> batch -> normalise -> encoder -> y -> head -> logits -> cross-entropy
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpp.model.checkpoint import load_encoder
from mpp.model.pixels import Normalise, to_unit_range
from mpp.model.vit import ViT, ViTConfig
from mpp.train.guards import LossGuard, LossGuardCheck, Policy
from mpp.train.optim import (
    OptimizerConfig,
    configure_optimizer,
    global_batch_size,
    log_nothing,
    logging_step,
    total_steps,
)
from mpp.train.pretrain import as_config


class ImageClassifier(pl.LightningModule):
    """A ViT encoder with a single zero-initialised linear head on the image representation.

    Args:
        encoder: the ViT architecture, at the fine-tuning image size.
        num_classes: K, the head's outputs; labels must lie in [0, K).
        optimizer: optimiser and schedule (fine-tuning: SGD, momentum 0.9; from scratch: Adam,
            weight decay 0.3).
        pretrained: a checkpoint of MaskedPatchPretraining (or ImageClassifier) whose encoder
            initialises this one; its position embeddings are interpolated to `encoder.image_size`.
            null trains from scratch. Pass `pretrained=None` to `load_from_checkpoint` to restore a
            classifier without reading the pretraining checkpoint again.
        pixel_mean: normalisation of the encoder's input, one value or one per channel.
        pixel_std: likewise.
        class_names: names of the K classes for the per-class test accuracies (default: indices).
        compile: compile `forward` (normalise, encoder, head) with torch.compile.
        nonfinite_loss: `stop` the run on a NaN or infinite loss, or `skip` such steps (mpp.train.guards).
    """

    def __init__(
        self,
        *,
        encoder: ViTConfig,
        num_classes: int,
        optimizer: OptimizerConfig,
        pretrained: str | None = None,
        pixel_mean: Sequence[float] = (0.5,),
        pixel_std: Sequence[float] = (0.5,),
        class_names: list[str] | None = None,
        compile: bool = False,
        nonfinite_loss: Policy = "stop",
    ) -> None:
        super().__init__()
        self.encoder_config = as_config(encoder, ViTConfig)
        self.optimizer_config = as_config(optimizer, OptimizerConfig)
        self.loss_guard = LossGuard(nonfinite_loss)
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"class_names has {len(class_names)} names for num_classes={num_classes}")
        self.num_classes = num_classes
        self.class_names = list(class_names) if class_names is not None else [str(k) for k in range(num_classes)]
        # Hyperparameters are stored as plain data so that checkpoints load without unpickling
        # project classes (under the CLI, Lightning stores the parsed config instead).
        encoder, optimizer = asdict(self.encoder_config), asdict(self.optimizer_config)
        pixel_mean, pixel_std = list(pixel_mean), list(pixel_std)
        self.save_hyperparameters()
        if pretrained is None:
            self.encoder = ViT(self.encoder_config)
        else:
            self.encoder = load_encoder(pretrained, expected=self.encoder_config)
            self.encoder.resize_positions(self.encoder_config.image_size)
        self.normalise = Normalise(mean=pixel_mean, std=pixel_std)
        self.normalise.check_channels(self.encoder_config.channels)
        # Zero-initialised (B.1.1): fine-tuning starts from uniform predictions, whatever y is.
        self.head = nn.Linear(self.encoder_config.dim, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # Per-class tallies over a test epoch.
        self.register_buffer("class_correct", torch.zeros(num_classes, dtype=torch.long), persistent=False)
        self.register_buffer("class_total", torch.zeros(num_classes, dtype=torch.long), persistent=False)
        if compile:
            self.compile()  # in place: parameter names, and so checkpoints, stay those of the eager module

    def forward(self, images: Tensor) -> Tensor:
        """(B, C, H, W) images in [0, 1] -> (B, K) logits."""
        return self.head(self.encoder(self.normalise(images)))

    def check_labels(self, labels: Tensor) -> None:
        """Fail on labels the loss cannot take, naming the cause, instead of an opaque index error."""
        if labels.numel() and labels.min() < 0:
            raise ValueError("a batch holds unlabelled samples (label -1): the shards need `.cls` labels")
        if labels.numel() and labels.max() >= self.num_classes:
            raise ValueError(f"a batch holds label {int(labels.max())}, outside num_classes={self.num_classes}")

    def on_before_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        # Checked while the labels are still on the host: on the device it would sync every step.
        self.check_labels(batch["label"])
        return batch

    def _step(self, batch: dict[str, Tensor], stage: str) -> Tensor | None:
        labels = batch["label"]
        if labels.shape[0] == 0:  # a rank in step with those still evaluating (mpp.data.loader)
            log_nothing(self, stage, ["loss", "accuracy"])
            return None
        logits = self(to_unit_range(batch["image"]))
        loss = F.cross_entropy(logits, labels)
        correct = logits.argmax(dim=-1) == labels
        batch_size = labels.shape[0]
        # No prog_bar in training: Lightning reads progress-bar values on the host every step.
        evaluating = stage != "train"
        self.log(f"{stage}/loss", loss, prog_bar=evaluating, batch_size=batch_size, sync_dist=evaluating)
        self.log(f"{stage}/accuracy", correct.float().mean(), prog_bar=evaluating, batch_size=batch_size, sync_dist=evaluating)
        if stage == "train" and logging_step(self.trainer):
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=batch_size)
        if stage == "test":
            self.class_correct += torch.bincount(labels[correct], minlength=self.num_classes)
            self.class_total += torch.bincount(labels, minlength=self.num_classes)
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        return self.loss_guard(self._step(batch, "train"), self.trainer)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        return self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        return self._step(batch, "test")

    def on_test_epoch_start(self) -> None:
        self.class_correct.zero_()
        self.class_total.zero_()

    def on_test_epoch_end(self) -> None:
        """`test/accuracy/<class>` for every class the test set holds, over all ranks."""
        correct = self.trainer.strategy.reduce(self.class_correct.float(), reduce_op="sum")
        total = self.trainer.strategy.reduce(self.class_total.float(), reduce_op="sum")
        for name, right, count in zip(self.class_names, correct.tolist(), total.tolist()):
            if count > 0:
                self.log(f"test/accuracy/{name}", right / count, sync_dist=True)  # reduced already

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_optimizer(self, self.optimizer_config, total_steps(self.trainer),
                                   global_batch_size(self.trainer))

    def configure_callbacks(self) -> list[pl.Callback]:
        return [LossGuardCheck(self.loss_guard)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The encoder at the fine-tuning size: few-shot evaluation and further fine-tuning read it.
        checkpoint["encoder_config"] = asdict(self.encoder_config)
