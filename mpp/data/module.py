"""ShardDataModule: WebDataset tar shards -> decoded, augmented uint8 batches.

A batch is a dict, typed mpp.data.batches.Batch: "image" uint8 (B, C, H, W), "label" int64 (B,)
(-1 unlabelled), "skipped" int64 (), and in prediction "key" and "shard"; the loader's "position" (and
with decode="device", "jpegs") are taken off as the batch moves to the device.

Shards are split over ranks (rank and world size from the trainer) and then over DataLoader
workers. Without `resampled`, each sample is read once per epoch across all ranks x workers;
with it, every rank draws shards at random with replacement from its own share (disjoint
across ranks, and across its workers where there are enough shards) and yields
samples_per_epoch // (world_size * batch_size) batches, so DDP ranks stay in step.

Training streams are seeded by the epoch and by the global step the epoch started at. A
checkpoint holds where the epoch is on every rank (ShardLoader.state_dict): a run resumed from
it continues the epoch with the very samples, order and augmentation the run that was never
stopped would have had. Resumed with other data settings (world size, workers, batch size, the
shards, ...), the epoch starts afresh, seeded by the step it resumes at, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import pytorch_lightning as pl
import torch

from mpp.data.batches import StreamBatch
from mpp.data.config import DataConfig, ShardSpec
from mpp.data.device_decode import finish_on_device, torchvision_io
from mpp.data.loader import ShardLoader, gather_ranks
from mpp.data.stream import StreamSettings
from mpp.data.transforms import Encoder, ImageTransform, fitted_shape
from mpp.data.urls import check_repeated, expand_shards
from mpp.errors import ConfigError
from mpp.secrets import redact, redact_tree

log = logging.getLogger(__name__)


class ShardDataModule(pl.LightningDataModule):
    """Shards -> batches {"image": uint8 (B, C, H, W), "label": int64 (B,), "skipped": int64 ()}.

    Its settings are the `data:` keys of a config, mpp.data.config.DataConfig (which says what each
    is, and checks them all where it is made): `ShardDataModule(train=..., batch_size=...)`.

    Rank and world size come from the trainer in setup(), or from setup(rank=, world_size=).
    The epoch that reseeds shard order comes from trainer.current_epoch, or set_epoch(). A
    training stream is also seeded by trainer.global_step when its epoch starts (or set_epoch's
    `step`); a run resumed mid-epoch continues the epoch where its checkpoint was written.
    """

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        self.config = DataConfig(**settings)
        # Lightning hands these to every logger and checkpoint: shard URLs go with credentials masked.
        self.save_hyperparameters(redact_tree(self.config.as_dict()))
        if self.config.decode == "device":
            torchvision_io()  # now, not in the first batch: a missing torchvision is a config error
        self.specs = self.config.shards
        self.predict_split = next((split for split in ("predict", "test", "val") if self.specs[split]), "predict")
        self.samples_per_epoch = self.config.samples_per_epoch  # or, once expanded, what train's indexes list
        self.rank, self.world_size = 0, 1
        self.urls: dict[str, list[str]] = {}
        self._epoch = self._step = 0
        self._train_loader: ShardLoader | None = None

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def setup(
        self,
        stage: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        encoder: Encoder | None = None,
    ) -> None:
        """Expand and check the shards a stage needs; rank/world size default to the trainer's, else 0/1,
        and the encoder whose image size and channels the images take to the trainer's module's."""
        if rank is not None and world_size is not None:
            self.rank, self.world_size = rank, world_size
        elif self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if encoder is None and self.trainer is not None:
            encoder = getattr(self.trainer.lightning_module, "encoder_config", None)
        config = self.config
        size, channels = fitted_shape(config.size, config.channels, encoder)
        splits = self._expand(stage)
        transform = partial(ImageTransform, size=size, channels=channels, max_pixels=config.max_image_pixels)
        self.train_transform = transform(
            train=True, scale=config.crop_scale, ratio=config.crop_ratio, hflip=config.hflip
        )
        self.eval_transform = transform(train=False, crop_fraction=config.eval_crop_fraction)
        train = self.urls.get("train")
        if train is not None and self.world_size > 1 and not config.resampled:
            log.warning(
                "training on %d ranks without resampled=True: ranks may get unequal batch counts, "
                "which stalls DDP; set resampled=True and samples_per_epoch",
                self.world_size,
            )
        if train is not None and len(train) < self.world_size and not config.resampled:
            log.warning("train has %d shards for %d ranks: some ranks read nothing", len(train), self.world_size)
        if train is not None and config.resampled and len(train) < self.world_size and "train" in splits:
            log.warning(
                "train has %d shards for %d ranks: every rank draws from all of them, so ranks "
                "read the same samples; give at least one shard per rank",
                len(train),
                self.world_size,
            )

    def check(self, stage: str | None = None, *, encoder: Encoder | None = None) -> None:
        """What setup would refuse, found before a run starts (and before its loggers do): images whose
        size or channels differ from the encoder's, a split the stage needs and is not given, shards
        that do not exist or are named twice."""
        fitted_shape(self.config.size, self.config.channels, encoder)
        self._expand(stage)

    def _expand(self, stage: str | None) -> tuple[str, ...]:
        """Expand and check the shards of the splits a stage reads; those splits."""
        required = {"fit": "train", "validate": "val", "test": "test", "predict": self.predict_split}.get(stage or "")
        if required is not None and self.specs[required] is None:
            also = " (or data.test or data.val, read where it is unset)" if stage == "predict" else ""
            raise ValueError(f"stage {stage!r} needs shards for {required!r}: set data.{required}{also}")
        splits = ("train", "val") if stage == "fit" else (required,) if required else tuple(self.specs)
        for split in splits:
            spec = self.specs[split]
            if spec is not None and split not in self.urls:  # once: check() may have done it
                try:
                    shards = expand_shards(spec, allow_pipe=self.config.allow_pipe)
                    self.urls[split] = shards.urls
                    if split == "train" and self.samples_per_epoch is None:  # an epoch: the samples the index lists
                        self.samples_per_epoch = shards.samples
                    check_repeated(split, self.urls[split])
                except (OSError, ValueError) as error:
                    raise ConfigError(redact(f"data.{split}: {error}")) from error
        return splits

    def set_epoch(self, epoch: int, *, step: int = 0) -> None:
        """Choose the epoch that seeds shard order and augmentation, and the global step a training
        stream starts at, when there is no trainer."""
        self._epoch, self._step = epoch, step

    def train_dataloader(self) -> ShardLoader:
        """Training batches: random crops and flips, shuffled shards and samples."""
        return self._loader("train", train=True)

    def val_dataloader(self) -> ShardLoader | list:
        """Validation batches: centre crops in shard order (none if `val` is not set)."""
        return self._loader("val", train=False) if self.specs["val"] is not None else []

    def test_dataloader(self) -> ShardLoader:
        """Test batches: centre crops in shard order."""
        return self._loader("test", train=False)

    def predict_dataloader(self) -> ShardLoader:
        """Prediction batches of `predict_split`: centre crops in shard order, with their samples' keys and
        shards; decoded in the workers, as a JPEG the device could not decode would part keys from images."""
        return self._loader(self.predict_split, train=False, named=True)

    def _training_position(self) -> tuple[int, int]:
        """(epoch, global step) as a training stream starts; read at each iter(), as Lightning never
        calls set_epoch on an iterable dataset and the trainer's counts are the truth."""
        if self.trainer is not None:
            return self.trainer.current_epoch, self.trainer.global_step
        return self._epoch, self._step

    def _loader(self, split: str, *, train: bool, named: bool = False) -> ShardLoader:
        if split not in self.urls:
            raise RuntimeError(f"no shards for {split!r}: set data.{split} and call setup() first")
        config = self.config
        resampled = train and config.resampled
        num_batches = None
        if resampled and self.samples_per_epoch is not None:  # set whenever resampled (checked by DataConfig)
            num_batches = self.samples_per_epoch // (self.world_size * config.batch_size)
            if num_batches < 1:
                raise ValueError(
                    f"samples_per_epoch={self.samples_per_epoch} is less than one batch of "
                    f"{config.batch_size} on each of {self.world_size} ranks"
                )
        settings = StreamSettings(
            urls=tuple(self.urls[split]),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=config.batch_size,
            transform=self.train_transform if train else self.eval_transform,
            shard_shuffle=train and config.shard_shuffle,
            shuffle_buffer=config.shuffle_buffer if train else 0,
            resampled=resampled,
            seed=config.seed,
            allow_pipe=config.allow_pipe,
            decode="cpu" if named else config.decode,
            named=named,
        )
        position = self._training_position if train else lambda: (self._training_position()[0], 0)
        loader = ShardLoader(
            settings,
            split=split,
            num_workers=config.num_workers,
            position=position,
            num_batches=num_batches,
            in_step=None if train else self._any_rank(),
            gather=gather_ranks if self.world_size > 1 else None,
        )
        if train:
            self._train_loader = loader
        return loader

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's move to the device, as the step that takes the batch begins: a training batch's resume
        point is noted for the next checkpoint, and a batch with encoded JPEGs (decode="device") is finished
        there. (Not on_before_batch_transfer: Lightning would then skip a module's own, ImageClassifier's.)"""
        if isinstance(batch, dict):
            ours = cast(StreamBatch, batch)  # as a ShardLoader yielded it: Lightning hands it on untyped
            if "position" in ours:
                if self._train_loader is not None and self.trainer is not None and self.trainer.training:
                    self._train_loader.trained(ours)
                ours.pop("position", None)
            if "jpegs" in ours:
                return finish_on_device(ours, device, self.eval_transform)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _any_rank(self) -> Callable[[bool], bool] | None:
        """For evaluation on several ranks: whether any rank still has a batch (see ShardLoader)."""
        if self.world_size == 1 or self.trainer is None:
            return None
        strategy = self.trainer.strategy
        return lambda has_batch: strategy.reduce_boolean_decision(has_batch, all=False)


def run_shards(trainer: pl.Trainer) -> dict[str, ShardSpec | None]:
    """The shards a trainer's run reads, by split (none where its data is not a ShardDataModule):
    what evaluation callbacks read when they are not given shards of their own."""
    data = getattr(trainer, "datamodule", None)
    return dict(data.specs) if isinstance(data, ShardDataModule) else {}
