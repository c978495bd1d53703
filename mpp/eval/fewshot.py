"""Few-shot linear evaluation (section 4.1): regularised least squares, solved in closed form,
from frozen image representations to {-1, 1}^K targets; and a callback that runs it during
training. The paper chose between masked patch prediction variants by this number.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy
from torch import Tensor, nn

from mpp.data.module import ShardDataModule, ShardSpec
from mpp.model.checkpoint import encoder_and_normalisation
from mpp.model.pixels import to_unit_range
from mpp.model.vit import ViT

BIAS_FEATURE = 100.0


def fewshot_accuracy(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    num_classes: int,
    l2: float = 1024.0,
) -> float:
    """(N, D), (N,), (M, D), (M,) -> top-1 accuracy on the test features of the ridge regression
    fitted to the train features: features standardised with the train statistics plus a bias
    column make X, targets in {-1, 1}^K make Y, and W solves (XᵀX + l2·I) W = XᵀY in float64."""
    x, x_test = train_features.double(), test_features.double()
    mean, std = x.mean(dim=0), x.std(dim=0, unbiased=False) + 1e-5
    x, x_test = (x - mean) / std, (x_test - mean) / std
    # A bias column of a large constant: its weight is barely regularised, as a bias should be.
    x = torch.cat([x, torch.full_like(x[:, :1], BIAS_FEATURE)], dim=1)
    x_test = torch.cat([x_test, torch.full_like(x_test[:, :1], BIAS_FEATURE)], dim=1)
    targets = 2.0 * nn.functional.one_hot(train_labels.long(), num_classes).double() - 1.0  # (N, K)
    gram = x.T @ x + l2 * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    weights = torch.linalg.solve(gram, x.T @ targets)  # (D + 1, K)
    predictions = (x_test @ weights).argmax(dim=1)
    return (predictions == test_labels.to(predictions.device)).double().mean().item()


def pick_shots(labels: Tensor, *, shots: int, num_classes: int, seed: int) -> Tensor:
    """(N,) labels -> (shots · K,) indices: `shots` examples of every class, drawn with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for label in range(num_classes):
        (members,) = torch.nonzero(labels.cpu() == label, as_tuple=True)
        if len(members) < shots:
            raise ValueError(
                f"class {label} has {len(members)} few-shot training examples, fewer than {shots} shots: "
                "give more training samples (max_train), shards that mix the classes, or fewer shots"
            )
        chosen.append(members[torch.randperm(len(members), generator=generator)[:shots]])
    return torch.cat(chosen)


def fewshot_evaluation(
    features: Tensor,
    labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    shots: Sequence[int] = (1, 5, 10, 25),
    seeds: int = 3,
    num_classes: int,
    l2: float = 1024.0,
) -> dict[int, float]:
    """(N, D), (N,), (M, D), (M,) -> {n: accuracy on all test features, averaged over `seeds`
    draws of n training examples per class}."""
    results = {}
    for n in shots:
        accuracies = []
        for seed in range(seeds):
            chosen = pick_shots(labels, shots=n, num_classes=num_classes, seed=seed)
            accuracies.append(
                fewshot_accuracy(features[chosen], labels[chosen], test_features, test_labels, num_classes=num_classes, l2=l2)
            )
        results[n] = sum(accuracies) / len(accuracies)
    return results


