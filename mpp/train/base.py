"""EncoderModule: the plumbing MaskedPatchPretraining and ImageClassifier share; each adds its `metrics`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.strategies import FSDPStrategy
from pytorch_lightning.utilities.enums import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer

from mpp.model.pixels import Normalise
from mpp.model.vit import ViTConfig
from mpp.train import optim, steps
from mpp.train.nonfinite_loss import LossGuard, LossGuardCheck
from mpp.train.step_seeds import StepDraws


def as_config(value: Any, cls: type[Any]) -> Any:
    """A config dataclass from itself or from its dict (as checkpoints store it)."""
    return value if isinstance(value, cls) else cls(**value)


def plain(value: Any, cls: type[Any]) -> dict[str, Any]:
    """A config dataclass, or its dict, as the complete dict of its fields (as checkpoints store it)."""
    return asdict(as_config(value, cls))


class EvaluationMeans:
    """The sample-weighted mean of each metric over an evaluation, over every rank.

    Not Lightning's `self.log(..., batch_size=, sync_dist=True)`: it reduces the summed batch sizes
    as an integer mean over ranks, which rounds down (158 samples on 3 ranks count as 3 x 52 = 156).
    """

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.sums: Tensor | None = None  # float64 (len(names) + 1,): each metric x samples, then the samples

    def reset(self) -> None:
        self.sums = None

    def add(self, metrics: dict[str, Tensor], size: int) -> None:
        """One batch's means over its `size` samples."""
        values = torch.stack([metrics[name].detach().double() * size for name in self.names])
        batch = torch.cat([values, values.new_tensor([size])])
        self.sums = batch if self.sums is None else self.sums + batch

    def means(self, strategy: Any, device: torch.device) -> dict[str, float]:
        """{name: mean over every sample of every rank}; empty where no rank had a sample. All ranks call it."""
        sums = self.sums if self.sums is not None else torch.zeros(len(self.names) + 1, dtype=torch.float64)
        total = strategy.reduce(sums.to(device), reduce_op="sum")
        if total[-1] == 0:
            return {}
        return {name: float(total[i] / total[-1]) for i, name in enumerate(self.names)}


class EncoderModule(pl.LightningModule):
    """A ViT encoder's training plumbing; a subclass gives the `metrics` of a batch, `loss` among them, and
    a `predict_step` for `mpp predict` (mpp.outputs.predictions)."""

    metric_names: list[str]  # the keys of `metrics`
    predicted: dict[str, str]  # the outputs of predict_step, by name: what each holds

    def __init__(self, hyperparameters: dict[str, Any]) -> None:
        """`hyperparameters`: the subclass's arguments, in its signature's order, as plain data (`plain`,
        lists), so that checkpoints load without unpickling project classes; their `encoder`, `optimizer`,
        `pixel_mean`, `pixel_std` and `nonfinite_loss` configure what this base holds."""
        super().__init__()
        self.encoder_config = as_config(hyperparameters["encoder"], ViTConfig)
        self.optimizer_config = as_config(hyperparameters["optimizer"], optim.OptimizerConfig)
        self.loss_guard = LossGuard(hyperparameters["nonfinite_loss"])
        self.save_hyperparameters(hyperparameters)
        mean, std = hyperparameters["pixel_mean"], hyperparameters["pixel_std"]
        self.normalise = Normalise(mean=mean, std=std)
        self.normalise.check_channels(self.encoder_config.channels)
        self.draws = StepDraws()
        self.evaluation: EvaluationMeans | None = None  # made with the first evaluation, once metric_names is set

    def compile_if(self, compile: bool) -> None:
        """Compile `forward` with torch.compile if asked, once the subclass has built every layer."""
        if compile:
            self.compile()  # in place: parameter names, and so checkpoints, stay those of the eager module

    def metrics(self, batch: Any, stage: str) -> dict[str, Tensor]:
        """The `metric_names` of one batch of at least one sample."""
        raise NotImplementedError

    def _step(self, batch: dict[str, Tensor] | Tensor, stage: str) -> Tensor | None:
        size = (batch["image"] if isinstance(batch, dict) else batch).shape[0]
        if size == 0:  # a rank in step with those still evaluating (mpp.data.loader)
            return None
        metrics = self.metrics(batch, stage)
        if stage != "train":  # logged as the evaluation ends, over every rank (EvaluationMeans)
            assert self.evaluation is not None
            self.evaluation.add(metrics, size)
            return metrics["loss"]
        # No prog_bar in training: Lightning reads progress-bar values on the host every step.
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value, batch_size=size)
        if steps.logging_step(self.trainer):
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=size)
        return metrics["loss"]

    def _start_evaluation(self) -> None:
        self.evaluation = EvaluationMeans(self.metric_names)

    def _log_evaluation(self, stage: str) -> None:
        """`<stage>/<metric>`: each the mean over every sample the evaluation read, on every rank."""
        assert self.evaluation is not None
        for name, mean in self.evaluation.means(self.trainer.strategy, self.device).items():
            # The same on every rank, reduced already: sync_dist only says so to Lightning.
            self.log(f"{stage}/{name}", mean, prog_bar=True, sync_dist=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.draws.training_batch(self.trainer.global_step, self.global_rank)

    def on_validation_start(self) -> None:
        self.draws.evaluation("val", self.trainer.global_step, self.global_rank)

    def on_test_start(self) -> None:
        self.draws.evaluation("test", self.trainer.global_step, self.global_rank)

    def on_validation_epoch_start(self) -> None:
        self._start_evaluation()

    def on_test_epoch_start(self) -> None:
        self._start_evaluation()

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test")

    def training_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor | None:
        return self.loss_guard(self._step(batch, "train"), self.trainer)

    def validation_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor | None:
        return self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor | None:
        return self._step(batch, "test")

    def configure_optimizers(self) -> Any:  # a dict, which Lightning's union of return types does not name
        batch = steps.global_batch_size(self.trainer)
        # No fused optimiser under 16-mixed: it unscales the GradScaler's gradients itself, after clipping.
        fused = self.trainer.precision != "16-mixed"
        return optim.configure_optimizer(
            self, self.optimizer_config, steps.total_steps(self.trainer), batch, fused=fused
        )

    def configure_gradient_clipping(
        self, optimizer: Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clip as Lightning does, also where its plugins refuse to.

        Lightning's mixed-precision plugin refuses any fused optimiser (which unscales fp16 gradients
        itself), bf16 included, where nothing is scaled; its FSDP plugin refuses clipping by norm,
        which needs the norm over every rank's shards: the root FSDP module computes that one.
        """
        if not gradient_clip_val:
            return
        algorithm = GradClipAlgorithmType((gradient_clip_algorithm or "norm").lower())
        plugin = self.trainer.precision_plugin
        if algorithm == GradClipAlgorithmType.NORM and isinstance(self.trainer.strategy, FSDPStrategy):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)  # type: ignore[operator,union-attr]
        elif isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_callbacks(self) -> list[pl.Callback]:
        return [LossGuardCheck(self.loss_guard)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Fine-tuning and few-shot evaluation rebuild the encoder (at this module's image size) from this alone.
        checkpoint["encoder_config"] = asdict(self.encoder_config)
        self.draws.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.draws.load(checkpoint)
