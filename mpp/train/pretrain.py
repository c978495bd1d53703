"""MaskedPatchPretraining: the self-supervised objective of section 4.6 as a LightningModule.

shards -> batch -> targets (raw pixels) -> choose the corrupted patches -> normalise (and, for a
hybrid with `corruption.mask_pixels`, blank the masked regions) -> embed patches -> corrupt
-> add positions -> blocks -> head on corrupted positions -> loss
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mpp.model.checkpoint import load_encoder
from mpp.model.corruption import (
    CorruptedPatches,
    CorruptionConfig,
    apply_corruption,
    choose_corruption,
    mask_pixels,
)
from mpp.model.pixels import to_unit_range
from mpp.model.targets import TargetConfig, prediction_accuracy, prediction_loss
from mpp.model.vit import ViT, ViTConfig, pick
from mpp.train.base import EncoderModule, as_config, plain
from mpp.train.nonfinite_loss import Policy
from mpp.train.optim import OptimizerConfig


class MPPOutput(NamedTuple):
    """predictions: (B, M, K), (B, M, S, K) or (B, M, P²C); targets: (B, M), (B, M, S)
    or (B, M, P²C); corrupted: which patches were corrupted and how."""

    predictions: Tensor
    targets: Tensor
    corrupted: CorruptedPatches


class MaskedPatchPretraining(EncoderModule):
    """A ViT encoder pretrained by predicting a target (the 3-bit mean colour) of every
    corrupted patch from that patch's representation.

    Args:
        encoder: the ViT architecture.
        optimizer: optimiser and schedule (the paper: Adam, 2e-4, 10k warmup, cosine).
        corruption: share of patches corrupted and the mask / random / keep split.
        target: what is predicted per corrupted patch.
        pretrained: continued pretraining: an mpp checkpoint, or a timm or Hugging Face export
            (mpp export), whose encoder initialises this one, its position embeddings
            interpolated to `encoder.image_size`; the head and mask token start fresh. null (the
            default) starts from random weights. Pass `pretrained=None` to `load_from_checkpoint`
            to restore a module without reading that file again.
        pixel_mean: normalisation of the encoder's input, one value or one per channel.
        pixel_std: likewise.
        compile: compile `forward` (targets, corruption, encoder, head) with torch.compile; shapes
            are static, so it compiles once for training and once for evaluation.
        nonfinite_loss: `stop` the run on a NaN or infinite loss, or `skip` such steps (mpp.train.nonfinite_loss).
        frozen: submodules that keep their initial (or `pretrained`) weights, by name, e.g.
            `[encoder.blocks]`: then only the patch embedding (and a hybrid's stem), positions, [mask]
            token, final norm and head learn, as in the leakage measurement of experiments/leakage.py.
    """

    target_counts: Tensor  # a buffer, registered in __init__
    predicted = {
        "embeddings": "the frozen encoder's representation y = LN(z_L^0), its class token, as the few-shot "
        "evaluation and the exports take it",
        "patch_means": "the mean of the frozen encoder's patch tokens, after its final norm",
    }

    def __init__(
        self,
        *,
        encoder: ViTConfig,
        optimizer: OptimizerConfig,
        corruption: CorruptionConfig = CorruptionConfig(),  # noqa: B008 (frozen: one shared default is safe)
        target: TargetConfig = TargetConfig(),  # noqa: B008
        pretrained: str | None = None,
        pixel_mean: Sequence[float] = (0.5,),
        pixel_std: Sequence[float] = (0.5,),
        compile: bool = False,
        nonfinite_loss: Policy = "stop",
        frozen: Sequence[str] = (),
    ) -> None:
        super().__init__(
            {
                "encoder": plain(encoder, ViTConfig),
                "optimizer": plain(optimizer, OptimizerConfig),
                "corruption": plain(corruption, CorruptionConfig),
                "target": plain(target, TargetConfig),
                "pretrained": pretrained,
                "pixel_mean": list(pixel_mean),
                "pixel_std": list(pixel_std),
                "compile": compile,
                "nonfinite_loss": nonfinite_loss,
                "frozen": list(frozen),
            }
        )
        self.corruption, self.target = as_config(corruption, CorruptionConfig), as_config(target, TargetConfig)
        self.metric_names = ["loss"] if self.target.kind == "pixels" else ["loss", "mpp_accuracy"]
        if self.corruption.mask_pixels and self.encoder_config.stem is None:
            raise ValueError(
                "corruption.mask_pixels is for a hybrid encoder (encoder.stem): a pure ViT's masked "
                "patches already see none of their pixels"
            )
        if pretrained is None:
            self.encoder = ViT(self.encoder_config)
        else:
            self.encoder = load_encoder(pretrained, expected=self.encoder_config)
            self.encoder.resize_positions(self.encoder_config.image_size)
        self.mask_token = nn.Parameter(torch.empty(self.encoder_config.dim))
        nn.init.normal_(self.mask_token, std=0.02)
        token_size, channels = self.encoder_config.token_size, self.encoder_config.channels
        self.predictions_per_patch = self.target.predictions_per_patch()
        self.outputs = self.target.outputs_per_prediction(channels=channels, patch_size=token_size)
        self.head = nn.Linear(self.encoder_config.dim, self.predictions_per_patch * self.outputs)
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # Evaluation tally of target classes, for the majority-class baseline.
        self.register_buffer("target_counts", torch.zeros(self.outputs, dtype=torch.long), persistent=False)
        for name in frozen:
            try:
                self.get_submodule(name).requires_grad_(False)
            except AttributeError:
                raise ValueError(f"frozen: this module has no submodule {name!r} (e.g. encoder.blocks)") from None
        self.compile_if(compile)

    def targets(self, images: Tensor) -> Tensor:
        """(B, C, H, W) in [0, 1] -> (B, N, ...) the target of every patch, from the pixels its token stands for."""
        return self.target.compute(images, patch_size=self.encoder_config.token_size)

    def predict(self, representations: Tensor) -> Tensor:
        """(B, M, D) corrupted patches' representations -> their predictions."""
        predictions = self.head(representations)
        if self.target.kind == "downsized_colour":
            predictions = predictions.unflatten(-1, (self.predictions_per_patch, self.outputs))
        return predictions

    def forward(self, images: Tensor) -> MPPOutput:
        """(B, C, H, W) images in [0, 1] -> predictions and targets of the corrupted patches."""
        targets = self.targets(images)
        encoder = self.encoder_config
        choice = choose_corruption(
            len(images), encoder.num_patches, config=self.corruption, grid=encoder.grid, device=images.device
        )
        pixels = self.normalise(images)
        if self.corruption.mask_pixels:
            pixels = mask_pixels(pixels, choice, self.encoder_config.grid)
        corrupted = apply_corruption(self.encoder.embed_patches(pixels), choice, mask_token=self.mask_token)
        tokens = self.encoder.add_positions(corrupted.tokens)
        _, representations = self.encoder.encode(tokens, keep=corrupted.positions)  # (B, M, D)
        predictions = self.predict(representations)
        return MPPOutput(predictions, pick(targets, corrupted.positions), corrupted)

    def loss(self, images: Tensor) -> Tensor:
        """(B, C, H, W) uint8 or [0, 1] images -> the MPP loss of one draw of corruption."""
        return self._scored(images)[0]

    def _scored(self, images: Tensor) -> tuple[Tensor, MPPOutput]:
        output = self(to_unit_range(images))
        return prediction_loss(output.predictions, output.targets), output

    def metrics(self, batch: dict[str, Tensor] | Tensor, stage: str) -> dict[str, Tensor]:
        """The loss, and for class targets the accuracy, of one draw of corruption of the batch's images."""
        loss, output = self._scored(batch["image"] if isinstance(batch, dict) else batch)
        if output.targets.is_floating_point():
            return {"loss": loss}
        if stage != "train":
            self.target_counts += torch.bincount(output.targets.flatten(), minlength=self.outputs)
        return {"loss": loss, "mpp_accuracy": prediction_accuracy(output.predictions, output.targets)}

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """A batch's representations, uncorrupted: the class token and the patch tokens' mean, float32 (B, D)."""
        pixels = self.normalise(to_unit_range(batch["image"]))
        tokens = self.encoder.add_positions(self.encoder.embed_patches(pixels))
        representation, patches = self.encoder.encode(tokens)  # (B, D), (B, N, D)
        return {"embeddings": representation.float(), "patch_means": patches.float().mean(dim=1)}

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self.target_counts.zero_()

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self.target_counts.zero_()

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self._log_majority_accuracy("val")

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self._log_majority_accuracy("test")

    def _log_majority_accuracy(self, stage: str) -> None:
        """The baseline for `mpp_accuracy`: always predicting the most common target class."""
        counts = self.trainer.strategy.reduce(self.target_counts.float(), reduce_op="sum")
        if counts.sum() > 0:
            # The same on every rank, reduced already: sync_dist only says so to Lightning.
            self.log(f"{stage}/majority_accuracy", counts.max() / counts.sum(), sync_dist=True)
