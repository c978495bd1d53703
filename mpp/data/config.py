"""What a run's data is: the `data:` keys of a config (and their `--data.*` flags), as one frozen
dataclass checked once where it is made. ShardDataModule takes it; so do the loader's settings
(mpp.data.stream.StreamSettings) it builds for each split."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mpp.data.stream import Decode
from mpp.data.transforms import pair
from mpp.data.urls import names_indexes
from mpp.errors import refuse_invalid
from mpp.shards.images import DEFAULT_MAX_PIXELS

ShardSpec = str | list[str]
SPLITS = ("train", "val", "test", "predict")


@dataclass(frozen=True)
class DataConfig:
    """Where the shards are, how samples become images, and how batches are made.

    Args:
        train: training shards: a path, a brace pattern (`shards/train-{000000..000009}.tar`), a
            local glob, an http(s)://, s3://, gs:// or pipe: URL, or a list of those. Labels are read
            where present and ignored by pretraining.
        val: validation shards, as train.
        test: test shards, as train.
        predict: the shards `mpp predict` reads; where unset, test, else val.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader worker processes per rank (0 reads in the main process).
        image_size: output size, an int or (H, W); null (the default): the encoder's, read from the
            trainer's module (`model.init_args.encoder.image_size`), or 224 used alone. A size set
            here that differs from the encoder's stops the run before training, naming both keys.
        channels: 1 or 3, any PIL mode converted (16-bit scaled, alpha composited on black); null:
            the encoder's, or 3 used alone; checked against the encoder as image_size is.
        crop_scale: area fraction range of the training crop.
        crop_ratio: aspect (w/h) range of the training crop.
        hflip: flip training images horizontally half of the time.
        eval_crop_fraction: evaluation resizes to cover image_size / eval_crop_fraction, then
            centre-crops image_size (1.0: resize the short side to the crop).
        shard_shuffle: shuffle the training shard order, anew each epoch.
        shuffle_buffer: training samples held in each worker's shuffle buffer (0 or 1: none).
        resampled: draw training shards with replacement, an endless stream cut into epochs of
            samples_per_epoch samples (across all ranks); use it for multi-GPU training. Each rank
            draws from its own shards, urls[rank::world_size], and each of its workers from its own
            part of those, where there are enough; with fewer shards than ranks every rank draws
            from all (and a warning says so).
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
    """

    train: ShardSpec | None = None
    val: ShardSpec | None = None
    test: ShardSpec | None = None
    predict: ShardSpec | None = None
    batch_size: int = 64
    num_workers: int = 4
    image_size: int | tuple[int, int] | None = None
    channels: int | None = None
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    eval_crop_fraction: float = 0.875
    shard_shuffle: bool = True
    shuffle_buffer: int = 1000
    resampled: bool = False
    samples_per_epoch: int | None = None
    seed: int = 0
    allow_pipe: bool = False
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    decode: Decode = "cpu"

    def __post_init__(self) -> None:
        """Every field that is out of range, each in its own clause of one ValueError."""
        size, (low, high), (narrow, wide) = self.image_size, self.crop_scale, self.crop_ratio
        pair = isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(n, int) for n in size)
        checks = [
            ("batch_size", self.batch_size >= 1, "a positive number of samples"),
            ("num_workers", self.num_workers >= 0, "0 or more worker processes"),
            ("image_size", size is None or (isinstance(size, int) and size >= 1) or (pair and min(size) >= 1),  # type: ignore[arg-type]
             "an int or (H, W), or null for the encoder's"),
            ("channels", self.channels in (None, 1, 3), "1 or 3, or null for the encoder's"),
            ("crop_scale", 0 < low <= high <= 1, "(min, max) in (0, 1]"),
            ("crop_ratio", 0 < narrow <= wide, "(min, max) > 0"),
            ("eval_crop_fraction", 0 < self.eval_crop_fraction <= 1, "in (0, 1]"),
            ("shuffle_buffer", self.shuffle_buffer >= 0, "0 or more samples"),
            ("samples_per_epoch", self.samples_per_epoch is None or self.samples_per_epoch >= 1, "a positive number"),
            ("samples_per_epoch", not self.resampled or self.samples_per_epoch is not None or names_indexes(self.train),
             "set with resampled=True, which makes an endless stream (or data.train a shard index, whose samples it is)"),
            ("max_image_pixels", self.max_image_pixels >= 1, "a positive number of pixels"),
            ("decode", self.decode in ("cpu", "device"), '"cpu" or "device"'),
        ]  # fmt: skip
        refuse_invalid("data", self, checks)

    @property
    def size(self) -> tuple[int, int] | None:
        """image_size as (H, W), or None for the encoder's."""
        return None if self.image_size is None else pair(self.image_size)

    @property
    def shards(self) -> dict[str, ShardSpec | None]:
        """{split: its shards} of every split, unset ones None."""
        return {split: getattr(self, split) for split in SPLITS}

    def as_dict(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in fields(self)}
