"""Few-shot, k-NN and linear-probe accuracy of a frozen encoder (mpp.eval.linear, mpp.eval.knn) on
labelled shards, all three from one extraction of its features: a callback that measures them during
training, and evaluate_checkpoint for any mpp checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy
from torch import Tensor, nn

from mpp.data.loader import EmptyEpochError
from mpp.data.module import ShardDataModule, ShardSpec, listed_classes_of, run_shards
from mpp.data.stream import EmptyShardsError
from mpp.eval.knn import knn_accuracy
from mpp.eval.linear import DEFAULTS, fewshot_evaluation, linear_probe
from mpp.model.checkpoint import encoder_and_normalisation
from mpp.model.pixels import to_unit_range
from mpp.model.vit import ViT
from mpp.precision import run_precision

log = logging.getLogger("mpp")


def fewshot_data(
    train: ShardSpec,
    test: ShardSpec,
    *,
    batch_size: int,
    num_workers: int,
    eval_crop_fraction: float,
    image_size: int | tuple[int, int] | None = None,
    channels: int | None = None,
) -> ShardDataModule:
    """The labelled shards of a few-shot evaluation; `train` is read as the `val` split (evaluation
    transform, shard order), so both are read the same way."""
    return ShardDataModule(
        val=train,
        test=test,
        batch_size=batch_size,
        num_workers=num_workers,
        image_size=image_size,
        channels=channels,
        eval_crop_fraction=eval_crop_fraction,
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
    shots: Sequence[int],
    seeds: int,
    l2: float,
    knn_k: int,
    knn_temperature: float,
    probe_l2s: Sequence[float],
    probe_held_out: float,
) -> FrozenScores:
    """(N, D), (N,), (M, D), (M,) -> few-shot, k-NN and linear-probe accuracy on the same features."""
    probe = linear_probe(
        features, labels, test_features, test_labels, num_classes=num_classes, l2s=probe_l2s, held_out=probe_held_out
    )
    return FrozenScores(
        fewshot=fewshot_evaluation(
            features, labels, test_features, test_labels, shots=shots, seeds=seeds, num_classes=num_classes, l2=l2
        ),
        knn=knn_accuracy(
            features, labels, test_features, test_labels, num_classes=num_classes, k=knn_k, temperature=knn_temperature
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


class FewShotEvaluation(pl.Callback):
    """Logs `fewshot/<n>shot` (linear few-shot accuracy of the frozen encoder's y), `fewshot/knn` and
    `fewshot/linear` (k-NN and linear-probe accuracy from all the training labels read) and
    `fewshot/linear_l2` (the probe's chosen l2) at the start of training, every `every_n_steps` steps
    and at the end, on rank zero. The three come from one extraction of the features.

    Uses the module's `encoder` and `normalise`, so it runs under pretraining and fine-tuning alike.
    Features come from the first `max_train` samples of `train` (labelled shards that mix the
    classes) and the first `max_test` of `test`, with the evaluation transform, in shard order.
    The defaults are DEFAULTS (FewShotSettings), which evaluate_checkpoint and tools/fewshot.py share.

    Args:
        train: labelled shards the n-shot examples are drawn from; null (the default): the run's
            `data.train`.
        test: labelled shards the accuracy is measured on; null: the run's `data.val` (or
            `data.test` where there is no val).
        num_classes: K; null: the number of classes the shards' index lists, else the largest
            label read plus one.
        image_size: the images' size; null (the default): the module's encoder's. A size that
            differs from the encoder's is an error naming both.
        channels: 1 or 3; null: the encoder's, and checked like image_size.
        shots: n, the training examples per class.
        seeds: draws of the n examples, averaged.
        every_n_steps: how often to evaluate.
        max_train: training samples read (enough for max(shots) of every class); k-NN and the probe use all.
        max_test: test samples read.
        l2: the few-shot ridge regulariser.
        knn_k: the neighbours that vote.
        knn_temperature: T of a neighbour's vote exp(cosine similarity / T).
        probe_l2s: the linear probe's ridge regularisers to choose from.
        probe_held_out: the fraction of the training features the probe's l2 is chosen on, before it is
            refitted on all of them.
        batch_size: images per forward pass.
        num_workers: DataLoader workers (0 reads in the training process; more reorder the samples).
        eval_crop_fraction: as ShardDataModule's.
    """

    def __init__(
        self,
        *,
        train: ShardSpec | None = None,
        test: ShardSpec | None = None,
        num_classes: int | None = None,
        image_size: int | tuple[int, int] | None = None,
        channels: int | None = None,
        shots: Sequence[int] = DEFAULTS.shots,
        seeds: int = DEFAULTS.seeds,
        every_n_steps: int = DEFAULTS.every_n_steps,
        max_train: int = DEFAULTS.max_train,
        max_test: int = DEFAULTS.max_test,
        l2: float = DEFAULTS.l2,
        knn_k: int = DEFAULTS.knn_k,
        knn_temperature: float = DEFAULTS.knn_temperature,
        probe_l2s: Sequence[float] = DEFAULTS.probe_l2s,
        probe_held_out: float = DEFAULTS.probe_held_out,
        batch_size: int = DEFAULTS.batch_size,
        num_workers: int = DEFAULTS.num_workers,
        eval_crop_fraction: float = DEFAULTS.eval_crop_fraction,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"FewShotEvaluation.every_n_steps must be at least 1, got {every_n_steps}")
        if not shots or min(shots) < 1:
            raise ValueError(f"FewShotEvaluation.shots must be positive counts, got {list(shots)}")
        if knn_k < 1 or knn_temperature <= 0:
            raise ValueError(
                f"FewShotEvaluation.knn_k must be at least 1 and knn_temperature positive, got {knn_k} and {knn_temperature}"
            )
        if not probe_l2s or min(probe_l2s) <= 0 or not 0 < probe_held_out < 1:
            raise ValueError(
                "FewShotEvaluation.probe_l2s must be positive values and probe_held_out a fraction between 0 and 1, "
                f"got {list(probe_l2s)} and {probe_held_out}"
            )
        self.num_classes, self.shots, self.seeds, self.l2 = num_classes, tuple(shots), seeds, l2
        self.knn_k, self.knn_temperature = knn_k, knn_temperature
        self.probe_l2s, self.probe_held_out = tuple(probe_l2s), probe_held_out
        self.every_n_steps, self.max_train, self.max_test = every_n_steps, max_train, max_test
        self._check_classes(num_classes, given=True)
        self.specs = {"train": train, "test": test}
        self._data_settings: dict[str, Any] = {
            "batch_size": batch_size,
            "num_workers": num_workers,
            "eval_crop_fraction": eval_crop_fraction,
            "image_size": image_size,
            "channels": channels,
        }
        self.data: ShardDataModule | None = None
        self.last_step: int | None = None
        self.said_shots = self.off = self.following = False
        self.history: dict[int, FrozenScores] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.prepare_run(trainer, run_shards(trainer), pl_module)

    def prepare_run(self, trainer: pl.Trainer, run: dict[str, ShardSpec | None], pl_module: pl.LightningModule) -> None:
        """Choose and check the shards (`run`: the run's, by split) against the module's encoder; `mpp`
        calls it before the run starts too, so that what cannot work stops it before W&B does."""
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "FewShotEvaluation runs the encoder on rank zero alone, which FSDP's sharded "
                "weights do not allow: use DDP or remove the callback"
            )
        train, test = self._shards(run)
        self.following = self.specs["train"] is None or self.specs["test"] is None
        if self.num_classes is None:
            listed = listed_classes_of(train)
            self._check_classes(None if listed is None else len(listed[0]))
        self.data = fewshot_data(train, test, **self._data_settings)
        try:  # checked against, and completed from, the module's encoder, as the run's own data is
            self.data.setup(rank=0, world_size=1, encoder=getattr(pl_module, "encoder_config", None))
        except ValueError as error:
            raise ValueError(f"FewShotEvaluation: {error}".replace("data.", "FewShotEvaluation.")) from None

    def _shards(self, run: dict[str, ShardSpec | None]) -> tuple[ShardSpec, ShardSpec]:
        """The shards given, else the run's own: its training shards, and its validation (or test) shards."""
        train = self.specs["train"] or run.get("train")
        test = self.specs["test"] or run.get("val") or run.get("test")
        if train is None or test is None:
            raise ValueError(
                "FewShotEvaluation: the run has no data.train and data.val (or data.test) to evaluate on: "
                "give FewShotEvaluation.train and .test"
            )
        return train, test

    def _check_classes(self, num_classes: int | None, *, given: bool = False) -> None:
        """Keep K (None: from the index or the labels read). A K given with the callback must leave room for
        max(shots) of each class in max_train; one read from the shards leaves out the shots they cannot serve."""
        if given and num_classes is not None and self.max_train < num_classes * max(self.shots):
            raise ValueError(
                f"FewShotEvaluation.max_train={self.max_train} cannot hold {max(self.shots)} shots of {num_classes} classes"
            )
        self.num_classes = num_classes

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> FrozenScores | None:
        """Extract both feature sets with the current encoder, score every n, k-NN and the probe on them; log
        the scores. Shards that cannot serve an evaluation are an error where they were given, and turn the
        callback off, with a warning, where they are the run's own (unlabelled pretraining shards): None."""
        step = trainer.global_step
        if self.data is None:
            raise RuntimeError("FewShotEvaluation.evaluate before setup")
        try:
            with trainer.precision_plugin.forward_context():
                features, labels = self._features(pl_module, self.data.val_dataloader(), self.max_train)
                test_features, test_labels = self._features(pl_module, self.data.test_dataloader(), self.max_test)
            problem = self._unusable(labels, test_labels)
        except (EmptyEpochError, EmptyShardsError) as error:  # the run's own stream says it, in its own words
            if not self.following:
                raise
            problem = f"the run's shards hold no sample to evaluate on ({type(error).__name__})"
        if problem and not self.following:
            raise ValueError(f"FewShotEvaluation: {problem}")
        if problem:
            log.warning(
                "FewShotEvaluation: %s: the run goes on without few-shot evaluation (give the callback "
                "labelled train and test shards of its own to have one)",
                problem,
            )
            self.off = True
            return None
        scores = score_features(
            features,
            labels,
            test_features,
            test_labels,
            num_classes=cast(int, self.num_classes),
            shots=self._servable(labels),
            seeds=self.seeds,
            l2=self.l2,
            knn_k=self.knn_k,
            knn_temperature=self.knn_temperature,
            probe_l2s=self.probe_l2s,
            probe_held_out=self.probe_held_out,
        )
        self.history[step], self.last_step = scores, step
        # Straight to the loggers: this also runs in on_train_end, where `self.log` is not allowed.
        for logger in trainer.loggers:
            logger.log_metrics(scores.metrics(), step=step)
        return scores

    def _unusable(self, labels: Tensor, test_labels: Tensor) -> str | None:
        """What keeps the labels read from serving the evaluation, if anything (K is taken from them if unset)."""
        if labels.min() < 0 or test_labels.min() < 0:
            assert self.data is not None
            shards = " and ".join(str(spec) for spec in self.data.specs.values() if spec is not None)
            return f"{shards} hold unlabelled samples (no .cls)"
        if self.num_classes is None:
            self._check_classes(int(max(labels.max(), test_labels.max())) + 1)
        fewest = int(torch.bincount(labels, minlength=cast(int, self.num_classes)).min())
        if fewest < min(self.shots):
            return (
                f"a class has {fewest} examples among the {len(labels)} training samples read, fewer than "
                f"{min(self.shots)} shots: give more training samples (max_train), shards that mix the classes, "
                "or fewer shots"
            )
        return None

    def _servable(self, labels: Tensor) -> tuple[int, ...]:
        """The shots every class has examples for among the labels read; the others are left out, said once."""
        fewest = int(torch.bincount(labels, minlength=cast(int, self.num_classes)).min())
        served = tuple(n for n in self.shots if n <= fewest)
        if served != self.shots and not self.said_shots:
            log.warning(
                "FewShotEvaluation: a class has %d examples among the %d training samples read: %s-shot left out",
                fewest,
                len(labels),
                "/".join(str(n) for n in self.shots if n not in served),
            )
            self.said_shots = True
        return served

    @staticmethod
    def _features(
        pl_module: pl.LightningModule, loader: Iterable[dict[str, Tensor]], limit: int
    ) -> tuple[Tensor, Tensor]:
        encoder, normalise = cast(ViT, pl_module.encoder), cast(nn.Module, pl_module.normalise)  # an EncoderModule's
        return extract_features(encoder, limited(loader, limit), normalise=normalise, device=pl_module.device)

    def _due(self, trainer: pl.Trainer) -> bool:
        return trainer.is_global_zero and not self.off and self.last_step != trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The starting point, and an early failure if the few-shot data cannot serve the shots.
        if self._due(trainer):
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps == 0 and self._due(trainer):
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer):
            self.evaluate(trainer, pl_module)


def evaluate_checkpoint(
    path: str,
    *,
    train: ShardSpec,
    test: ShardSpec,
    shots: Sequence[int] = DEFAULTS.shots,
    seeds: int = DEFAULTS.seeds,
    num_classes: int | None = None,
    max_train: int = DEFAULTS.max_train,
    max_test: int = DEFAULTS.max_test,
    image_size: int | tuple[int, int] | None = None,
    l2: float = DEFAULTS.l2,
    knn_k: int = DEFAULTS.knn_k,
    knn_temperature: float = DEFAULTS.knn_temperature,
    probe_l2s: Sequence[float] = DEFAULTS.probe_l2s,
    probe_held_out: float = DEFAULTS.probe_held_out,
    batch_size: int = DEFAULTS.batch_size,
    num_workers: int = DEFAULTS.num_workers,
    eval_crop_fraction: float = DEFAULTS.eval_crop_fraction,
    device: torch.device | str = "cpu",
    precision: str | None = None,
) -> FrozenScores:
    """Few-shot, k-NN and linear-probe accuracy of any mpp checkpoint's frozen encoder, and the counts of
    training and test features they came from (the arguments: FewShotEvaluation's).

    The n-shot examples come from the first `max_train` samples of `train`, in shard order; k-NN and
    the probe take all of them. The features are computed under bf16 autocast if `precision` is a
    bf16 one and the device computes bf16; None: the precision `mpp fit` takes on this device when a
    config names none (mpp.precision).
    """
    device_type = torch.device(device).type
    precision = run_precision(precision, device_type)[0]
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision.startswith("bf16"))
    encoder, normalise = encoder_and_normalisation(path)
    if image_size is not None:
        encoder.resize_positions(image_size)
    encoder.to(device)
    normalise.to(device)
    data = fewshot_data(
        train, test, batch_size=batch_size, num_workers=num_workers, eval_crop_fraction=eval_crop_fraction
    )
    data.setup(rank=0, world_size=1, encoder=encoder.config)  # the images take the encoder's size and channels
    with autocast:
        features, labels = extract_features(
            encoder, limited(data.val_dataloader(), max_train), normalise=normalise, device=device
        )
        test_features, test_labels = extract_features(
            encoder, limited(data.test_dataloader(), max_test), normalise=normalise, device=device
        )
    if labels.min() < 0 or test_labels.min() < 0:
        raise ValueError("the shards hold unlabelled samples; few-shot, k-NN and probe evaluation need `.cls` labels")
    num_classes = num_classes or int(max(labels.max(), test_labels.max())) + 1
    return score_features(
        features,
        labels,
        test_features,
        test_labels,
        num_classes=num_classes,
        shots=shots,
        seeds=seeds,
        l2=l2,
        knn_k=knn_k,
        knn_temperature=knn_temperature,
        probe_l2s=probe_l2s,
        probe_held_out=probe_held_out,
    )
