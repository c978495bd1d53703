"""Few-shot, k-NN and linear-probe accuracy of a frozen encoder (mpp.eval.linear, mpp.eval.knn) on
labelled shards, all three from one extraction of its features: the shards read, the features, the
scores, and evaluate_checkpoint for any mpp checkpoint (the callback that measures them during
training: mpp.eval.fewshot).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mpp.data.module import ShardDataModule, ShardSpec
from mpp.eval.knn import knn_accuracy
from mpp.eval.linear import DEFAULTS, FewShotSettings, fewshot_evaluation, linear_probe
from mpp.model.checkpoint import encoder_and_normalisation
from mpp.model.pixels import to_unit_range
from mpp.model.vit import ViT
from mpp.precision import run_precision


def fewshot_data(
    train: ShardSpec,
    test: ShardSpec,
    settings: FewShotSettings = DEFAULTS,
    *,
    image_size: int | tuple[int, int] | None = None,
    channels: int | None = None,
) -> ShardDataModule:
    """The labelled shards of a few-shot evaluation, read with `settings`' batch size, workers and crop;
    `train` is read as the `val` split (evaluation transform, shard order), so both are read the same way."""
    return ShardDataModule(
        val=train,
        test=test,
        batch_size=settings.batch_size,
        num_workers=settings.num_workers,
        image_size=image_size,
        channels=channels,
        eval_crop_fraction=settings.eval_crop_fraction,
        shard_shuffle=False,
        shuffle_buffer=0,
    )


@torch.no_grad()  # not inference_mode: a compiled encoder has a graph for no_grad already, from validation
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


@dataclass(frozen=True)
class FrozenScores:
    """What one evaluation of a frozen encoder measured, on `train` training and `test` test features."""

    fewshot: dict[int, float]  # {n: accuracy from n examples per class, the mean over seeds}
    knn: float  # k-NN accuracy from all training labels
    linear: float  # linear-probe accuracy from all training labels
    linear_l2: float  # the probe's l2, chosen on held-out training features
    train: int
    test: int

    def metrics(self) -> dict[str, float]:
        """The logged names: fewshot/<n>shot, fewshot/knn, fewshot/linear and fewshot/linear_l2."""
        shots = {f"fewshot/{n}shot": accuracy for n, accuracy in self.fewshot.items()}
        return {**shots, "fewshot/knn": self.knn, "fewshot/linear": self.linear, "fewshot/linear_l2": self.linear_l2}


def score_features(
    features: Tensor,
    labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    *,
    num_classes: int,
    settings: FewShotSettings = DEFAULTS,
) -> FrozenScores:
    """(N, D), (N,), (M, D), (M,) -> few-shot (`settings.shots`), k-NN and linear-probe accuracy on the
    same features."""
    train, test = (features, labels), (test_features, test_labels)
    probe = linear_probe(
        *train, *test, num_classes=num_classes, l2s=settings.probe_l2s, held_out=settings.probe_held_out
    )
    return FrozenScores(
        fewshot=fewshot_evaluation(
            *train, *test, shots=settings.shots, seeds=settings.seeds, num_classes=num_classes, l2=settings.l2
        ),
        knn=knn_accuracy(
            *train, *test, num_classes=num_classes, k=settings.knn_k, temperature=settings.knn_temperature
        ),
        linear=probe.accuracy,
        linear_l2=probe.l2,
        train=len(labels),
        test=len(test_labels),
    )


def limited(loader: Iterable[dict[str, Tensor]], limit: int) -> Iterable[dict[str, Tensor]]:
    """The first `limit` samples of a loader's batches (the last batch cut to fit)."""
    seen = 0
    for batch in loader:
        if seen >= limit:
            return
        take = min(limit - seen, len(batch["label"]))
        seen += take
        yield {"image": batch["image"][:take], "label": batch["label"][:take]}


def evaluate_checkpoint(
    path: str,
    *,
    train: ShardSpec,
    test: ShardSpec,
    settings: FewShotSettings = DEFAULTS,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
    precision: str | None = None,
) -> FrozenScores:
    """Few-shot, k-NN and linear-probe accuracy of any mpp checkpoint's frozen encoder, and the counts of
    training and test features they came from (`settings` and the rest: FewShotEvaluation's).

    The n-shot examples come from the first `settings.max_train` samples of `train`, in shard order;
    k-NN and the probe take all of them. The features are computed under bf16 autocast if `precision`
    is a bf16 one and the device computes bf16; None: the precision `mpp fit` takes on this device
    when a config names none (mpp.precision).
    """
    device_type = torch.device(device).type
    precision = run_precision(precision, device_type)[0]
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision.startswith("bf16"))
    encoder, normalise = encoder_and_normalisation(path)
    if image_size is not None:
        encoder.resize_positions(image_size)
    encoder.to(device)
    normalise.to(device)
    data = fewshot_data(train, test, settings)
    data.setup(rank=0, world_size=1, encoder=encoder.config)  # the images take the encoder's size and channels
    with autocast:
        features, labels = extract_features(
            encoder, limited(data.val_dataloader(), settings.max_train), normalise=normalise, device=device
        )
        test_features, test_labels = extract_features(
            encoder, limited(data.test_dataloader(), settings.max_test), normalise=normalise, device=device
        )
    if labels.min() < 0 or test_labels.min() < 0:
        raise ValueError("the shards hold unlabelled samples; few-shot, k-NN and probe evaluation need `.cls` labels")
    num_classes = num_classes or int(max(labels.max(), test_labels.max())) + 1
    return score_features(features, labels, test_features, test_labels, num_classes=num_classes, settings=settings)
