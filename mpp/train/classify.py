"""ImageClassifier: a ViT with one zero-initialised linear head on y = LN(z_L^0), fine-tuned
from a pretraining checkpoint (B.1.1) or trained from scratch (the Table 3 baseline).

The two arms differ only by config: `pretrained` (a checkpoint, or null) and the optimiser.

    shards -> batch -> normalise -> encoder -> y -> head -> logits -> cross-entropy
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpp.model.checkpoint import load_encoder
from mpp.model.pixels import to_unit_range
from mpp.model.vit import ViT, ViTConfig
from mpp.train.base import EncoderModule, plain
from mpp.train.nonfinite_loss import Policy
from mpp.train.optim import OptimizerConfig


class ImageClassifier(EncoderModule):
    """A ViT encoder with a single zero-initialised linear head on the image representation.

    Args:
        encoder: the ViT architecture, at the fine-tuning image size.
        num_classes: K, the head's outputs; labels must lie in [0, K). null: as many as class_names
            names (`mpp` fills both from the index of the shards it reads where the config sets neither).
        optimizer: optimiser and schedule (fine-tuning: SGD, momentum 0.9; from scratch: Adam,
            weight decay 0.3).
        pretrained: a checkpoint of MaskedPatchPretraining (or ImageClassifier), or a timm or
            Hugging Face export (a folder or a .safetensors file, e.g. from mpp export), whose
            encoder initialises this one; its position embeddings are interpolated to
            `encoder.image_size`. null trains from scratch. Pass `pretrained=None` to
            `load_from_checkpoint` to restore a classifier without reading the pretraining checkpoint again.
        pixel_mean: normalisation of the encoder's input, one value or one per channel.
        pixel_std: likewise.
        class_names: names of the K classes for the per-class test accuracies (default: indices).
        compile: compile `forward` (normalise, encoder, head) with torch.compile.
        nonfinite_loss: `stop` the run on a NaN or infinite loss, or `skip` such steps (mpp.train.nonfinite_loss).
    """

    metric_names = ["loss", "accuracy"]
    predicted = {
        "probabilities": "the class probabilities (softmax of the head's logits), columns in the order of `classes`",
        "predictions": "the most probable class, an index into `classes`",
    }
    class_correct: Tensor  # buffers, registered in __init__
    class_total: Tensor

    def __init__(
        self,
        *,
        encoder: ViTConfig,
        optimizer: OptimizerConfig,
        num_classes: int | None = None,
        pretrained: str | None = None,
        pixel_mean: Sequence[float] = (0.5,),
        pixel_std: Sequence[float] = (0.5,),
        class_names: list[str] | None = None,
        compile: bool = False,
        nonfinite_loss: Policy = "stop",
    ) -> None:
        if num_classes is None and class_names is None:
            raise ValueError(
                "num_classes is unset and no shard index lists the classes: set model.init_args.num_classes "
                "(and class_names), or write the shards with `mpp shards write`, whose index lists them"
            )
        num_classes = len(class_names) if num_classes is None and class_names is not None else num_classes
        if num_classes is None or num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(
                f"class_names has {len(class_names)} names for num_classes={num_classes}: give "
                f"model.init_args.class_names {num_classes} names, or null to name the classes 0 to {num_classes - 1}"
            )
        super().__init__(
            {
                "encoder": plain(encoder, ViTConfig),
                "optimizer": plain(optimizer, OptimizerConfig),
                "num_classes": num_classes,
                "pretrained": pretrained,
                "pixel_mean": list(pixel_mean),
                "pixel_std": list(pixel_std),
                "class_names": class_names,
                "compile": compile,
                "nonfinite_loss": nonfinite_loss,
            }
        )
        self.num_classes = num_classes
        self.class_names = list(class_names) if class_names is not None else [str(k) for k in range(num_classes)]
        if pretrained is None:
            self.encoder = ViT(self.encoder_config)
        else:
            self.encoder = load_encoder(pretrained, expected=self.encoder_config)
            self.encoder.resize_positions(self.encoder_config.image_size)
        # Zero-initialised (B.1.1): fine-tuning starts from uniform predictions, whatever y is.
        self.head = nn.Linear(self.encoder_config.dim, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # Per-class tallies over a test epoch.
        self.register_buffer("class_correct", torch.zeros(num_classes, dtype=torch.long), persistent=False)
        self.register_buffer("class_total", torch.zeros(num_classes, dtype=torch.long), persistent=False)
        self.compile_if(compile)

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
        if not self.trainer.predicting:  # predictions need no labels
            self.check_labels(batch["label"])
        return batch

    def metrics(self, batch: dict[str, Tensor], stage: str) -> dict[str, Tensor]:
        """The cross-entropy and accuracy of the batch's logits, tallied per class in testing."""
        labels = batch["label"]
        logits = self(to_unit_range(batch["image"]))
        correct = logits.argmax(dim=-1) == labels
        if stage == "test":
            self.class_correct += torch.bincount(labels[correct], minlength=self.num_classes)
            self.class_total += torch.bincount(labels, minlength=self.num_classes)
        return {"loss": F.cross_entropy(logits, labels), "accuracy": correct.float().mean()}

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """A batch's class probabilities, float32 (B, K), and most probable classes, int64 (B,)."""
        probabilities = self(to_unit_range(batch["image"])).float().softmax(dim=-1)
        return {"probabilities": probabilities, "predictions": probabilities.argmax(dim=-1)}

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self.class_correct.zero_()
        self.class_total.zero_()

    def on_test_epoch_end(self) -> None:
        """`test/accuracy/<class>` for every class the test set holds, over all ranks."""
        super().on_test_epoch_end()
        correct = self.trainer.strategy.reduce(self.class_correct.float(), reduce_op="sum")
        total = self.trainer.strategy.reduce(self.class_total.float(), reduce_op="sum")
        for name, right, count in zip(self.class_names, correct.tolist(), total.tolist()):
            if count > 0:
                self.log(f"test/accuracy/{name}", right / count, sync_dist=True)  # reduced already