@torch.no_grad()
def extract_features(
    encoder: ViT, loader: Iterable[dict[str, Tensor]], *, normalise: nn.Module, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Batches {"image": (B, C, H, W), "label": (B,)} -> image representations (N, D) float32 and
    labels (N,), on the CPU, from the frozen encoder in eval mode (its mode is restored after)."""
    was_training = encoder.training
    encoder.eval()
    features, labels = [], []
    try:
        for batch in loader:
            images = normalise(to_unit_range(batch["image"].to(device, non_blocking=True)))
            features.append(encoder(images).float().cpu())
            labels.append(batch["label"])
    finally:
        encoder.train(was_training)
    if not features:
        raise ValueError("no batches to extract features from: the shards are empty")
    return torch.cat(features), torch.cat(labels)


def limited(loader: Iterable[dict[str, Tensor]], limit: int) -> Iterable[dict[str, Tensor]]:
    """The first `limit` samples of a loader's batches (the last batch cut to fit)."""
    seen = 0
    for batch in loader:
        if seen >= limit:
            return
        take = min(limit - seen, len(batch["label"]))
        seen += take
        yield {"image": batch["image"][:take], "label": batch["label"][:take]}


class FewShotEvaluation(pl.Callback):
    """Logs `fewshot/<n>shot` (linear few-shot accuracy of the frozen encoder's y) at the start of
    training, every `every_n_steps` steps and at the end, on rank zero.

    Uses the module's `encoder` and `normalise`, so it runs under pretraining and fine-tuning alike.
    Features come from the first `max_train` samples of `train` (labelled shards that mix the
    classes) and the first `max_test` of `test`, with the evaluation transform, in shard order.

    Args:
        train: labelled shards the n-shot examples are drawn from.
        test: labelled shards the accuracy is measured on.
        num_classes: K.
        image_size: the images' size; null (the default): the module's encoder's. A size that
            differs from the encoder's is an error naming both.
        channels: 1 or 3; null: the encoder's, and checked like image_size.
        shots: n, the training examples per class.
        seeds: draws of the n examples, averaged.
        every_n_steps: how often to evaluate.
        max_train: training samples read (enough for max(shots) of every class).
        max_test: test samples read.
        l2: the ridge regulariser.
        batch_size: images per forward pass.
        num_workers: DataLoader workers (0 reads in the training process).
        eval_crop_fraction: as ShardDataModule's.
    """

    def __init__(
        self,
        *,
        train: ShardSpec,
        test: ShardSpec,
        num_classes: int,
        image_size: int | tuple[int, int] | None = None,
        channels: int | None = None,
        shots: Sequence[int] = (1, 5, 10, 25),
        seeds: int = 3,
        every_n_steps: int = 1000,
        max_train: int = 10000,
        max_test: int = 10000,
        l2: float = 1024.0,
        batch_size: int = 256,
        num_workers: int = 0,
        eval_crop_fraction: float = 1.0,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"FewShotEvaluation.every_n_steps must be at least 1, got {every_n_steps}")
        if not shots or min(shots) < 1:
            raise ValueError(f"FewShotEvaluation.shots must be positive counts, got {list(shots)}")
        if max_train < num_classes * max(shots):
            raise ValueError(
                f"FewShotEvaluation.max_train={max_train} cannot hold {max(shots)} shots of {num_classes} classes"
            )
        self.num_classes, self.shots, self.seeds, self.l2 = num_classes, tuple(shots), seeds, l2
        self.every_n_steps, self.max_train, self.max_test = every_n_steps, max_train, max_test
        # The few-shot training set is read as the module's `val` split: evaluation transform, in order.
        self.data = ShardDataModule(
            val=train, test=test, batch_size=batch_size, num_workers=num_workers, image_size=image_size,
            channels=channels, eval_crop_fraction=eval_crop_fraction, shard_shuffle=False, shuffle_buffer=0,
        )
        self.last_step: int | None = None
        self.history: dict[int, dict[int, float]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError("FewShotEvaluation runs the encoder on rank zero alone, which FSDP's sharded "
                             "weights do not allow: use DDP or remove the callback")
        try:  # checked against, and completed from, the module's encoder, as the run's own data is
            self.data.setup(rank=0, world_size=1, encoder=getattr(pl_module, "encoder_config", None))
        except ValueError as error:
            raise ValueError(f"FewShotEvaluation: {error}".replace("data.", "FewShotEvaluation.")) from None

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[int, float]:
        """Extract both feature sets with the current encoder, fit and score every n; log the results."""
        step = trainer.global_step
        with trainer.precision_plugin.forward_context():
            features, labels = self._features(pl_module, self.data.val_dataloader(), self.max_train)
            test_features, test_labels = self._features(pl_module, self.data.test_dataloader(), self.max_test)
        results = fewshot_evaluation(
            features, labels, test_features, test_labels,
            shots=self.shots, seeds=self.seeds, num_classes=self.num_classes, l2=self.l2,
        )
        self.history[step], self.last_step = results, step
        # Straight to the loggers: this also runs in on_train_end, where `self.log` is not allowed.
        metrics = {f"fewshot/{n}shot": accuracy for n, accuracy in results.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        return results

    @staticmethod
    def _features(pl_module: pl.LightningModule, loader: Iterable[dict[str, Tensor]], limit: int) -> tuple[Tensor, Tensor]:
        return extract_features(pl_module.encoder, limited(loader, limit), normalise=pl_module.normalise, device=pl_module.device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The starting point, and an early failure if the few-shot data cannot serve the shots.
        if trainer.is_global_zero and self.last_step != trainer.global_step:
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step % self.every_n_steps == 0 and self.last_step != step:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.last_step != trainer.global_step:
            self.evaluate(trainer, pl_module)


def evaluate_checkpoint(
    path: str,
    *,
    train: ShardSpec,
    test: ShardSpec,
    shots: Sequence[int] = (1, 5, 10, 25),
    seeds: int = 3,
    num_classes: int | None = None,
    max_train: int = 10000,
    max_test: int = 10000,
    image_size: int | tuple[int, int] | None = None,
    l2: float = 1024.0,
    batch_size: int = 256,
    num_workers: int = 2,
    eval_crop_fraction: float = 1.0,
    device: torch.device | str = "cpu",
) -> tuple[dict[int, float], int, int]:
    """Few-shot accuracy of any mpp checkpoint's frozen encoder -> ({n: accuracy}, train count, test count).

    The n-shot examples come from the first `max_train` samples of `train`, in shard order.
    """
    encoder, normalise = encoder_and_normalisation(path)
    if image_size is not None:
        encoder.resize_positions(image_size)
    encoder.to(device)
    normalise.to(device)
    data = ShardDataModule(
        val=train, test=test, batch_size=batch_size, num_workers=num_workers,
        image_size=encoder.config.image_size, channels=encoder.config.channels,
        eval_crop_fraction=eval_crop_fraction, shard_shuffle=False, shuffle_buffer=0,
    )
    data.setup(rank=0, world_size=1)
    features, labels = extract_features(encoder, limited(data.val_dataloader(), max_train), normalise=normalise, device=device)
    test_features, test_labels = extract_features(
        encoder, limited(data.test_dataloader(), max_test), normalise=normalise, device=device
    )
    if labels.min() < 0 or test_labels.min() < 0:
        raise ValueError("the shards hold unlabelled samples; few-shot evaluation needs `.cls` labels")
    num_classes = num_classes or int(max(labels.max(), test_labels.max())) + 1
    results = fewshot_evaluation(
        features, labels, test_features, test_labels, shots=shots, seeds=seeds, num_classes=num_classes, l2=l2
    )
    return results, len(labels), len(test_labels)
