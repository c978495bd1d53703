"""FewShotEvaluation: the few-shot, k-NN and linear-probe accuracy of the frozen encoder (mpp.eval.frozen)
measured during training, on the run's own shards or shards of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy
from torch import Tensor, nn

from mpp.data.classes import listed_classes_of
from mpp.data.loader import EmptyEpochError
from mpp.data.module import ShardDataModule, ShardSpec, run_shards
from mpp.data.stream import EmptyShardsError
from mpp.errors import refuse_invalid
from mpp.eval.frozen import FrozenScores, extract_features, fewshot_data, limited, score_features
from mpp.eval.linear import FewShotSettings
from mpp.model.vit import ViT

log = logging.getLogger("mpp")


@dataclass(frozen=True)
class FewShotConfig(FewShotSettings):
    """The few-shot callback's keys: the images it reads, and the evaluation's settings.

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
        eval_crop_fraction: as data.eval_crop_fraction.
    """

    train: ShardSpec | None = None
    test: ShardSpec | None = None
    num_classes: int | None = None
    image_size: int | tuple[int, int] | None = None
    channels: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shots", tuple(self.shots))  # a list given in Python, kept as the config's tuple
        object.__setattr__(self, "probe_l2s", tuple(self.probe_l2s))
        shots, classes = self.shots, self.num_classes
        refuse_invalid("FewShotEvaluation", self, [
            ("every_n_steps", self.every_n_steps >= 1, "at least 1"),
            ("shots", bool(shots) and min(shots) >= 1, "positive counts"),
            ("knn_k", self.knn_k >= 1, "at least 1"),
            ("knn_temperature", self.knn_temperature > 0, "positive"),
            ("probe_l2s", bool(self.probe_l2s) and min(self.probe_l2s) > 0, "positive values"),
            ("probe_held_out", 0 < self.probe_held_out < 1, "a fraction between 0 and 1"),
            ("max_train", not shots or classes is None or self.max_train >= classes * max(shots),
             f"enough for {max(shots or (0,))} shots of {classes} classes"),
        ])  # fmt: skip

    @property
    def settings(self) -> FewShotSettings:
        """The evaluation's settings, as evaluate_checkpoint and mpp evaluate take them."""
        return FewShotSettings(**{field.name: getattr(self, field.name) for field in fields(FewShotSettings)})


class FewShotEvaluation(pl.Callback):
    """Logs `fewshot/<n>shot` (linear few-shot accuracy of the frozen encoder's y), `fewshot/knn` and
    `fewshot/linear` (k-NN and linear-probe accuracy from all the training labels read) and
    `fewshot/linear_l2` (the probe's chosen l2) at the start of training, every `every_n_steps` steps
    and at the end, on rank zero. The three come from one extraction of the features.

    Uses the module's `encoder` and `normalise`, so it runs under pretraining and fine-tuning alike.
    Features come from the first `max_train` samples of `train` (labelled shards that mix the
    classes) and the first `max_test` of `test`, with the evaluation transform, in shard order.
    Its keys are FewShotConfig's; their defaults DEFAULTS (FewShotSettings), which evaluate_checkpoint
    and mpp evaluate share.
    """

    def __init__(self, **settings: Any) -> None:
        self.config = FewShotConfig(**settings)
        self.settings = self.config.settings
        self.num_classes = self.config.num_classes
        self.specs = {"train": self.config.train, "test": self.config.test}
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
            self.num_classes = None if listed is None else len(listed[0])
        config = self.config
        self.data = fewshot_data(train, test, self.settings, image_size=config.image_size, channels=config.channels)
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

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> FrozenScores | None:
        """Extract both feature sets with the current encoder, score every n, k-NN and the probe on them; log
        the scores. Shards that cannot serve an evaluation are an error where they were given, and turn the
        callback off, with a warning, where they are the run's own (unlabelled pretraining shards): None."""
        step = trainer.global_step
        if self.data is None:
            raise RuntimeError("FewShotEvaluation.evaluate before setup")
        try:
            with trainer.precision_plugin.forward_context():
                features, labels = self._features(pl_module, self.data.val_dataloader(), self.settings.max_train)
                test_features, test_labels = self._features(
                    pl_module, self.data.test_dataloader(), self.settings.max_test
                )
            shots, problem = self._shots(labels, test_labels)
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
        served = replace(self.settings, shots=shots)
        scores = score_features(
            features, labels, test_features, test_labels, num_classes=cast(int, self.num_classes), settings=served
        )
        self.history[step], self.last_step = scores, step
        # Straight to the loggers: this also runs in on_train_end, where `self.log` is not allowed.
        for logger in trainer.loggers:
            logger.log_metrics(scores.metrics(), step=step)
        return scores

    def _shots(self, labels: Tensor, test_labels: Tensor) -> tuple[tuple[int, ...], str | None]:
        """The shots the labels read can serve (K taken from them if unset; the shots some class has too few
        examples for are left out, said once), or what keeps them from serving any."""
        if labels.min() < 0 or test_labels.min() < 0:
            assert self.data is not None
            shards = " and ".join(str(spec) for spec in self.data.specs.values() if spec is not None)
            return (), f"{shards} hold unlabelled samples (no .cls)"
        if self.num_classes is None:  # K read from the shards: the shots they cannot serve are left out
            self.num_classes = int(max(labels.max(), test_labels.max())) + 1
        fewest = int(torch.bincount(labels, minlength=self.num_classes).min())
        served = tuple(n for n in self.settings.shots if n <= fewest)
        if not served:
            return (), (
                f"a class has {fewest} examples among the {len(labels)} training samples read, fewer than "
                f"{min(self.settings.shots)} shots: give more training samples (max_train), shards that mix the classes, "
                "or fewer shots"
            )
        if served != self.settings.shots and not self.said_shots:
            log.warning(
                "FewShotEvaluation: a class has %d examples among the %d training samples read: %s-shot left out",
                fewest,
                len(labels),
                "/".join(str(n) for n in self.settings.shots if n not in served),
            )
            self.said_shots = True
        return served, None

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
        if trainer.global_step % self.settings.every_n_steps == 0 and self._due(trainer):
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer):
            self.evaluate(trainer, pl_module)
