"""ShardDataModule: WebDataset tar shards -> decoded, augmented uint8 batches.

A batch is a dict:
    "image":   uint8 (B, C, H, W), raw pixels (the model normalises them itself)
    "label":   int64 (B,), -1 for samples without a `.cls` member
    "skipped": int64 (), samples this worker dropped since its previous batch (undecodable
               image, no image member, a tar that broke off); summed over batches, the total.

Shards are split over ranks (rank and world size from the trainer) and then over DataLoader
workers. Without `resampled`, each sample is read once per epoch across all ranks x workers;
with it, every rank and worker draws shards at random with replacement and every rank yields
samples_per_epoch // (world_size * batch_size) batches, so DDP ranks stay in step.
"""

from __future__ import annotations

import logging
import random
import tarfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import webdataset
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mpp.storage import expand_urls, open_url
from mpp.tarstream import iter_samples
from mpp.transforms import IMAGE_EXTENSIONS, ImageTransform

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
ShardSpec = str | list[str]

# What a broken sample or shard raises while being read or decoded (PIL uses several of these).
_BAD_INPUT = (OSError, ValueError, SyntaxError, EOFError, IndexError, tarfile.TarError, zlib.error,
              Image.DecompressionBombError)


class _Skips:
    """Counts the samples one worker dropped; the first one per process is logged as a warning.

    So many failures in a row that nothing is readable (every shard broken, a wrong format) is an
    error instead: a resampled stream would otherwise spin forever without a batch.
    """

    warned = False
    limit = 1000

    def __init__(self) -> None:
        self.count = self.streak = 0

    def add(self, what: str, error: BaseException) -> None:
        self.count += 1
        self.streak += 1
        if self.streak >= self.limit:
            raise RuntimeError(f"{self.streak} samples or shards in a row were unreadable, the last "
                               f"{what}: {type(error).__name__}: {error}")
        if not _Skips.warned:
            _Skips.warned = True
            log.warning("skipped %s: %s: %s (further skips are counted in batch['skipped'] and logged at "
                        "DEBUG level)", what, type(error).__name__, error)
        else:
            log.debug("skipped %s: %s: %s", what, type(error).__name__, error)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


class ShardStream(IterableDataset):
    """The batches of one rank's share of the shards; iterated inside each DataLoader worker.

    `epoch` is set by ShardLoader before every iter(); workers are created anew for each
    epoch (no persistent workers), so they see the value set in the main process.
    """

    def __init__(self, *, urls: Sequence[str], rank: int, world_size: int, batch_size: int,
                 transform: ImageTransform, shard_shuffle: bool, shuffle_buffer: int,
                 resampled: bool, seed: int, allow_pipe: bool) -> None:
        super().__init__()
        self.urls, self.rank, self.world_size, self.batch_size = list(urls), rank, world_size, batch_size
        self.transform, self.shard_shuffle, self.shuffle_buffer = transform, shard_shuffle, shuffle_buffer
        self.resampled, self.seed, self.allow_pipe = resampled, seed, allow_pipe
        self.epoch = 0

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        # Seeded by everything that should change the stream, so runs are reproducible.
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{worker}")
        skips = _Skips()
        samples = _tar_samples(self._shard_order(rng), skips, self.allow_pipe)
        if self.shuffle_buffer > 1:
            samples = webdataset.filters.shuffle(self.shuffle_buffer, initial=min(100, self.shuffle_buffer),
                                                 rng=rng)(samples)
        return _batches(_decoded(samples, self.transform, rng, skips), self.batch_size, skips)

    def _shard_order(self, rng: random.Random) -> Iterator[str]:
        """Shard URLs for this rank and worker: an endless random draw, or this epoch's share."""
        if self.resampled:
            while True:
                yield rng.choice(self.urls)
        urls = list(self.urls)
        if self.shard_shuffle:
            # One permutation for all ranks and workers, so that their slices partition it.
            random.Random(f"{self.seed}/{self.epoch}").shuffle(urls)
        yield from webdataset.split_by_worker(urls[self.rank :: self.world_size])


def _tar_samples(urls: Iterator[str], skips: _Skips, allow_pipe: bool) -> Iterator[dict[str, Any]]:
    """Shard URLs -> samples {"__key__", "__url__", extension: bytes}; a tar that breaks off counts one skip."""
    for url in urls:
        stream = open_url(url, allow_pipe=allow_pipe)  # an unreachable shard is an error, not a skip
        last = None
        try:
            for sample in iter_samples(stream):
                last = sample["__key__"]
                yield {**sample, "__url__": url}
        except _BAD_INPUT as error:
            skips.add(f"shard {url} after sample {last}" if last else f"shard {url}", error)
        finally:
            stream.close()


