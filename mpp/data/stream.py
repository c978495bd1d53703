"""One rank's stream of batches, as each DataLoader worker reads it: shards -> samples -> batches.

A worker opens its shards in turn, groups tar members into samples, shuffles them in a
buffer, decodes and augments each image and collates batches (with decode="device", JPEGs stay
encoded, with their crop box and flip: mpp.data.device_decode). A sample or shard that cannot
be read is dropped and counted in the next batch's "skipped". While it works, a worker
writes where it is (mpp.data.workers) (its shard, the sample it decodes) into shared memory, so that the main
process can name them if the worker is killed.
"""

from __future__ import annotations

import logging
import random
import tarfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
import webdataset
from torch.utils.data import IterableDataset, get_worker_info

from mpp.data.device_decode import pack_jpegs
from mpp.data.remote import ShardOpenError, open_url
from mpp.data.transforms import DECODE_ERRORS, EncodedJpeg, ImageTransform
from mpp.data.workers import Trail, Whereabouts
from mpp.secrets import redact
from mpp.shards.images import IMAGE_EXTENSIONS
from mpp.shards.tar import MemberOrderError, iter_samples

log = logging.getLogger(__name__)

# Tensors; with decode="device" also the encoded JPEGs under "jpegs" (mpp.data.device_decode).
Batch = dict[str, Any]
Decode = Literal["cpu", "device"]
Example = np.ndarray | EncodedJpeg  # a decoded (H, W, C) image, or a JPEG the device decodes

# What a broken sample or shard raises while being read or decoded (PIL uses several of these).
_BAD_INPUT = (*DECODE_ERRORS, tarfile.TarError)


def resampled_share(urls: Sequence[str], *, rank: int, world_size: int, worker: int, num_workers: int) -> list[str]:
    """The shards one worker of one rank draws from with replacement.

    Ranks draw from disjoint shards, urls[rank::world_size], when there are at least as many
    shards as ranks (else every rank draws from all); a rank's workers split its share the
    same way when it has at least one shard per worker (else each draws from all of it).
    """
    share = list(urls[rank::world_size]) if len(urls) >= world_size else list(urls)
    return share[worker::num_workers] if len(share) >= num_workers else share


class ShardStream(IterableDataset):
    """The batches of one rank's share of the shards; iterated inside each DataLoader worker.

    ShardLoader sets `epoch`, `start_step` and `whereabouts` before every iter(); workers are
    created anew for each epoch (no persistent workers), so they see the values set in the
    main process. `epoch` orders the shards; (epoch, start_step) seed the draws, sample
    shuffle and augmentation. `decode="device"` leaves JPEGs encoded for the device.
    """

    def __init__(
        self,
        *,
        urls: Sequence[str],
        rank: int,
        world_size: int,
        batch_size: int,
        transform: ImageTransform,
        shard_shuffle: bool,
        shuffle_buffer: int,
        resampled: bool,
        seed: int,
        allow_pipe: bool,
        decode: Decode = "cpu",
    ) -> None:
        super().__init__()
        self.urls, self.rank, self.world_size, self.batch_size = list(urls), rank, world_size, batch_size
        self.transform, self.shard_shuffle, self.shuffle_buffer = transform, shard_shuffle, shuffle_buffer
        self.resampled, self.seed, self.allow_pipe, self.decode = resampled, seed, allow_pipe, decode
        self.epoch = self.start_step = 0
        self.whereabouts: Whereabouts | None = None

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # Seeded by everything that should change the stream, so runs are reproducible.
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.start_step}/{self.rank}/{worker}")
        skips = _Skips()
        trail = Trail(self.whereabouts, worker)
        if info is not None:
            trail.record_stop_signals()
        samples = _tar_samples(self._shard_order(rng, worker, num_workers, skips), skips, self.allow_pipe, trail)
        if self.shuffle_buffer > 1:
            samples = webdataset.filters.shuffle(self.shuffle_buffer, initial=min(100, self.shuffle_buffer), rng=rng)(
                samples
            )
        shape = (self.transform.channels, *self.transform.size)
        decode = self.transform.for_device if self.decode == "device" else self.transform
        return _batches(_decoded(samples, decode, rng, skips, trail), self.batch_size, skips, shape)

    def _shard_order(self, rng: random.Random, worker: int, num_workers: int, skips: _Skips) -> Iterator[str]:
        """Shard URLs for this rank and worker: an endless random draw, or this epoch's share.

        An endless draw from shards that all turned out to hold no sample would never yield a
        batch: it stops with an error naming them once every shard of its share has been seen empty.
        """
        if self.resampled:
            share = resampled_share(
                self.urls, rank=self.rank, world_size=self.world_size, worker=worker, num_workers=num_workers
            )
            while True:
                if skips.empty_shards.issuperset(share):
                    raise EmptyShardsError(redact(_empty_message(share)))
                yield rng.choice(share)
        urls = list(self.urls)
        if self.shard_shuffle:
            # One permutation for all ranks and workers, so that their slices partition it; seeded by
            # the epoch alone, so an epoch resumed at a later step rereads the same shards.
            random.Random(f"{self.seed}/{self.epoch}").shuffle(urls)
        yield from urls[self.rank :: self.world_size][worker::num_workers]


class EmptyShardsError(RuntimeError):
    """Every shard a resampled stream draws from holds no sample."""


def some_urls(urls: Sequence[str]) -> str:
    """The first three URLs and how many more: shards named in a message."""
    return ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")


