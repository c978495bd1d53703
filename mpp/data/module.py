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
from mpp.data.device_decode import finish_on_device, torchvision_io
from mpp.data.loader import ShardLoader, gather_ranks
from mpp.data.stream import Decode, StreamSettings
from mpp.data.transforms import Encoder, ImageTransform, fitted_shape, pair
from mpp.data.urls import check_repeated, expand_shards, names_indexes
from mpp.errors import ConfigError
from mpp.secrets import redact, redact_tree
from mpp.shards.images import DEFAULT_MAX_PIXELS

log = logging.getLogger(__name__)

ShardSpec = str | list[str]


def _require(ok: bool, name: str, value: object, wanted: str) -> None:
    if not ok:
        raise ValueError(f"ShardDataModule: {name}={value!r} is invalid; it must be {wanted}")


class ShardDataModule(pl.LightningDataModule):
    """Shards -> batches {"image": uint8 (B, C, H, W), "label": int64 (B,), "skipped": int64 ()}.

    Args:
        train, val, test, predict: shards of each split: a path, a brace pattern
            (`shards/train-{000000..000009}.tar`), a local glob, an http(s)://, s3://, gs://
            or pipe: URL, or a list of those. Labels are read where present and ignored by
            pretraining. `mpp predict` reads predict, or where it is unset test, else val.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader worker processes per rank (0 reads in the main process).
        image_size: output size, an int or (H, W); null (the default): the encoder's, read from the
            trainer's module (`model.init_args.encoder.image_size`), or 224 used alone. A size set
            here that differs from the encoder's stops the run before training, naming both keys.
        channels: 1 or 3, any PIL mode converted (16-bit scaled, alpha composited on black); null:
            the encoder's, or 3 used alone; checked against the encoder as image_size is.
        crop_scale, crop_ratio: area fraction and aspect (w/h) range of the training crop.
        hflip: flip training images horizontally half of the time.
        eval_crop_fraction: evaluation resizes to cover image_size / eval_crop_fraction, then
            centre-crops image_size (1.0: resize the short side to the crop).
        shard_shuffle: shuffle the training shard order, anew each epoch.
        shuffle_buffer: training samples held in each worker's shuffle buffer (0 or 1: none).
        resampled: draw training shards with replacement, an endless stream cut into epochs of
            samples_per_epoch samples (across all ranks); use it for multi-GPU training. Each
            rank draws from its own shards, urls[rank::world_size], and each of its workers
            from its own part of those, where there are enough; with fewer shards than ranks
            every rank draws from all (and a warning says so).
        samples_per_epoch: global training samples per epoch; required with `resampled`, unless train
            names shard indexes (`train.json`) only: the samples they list, then.
        seed: seeds shard order, sample shuffle and augmentation (with epoch, step, rank and worker).
        allow_pipe: allow pipe: URLs, which run shell commands.
        max_image_pixels: an image whose header declares more pixels is skipped (and counted)
            without being decoded. The default is PIL's Image.MAX_IMAGE_PIXELS default, about
            0.25 GiB of RGB; PIL itself still refuses images over twice its own limit.
        decode: "cpu": JPEGs are decoded in the DataLoader workers. "device": the workers read a
            JPEG's header only and draw its crop and flip (those of "cpu" for the same seed); the
            batch's JPEGs are decoded, cropped and resized on the device it moves to (batched nvjpeg
            on a GPU; one that fails there, on the CPU). Pixels equal "cpu"'s but for nvjpeg's own
            rounding and crops of twice image_size or more, which "cpu" decodes at reduced scale
            (mpp.data.device_decode). Needs torchvision: the `gpu-decode` extra.

    Rank and world size come from the trainer in setup(), or from setup(rank=, world_size=).
    The epoch that reseeds shard order comes from trainer.current_epoch, or set_epoch(). A
    training stream is also seeded by trainer.global_step when its epoch starts (or set_epoch's
    `step`); a run resumed mid-epoch continues the epoch where its checkpoint was written.
    """

    def __init__(
        self,
        *,
        train: ShardSpec | None = None,
        val: ShardSpec | None = None,
        test: ShardSpec | None = None,
        predict: ShardSpec | None = None,
        batch_size: int = 64,
        num_workers: int = 4,
        image_size: int | tuple[int, int] | None = None,
        channels: int | None = None,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: bool = True,
        eval_crop_fraction: float = 0.875,
        shard_shuffle: bool = True,
        shuffle_buffer: int = 1000,
        resampled: bool = False,
        samples_per_epoch: int | None = None,
        seed: int = 0,
        allow_pipe: bool = False,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        decode: Decode = "cpu",
    ) -> None:
        settings = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        super().__init__()
        # Lightning hands these to every logger and checkpoint: shard URLs go with credentials masked.
        self.save_hyperparameters(redact_tree(settings))
        size = None if image_size is None else pair(image_size)
        _require(batch_size >= 1, "batch_size", batch_size, "a positive number of samples")
        _require(num_workers >= 0, "num_workers", num_workers, "0 or more worker processes")
        _require(
            size is None or (len(size) == 2 and min(size) >= 1),
            "image_size",
            image_size,
            "an int or (H, W), or null for the encoder's",
        )
        _require(channels in (None, 1, 3), "channels", channels, "1 or 3, or null for the encoder's")
        _require(0 < crop_scale[0] <= crop_scale[1] <= 1, "crop_scale", crop_scale, "(min, max) in (0, 1]")
        _require(0 < crop_ratio[0] <= crop_ratio[1], "crop_ratio", crop_ratio, "(min, max) > 0")
        _require(0 < eval_crop_fraction <= 1, "eval_crop_fraction", eval_crop_fraction, "in (0, 1]")
        _require(shuffle_buffer >= 0, "shuffle_buffer", shuffle_buffer, "0 or more samples")
        _require(
            samples_per_epoch is None or samples_per_epoch >= 1,
            "samples_per_epoch",
            samples_per_epoch,
            "a positive number",
        )
        _require(
            not resampled or samples_per_epoch is not None or names_indexes(train),
            "samples_per_epoch",
            samples_per_epoch,
            "set with resampled=True, which makes an endless stream (or data.train a shard index, whose samples it is)",
        )
        _require(max_image_pixels >= 1, "max_image_pixels", max_image_pixels, "a positive number of pixels")
        _require(decode in ("cpu", "device"), "decode", decode, '"cpu" or "device"')
        if decode == "device":
            torchvision_io()  # now, not in the first batch: a missing torchvision is a config error
        self.specs = {"train": train, "val": val, "test": test, "predict": predict}
        self.predict_split = next((split for split in ("predict", "test", "val") if self.specs[split]), "predict")
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.resampled, self.samples_per_epoch, self.allow_pipe = resampled, samples_per_epoch, allow_pipe
        self.shard_shuffle, self.shuffle_buffer = shard_shuffle, shuffle_buffer
        self.image_size, self.channels = size, channels
        self._augment = ((crop_scale[0], crop_scale[1]), (crop_ratio[0], crop_ratio[1]), hflip)
        self._eval_crop_fraction, self._max_pixels, self.decode = eval_crop_fraction, max_image_pixels, decode
        self.rank, self.world_size = 0, 1
        self.urls: dict[str, list[str]] = {}
        self._epoch = self._step = 0
        self._train_loader: ShardLoader | None = None

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
        size, channels = fitted_shape(self.image_size, self.channels, encoder)
        splits = self._expand(stage)
        scale, ratio, hflip = self._augment
        transform = partial(ImageTransform, size=size, channels=channels, max_pixels=self._max_pixels)
        self.train_transform = transform(train=True, scale=scale, ratio=ratio, hflip=hflip)
        self.eval_transform = transform(train=False, crop_fraction=self._eval_crop_fraction)
        train = self.urls.get("train")
        if train is not None and self.world_size > 1 and not self.resampled:
            log.warning(
                "training on %d ranks without resampled=True: ranks may get unequal batch counts, "
                "which stalls DDP; set resampled=True and samples_per_epoch",
                self.world_size,
            )
        if train is not None and len(train) < self.world_size and not self.resampled:
            log.warning("train has %d shards for %d ranks: some ranks read nothing", len(train), self.world_size)
        if train is not None and self.resampled and len(train) < self.world_size and "train" in splits:
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
        fitted_shape(self.image_size, self.channels, encoder)
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
                    shards = expand_shards(spec, allow_pipe=self.allow_pipe)
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
        resampled = train and self.resampled
        num_batches = None
        if resampled and self.samples_per_epoch is not None:  # set whenever resampled (checked in __init__)
            num_batches = self.samples_per_epoch // (self.world_size * self.batch_size)
            if num_batches < 1:
                raise ValueError(
                    f"samples_per_epoch={self.samples_per_epoch} is less than one batch of "
                    f"{self.batch_size} on each of {self.world_size} ranks"
                )
        settings = StreamSettings(
            urls=tuple(self.urls[split]),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            transform=self.train_transform if train else self.eval_transform,
            shard_shuffle=train and self.shard_shuffle,
            shuffle_buffer=self.shuffle_buffer if train else 0,
            resampled=resampled,
            seed=self.seed,
            allow_pipe=self.allow_pipe,
            decode="cpu" if named else self.decode,
            named=named,
        )
        position = self._training_position if train else lambda: (self._training_position()[0], 0)
        loader = ShardLoader(
            settings,
            split=split,
            num_workers=self.num_workers,
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