def _decoded(samples: Iterator[dict[str, Any]], transform: ImageTransform, rng: random.Random,
             skips: _Skips) -> Iterator[tuple[np.ndarray, int]]:
    """Samples -> (image (H, W, C) uint8, label or -1); bad samples are counted and dropped."""
    for sample in samples:
        try:
            extension = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
            if extension is None:
                members = sorted(k for k in sample if not k.startswith("__"))
                raise ValueError(f"no image member (.png, .jpg, ...); it has {members}")
            label = int(sample["cls"]) if "cls" in sample else -1
            image = transform(sample[extension], rng)
        except _BAD_INPUT as error:
            skips.add(f"sample {sample['__key__']} of {sample['__url__']}", error)
            continue
        skips.streak = 0
        yield image, label


def _batches(examples: Iterator[tuple[np.ndarray, int]], batch_size: int, skips: _Skips) -> Iterator[Batch]:
    """Collate into batches; each is held back until the next fills, so skips after the last still count."""
    held: Batch | None = None
    images: list[np.ndarray] = []
    labels: list[int] = []
    for image, label in examples:
        images.append(image)
        labels.append(label)
        if len(images) == batch_size:
            if held is not None:
                yield held
            held = _collate(images, labels, skips.take())
            images, labels = [], []
    if images:
        if held is not None:
            yield held
        held = _collate(images, labels, skips.take())
    if held is not None:
        held["skipped"] += skips.take()
        yield held
    elif skips.count:
        log.warning("a DataLoader worker skipped %d samples and had none left to batch", skips.count)


def _require(ok: bool, name: str, value: object, wanted: str) -> None:
    if not ok:
        raise ValueError(f"ShardDataModule: {name}={value!r} is invalid; it must be {wanted}")


def _collate(pixels: list[np.ndarray], labels: list[int], skipped: int) -> Batch:
    """(H, W, C) arrays -> a batch; one strided copy per image (numpy's is twice as fast as torch.stack's)."""
    height, width, channels = pixels[0].shape
    images = np.empty((len(pixels), channels, height, width), dtype=np.uint8)
    for slot, hwc in zip(images, pixels):
        slot[...] = hwc.transpose(2, 0, 1)
    return {"image": torch.from_numpy(images), "label": torch.tensor(labels, dtype=torch.int64),
            "skipped": torch.tensor(skipped, dtype=torch.int64)}