def _empty_message(share: Sequence[str]) -> str:
    return (
        f"every shard this stream draws from is empty (a tar with no members): {some_urls(share)}; there is "
        "nothing to train on. Check them with `python tools/inspect_shards.py <shards>`"
    )


class _Skips:
    """Counts the samples one worker dropped; the first one per process is logged as a warning.

    So many failures in a row that nothing is readable (every shard broken, a wrong format) is an
    error instead: a resampled stream would otherwise spin forever without a batch.
    """

    warned = False
    limit = 1000

    def __init__(self) -> None:
        self.count = self.streak = 0
        self.empty_shards: set[str] = set()  # shards that were whole tars without a member

    def add(self, what: str, error: BaseException) -> None:
        self.count += 1
        self.streak += 1
        if self.streak >= self.limit:
            raise RuntimeError(
                redact(
                    f"{self.streak} samples or shards in a row were unreadable, the last "
                    f"{what}: {type(error).__name__}: {error}"
                )
            )
        if not _Skips.warned:
            _Skips.warned = True
            log.warning(
                "skipped %s: %s: %s (further skips are counted in batch['skipped'] and logged at DEBUG level)",
                what,
                type(error).__name__,
                error,
            )
        else:
            log.debug("skipped %s: %s: %s", what, type(error).__name__, error)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def _tar_samples(urls: Iterator[str], skips: _Skips, allow_pipe: bool, trail: Trail) -> Iterator[dict[str, Any]]:
    """Shard URLs -> samples {"__key__", "__url__", extension: bytes}; a tar that breaks off counts one skip.

    The break also drops the sample in hand (it may lack a member), so a sample is read only
    when its members and the next one's first member (or the end-of-archive block) are whole.
    """
    for url in urls:
        trail.reading(url)
        stream = open_url(url, allow_pipe=allow_pipe)  # an unreachable shard is an error, not a skip
        last = None
        try:
            for sample in iter_samples(stream):
                last = sample["__key__"]
                yield {**sample, "__url__": url}
            if last is None and url not in skips.empty_shards:  # a whole tar, but nothing in it: no sample lost
                skips.empty_shards.add(url)
                log.warning("shard %s is an empty tar (no members): it adds no samples", redact(url))
        except ShardOpenError:
            raise  # the storage, not the shard, failed and its retries are spent: stop, naming the URL
        except MemberOrderError as error:  # labels parted from images: a wrong result, not a skip
            raise MemberOrderError(redact(f"shard {url}: {error}")) from None
        except _BAD_INPUT as error:
            skips.add(f"shard {url} after sample {last}" if last else f"shard {url}", error)
        finally:
            stream.close()


def _decoded(
    samples: Iterator[dict[str, Any]],
    transform: Callable[[bytes, random.Random], Example],
    rng: random.Random,
    skips: _Skips,
    trail: Trail,
) -> Iterator[tuple[Example, int]]:
    """Samples -> (image (H, W, C) uint8 or an encoded JPEG, label or -1); bad samples are counted and dropped."""
    for sample in samples:
        trail.decoding(sample["__key__"], sample["__url__"])
        try:
            extension = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
            if extension is None:
                members = sorted(k for k in sample if not k.startswith("__"))
                raise ValueError(f"no image member (.png, .jpg, ...); it has {members}")
            label = int(sample["cls"]) if "cls" in sample else -1
            image = transform(sample[extension], rng)
            if isinstance(image, EncodedJpeg):  # named for the device's messages
                image = image._replace(name=f"sample {sample['__key__']} of {sample['__url__']}")
        except _BAD_INPUT as error:
            skips.add(f"sample {sample['__key__']} of {sample['__url__']}", error)
            continue
        skips.streak = 0
        yield image, label


def _batches(
    examples: Iterator[tuple[Example, int]], batch_size: int, skips: _Skips, shape: tuple[int, int, int]
) -> Iterator[Batch]:
    """Collate into batches; each is held back until the next fills, so skips after the last still count.

    A worker with skips but no sample to batch yields a batch of no images, of (C, H, W) `shape`,
    to carry the count; ShardLoader folds it into another batch, so no training step sees it.
    """
    held: Batch | None = None
    images: list[Example] = []
    labels: list[int] = []
    for image, label in examples:
        images.append(image)
        labels.append(label)
        if len(images) == batch_size:
            if held is not None:
                yield held
            held = _collate(images, labels, skips.take(), shape)
            images, labels = [], []
    if images:
        if held is not None:
            yield held
        held = _collate(images, labels, skips.take(), shape)
    if held is None and skips.count:
        held = _collate([], [], 0, shape)
    if held is not None:
        held["skipped"] += skips.take()
        yield held


def _collate(examples: list[Example], labels: list[int], skipped: int, shape: tuple[int, int, int]) -> Batch:
    """(H, W, C) arrays of (C, H, W) `shape` -> a batch; one strided copy per image (numpy's is twice as
    fast as torch.stack's). Encoded JPEGs go under "jpegs", their labels in place among the others'."""
    pixels = [example for example in examples if isinstance(example, np.ndarray)]
    images = np.empty((len(pixels), *shape), dtype=np.uint8)
    for slot, hwc in zip(images, pixels):
        slot[...] = hwc.transpose(2, 0, 1)
    batch: Batch = {
        "image": torch.from_numpy(images),
        "label": torch.tensor(labels, dtype=torch.int64),
        "skipped": torch.tensor(skipped, dtype=torch.int64),
    }
    if len(pixels) < len(examples):
        batch["jpegs"] = pack_jpegs(examples)
    return batch