class ShardLoader:
    """Iterates a DataLoader over a ShardStream: sets the stream's epoch first, cuts resampled epochs."""

    def __init__(self, stream: ShardStream, *, num_workers: int, epoch: Callable[[], int],
                 num_batches: int | None) -> None:
        self.stream, self.num_batches, self._epoch = stream, num_batches, epoch
        # Batches are collated inside the workers (batch_size=None), where skips are counted.
        self.loader = DataLoader(stream, batch_size=None, num_workers=num_workers,
                                 pin_memory=torch.cuda.is_available())

    def __iter__(self) -> Iterator[Batch]:
        self.stream.epoch = self._epoch()
        batches = iter(self.loader)
        return batches if self.num_batches is None else islice(batches, self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("a stream that is not resampled has no fixed length")
        return self.num_batches


class ShardDataModule(pl.LightningDataModule):
    """Shards -> batches {"image": uint8 (B, C, H, W), "label": int64 (B,), "skipped": int64 ()}.

    Args:
        train, val, test: shards of each split: a path, a brace pattern
            (`shards/train-{000000..000009}.tar`), a local glob, an http(s)://, s3://, gs://
            or pipe: URL, or a list of those. Labels are read where present and ignored by
            pretraining.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader worker processes per rank (0 reads in the main process).
        image_size: output size, an int or (H, W).
        channels: 1 or 3; any PIL mode is converted (16-bit scaled, alpha composited on black).
        crop_scale, crop_ratio: area fraction and aspect (w/h) range of the training crop.
        hflip: flip training images horizontally half of the time.
        eval_crop_fraction: evaluation resizes to cover image_size / eval_crop_fraction, then
            centre-crops image_size (1.0: resize the short side to the crop).
        shard_shuffle: shuffle the training shard order, anew each epoch.
        shuffle_buffer: training samples held in each worker's shuffle buffer (0 or 1: none).
        resampled: draw training shards with replacement, an endless stream cut into epochs of
            samples_per_epoch samples (across all ranks); use it for multi-GPU training.
        samples_per_epoch: global training samples per epoch; required with `resampled`.
        seed: seeds shard order, sample shuffle and augmentation (with epoch, rank and worker).
        allow_pipe: allow pipe: URLs, which run shell commands.

    Rank and world size come from the trainer in setup(), or from setup(rank=, world_size=).
    The epoch that reseeds shard order comes from trainer.current_epoch, or set_epoch().
    """

    def __init__(self, *, train: ShardSpec | None = None, val: ShardSpec | None = None,
                 test: ShardSpec | None = None, batch_size: int = 64, num_workers: int = 4,
                 image_size: int | tuple[int, int] = 224, channels: int = 3,
                 crop_scale: tuple[float, float] = (0.08, 1.0), crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 hflip: bool = True, eval_crop_fraction: float = 0.875, shard_shuffle: bool = True,
                 shuffle_buffer: int = 1000, resampled: bool = False, samples_per_epoch: int | None = None,
                 seed: int = 0, allow_pipe: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        _require(batch_size >= 1, "batch_size", batch_size, "a positive number of samples")
        _require(num_workers >= 0, "num_workers", num_workers, "0 or more worker processes")
        _require(len(size) == 2 and min(size) >= 1, "image_size", image_size, "an int or (H, W)")
        _require(channels in (1, 3), "channels", channels, "1 or 3")
        _require(0 < crop_scale[0] <= crop_scale[1] <= 1, "crop_scale", crop_scale, "(min, max) in (0, 1]")
        _require(0 < crop_ratio[0] <= crop_ratio[1], "crop_ratio", crop_ratio, "(min, max) > 0")
        _require(0 < eval_crop_fraction <= 1, "eval_crop_fraction", eval_crop_fraction, "in (0, 1]")
        _require(shuffle_buffer >= 0, "shuffle_buffer", shuffle_buffer, "0 or more samples")
        _require(samples_per_epoch is None or samples_per_epoch >= 1, "samples_per_epoch", samples_per_epoch,
                 "a positive number")
        _require(not resampled or samples_per_epoch is not None, "samples_per_epoch", samples_per_epoch,
                 "set with resampled=True, which makes an endless stream")
        self.specs = {"train": train, "val": val, "test": test}
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.resampled, self.samples_per_epoch, self.allow_pipe = resampled, samples_per_epoch, allow_pipe
        self.shard_shuffle, self.shuffle_buffer = shard_shuffle, shuffle_buffer
        common = {"size": size, "channels": channels}
        self.train_transform = ImageTransform(train=True, scale=tuple(crop_scale), ratio=tuple(crop_ratio),
                                              hflip=hflip, **common)
        self.eval_transform = ImageTransform(train=False, crop_fraction=eval_crop_fraction, **common)
        self.rank, self.world_size = 0, 1
        self.urls: dict[str, list[str]] = {}
        self._epoch = 0

    def setup(self, stage: str | None = None, *, rank: int | None = None, world_size: int | None = None) -> None:
        """Expand and check the shards a stage needs; rank/world size default to the trainer's, else 0/1."""
        if rank is not None and world_size is not None:
            self.rank, self.world_size = rank, world_size
        elif self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        required = {"fit": "train", "validate": "val", "test": "test"}.get(stage or "")
        if required is not None and self.specs[required] is None:
            raise ValueError(f"stage {stage!r} needs shards for {required!r}: set data.{required}")
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage or "", self.specs)
        for split in splits:
            if self.specs[split] is not None:
                self.urls[split] = expand_urls(self.specs[split], allow_pipe=self.allow_pipe)
        train = self.urls.get("train")
        if train is not None and self.world_size > 1 and not self.resampled:
            log.warning("training on %d ranks without resampled=True: ranks may get unequal batch counts, "
                        "which stalls DDP; set resampled=True and samples_per_epoch", self.world_size)
        for split, urls in self.urls.items():
            if len(urls) < self.world_size and not (split == "train" and self.resampled):
                log.warning("%s has %d shards for %d ranks: some ranks read nothing", split, len(urls),
                            self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch that seeds shard order and augmentation when there is no trainer."""
        self._epoch = epoch

    def train_dataloader(self) -> ShardLoader:
        """Training batches: random crops and flips, shuffled shards and samples."""
        return self._loader("train", train=True)

    def val_dataloader(self) -> ShardLoader | list:
        """Validation batches: centre crops in shard order (none if `val` is not set)."""
        return self._loader("val", train=False) if self.specs["val"] is not None else []

    def test_dataloader(self) -> ShardLoader:
        """Test batches: centre crops in shard order."""
        return self._loader("test", train=False)

    def _current_epoch(self) -> int:
        # Lightning never calls set_epoch on an iterable dataset; the trainer's count is the truth.
        return self.trainer.current_epoch if self.trainer is not None else self._epoch

    def _loader(self, split: str, *, train: bool) -> ShardLoader:
        if split not in self.urls:
            raise RuntimeError(f"no shards for {split!r}: set data.{split} and call setup() first")
        resampled = train and self.resampled
        num_batches = None
        if resampled:
            num_batches = self.samples_per_epoch // (self.world_size * self.batch_size)
            if num_batches < 1:
                raise ValueError(f"samples_per_epoch={self.samples_per_epoch} is less than one batch of "
                                 f"{self.batch_size} on each of {self.world_size} ranks")
        stream = ShardStream(
            urls=self.urls[split], rank=self.rank, world_size=self.world_size, batch_size=self.batch_size,
            transform=self.train_transform if train else self.eval_transform,
            shard_shuffle=train and self.shard_shuffle, shuffle_buffer=self.shuffle_buffer if train else 0,
            resampled=resampled, seed=self.seed, allow_pipe=self.allow_pipe,
        )
        return ShardLoader(stream, num_workers=self.num_workers, epoch=self._current_epoch, num_batches=num_batches)
