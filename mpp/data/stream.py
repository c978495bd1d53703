"""One rank's stream of batches, as each DataLoader worker reads it: shards -> samples -> batches.

A worker opens its shards in turn, groups tar members into samples, shuffles them in a
buffer, decodes and augments each image and collates batches (with decode="device", JPEGs stay
encoded, with their crop box and flip: mpp.data.device_decode). A sample or shard that cannot
be read is dropped and counted in the next batch's "skipped". Each batch carries the worker's
resume point, from which a resumed run rebuilds the stream exactly (mpp.data.resume). While it
works, a worker writes where it is (mpp.data.workers) (its shard, the sample it decodes) into
shared memory, so that the main process can name them if the worker is killed.
"""

from __future__ import annotations

import logging
import random
import tarfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from mpp.data.device_decode import pack_jpegs
from mpp.data.remote import ShardOpenError, open_url
from mpp.data.resume import Coordinate, ResumePoint, Sample, ShuffleBuffer
from mpp.data.transforms import DECODE_ERRORS, EncodedJpeg, ImageTransform
from mpp.data.workers import Trail, Whereabouts
from mpp.secrets import redact
from mpp.shards.images import IMAGE_EXTENSIONS
from mpp.shards.tar import MemberOrderError, iter_samples

log = logging.getLogger(__name__)

# Tensors; with decode="device" also the encoded JPEGs under "jpegs" (mpp.data.device_decode).
Batch = dict[str, Any]
T = TypeVar("T")
Decode = Literal["cpu", "device"]
Example = np.ndarray | EncodedJpeg  # a decoded (H, W, C) image, or a JPEG the device decodes

# What a broken sample or shard raises while being read or decoded (PIL uses several of these).
_BAD_INPUT = (*DECODE_ERRORS, tarfile.TarError)


def resampled_share(urls: Sequence[T], *, rank: int, world_size: int, worker: int, num_workers: int) -> list[T]:
    """The shards one worker of one rank draws from with replacement.

    Ranks draw from disjoint shards, urls[rank::world_size], when there are at least as many
    shards as ranks (else every rank draws from all); a rank's workers split its share the
    same way when it has at least one shard per worker (else each draws from all of it).
    """
    share = list(urls[rank::world_size]) if len(urls) >= world_size else list(urls)
    return share[worker::num_workers] if len(share) >= num_workers else share


class ShardStream(IterableDataset):
    """The batches of one rank's share of the shards; iterated inside each DataLoader worker.

    ShardLoader sets `epoch`, `start_step`, `whereabouts`, and for a resumed epoch `resume_points`
    and `rotation`, before every iter(); workers are created anew for each epoch (no persistent
    workers), so they see the values set in the main process. `epoch` orders the shards;
    (epoch, start_step) seed the draws, sample shuffle and augmentation. Each batch carries its
    worker's ResumePoint under "position" (mpp.data.resume). `decode="device"` leaves JPEGs
    encoded for the device.
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
        self.resume_points: dict[int, ResumePoint] = {}  # by worker role
        self.rotation = 0  # the role of the first worker

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # The role a worker plays: its share of shards and its seed. A resumed loader rotates the roles so that
        # its first worker, which delivers the first batch, is the one whose batch came next (ShardLoader).
        role = (worker + self.rotation) % num_workers
        # Seeded by everything that should change the stream, so runs are reproducible.
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.start_step}/{self.rank}/{role}")
        skips = _Skips()
        trail = Trail(self.whereabouts, worker)
        if info is not None:
            trail.record_stop_signals()
        share = self._shard_order(role, num_workers)
        reader = _Reader(
            self.urls, share, rng, skips, allow_pipe=self.allow_pipe, trail=trail, resampled=self.resampled
        )
        buffer = ShuffleBuffer(self.shuffle_buffer, min(100, self.shuffle_buffer), rng)
        point = self.resume_points.get(role)
        source = reader.read() if point is None else reader.resume(point, buffer)
        shape = (self.transform.channels, *self.transform.size)
        decode = self.transform.for_device if self.decode == "device" else self.transform

        def where() -> ResumePoint:
            return reader.point(role, buffer)

        return _batches(_decoded(buffer(source), decode, rng, skips, trail), self.batch_size, skips, shape, where)

    def _shard_order(self, role: int, num_workers: int) -> list[int]:
        """Indices into `urls` of the shards of this rank and worker role: this epoch's share, or (resampled)
        the share it draws from at random, with replacement.
        """
        indices = list(range(len(self.urls)))
        if self.resampled:
            return resampled_share(
                indices, rank=self.rank, world_size=self.world_size, worker=role, num_workers=num_workers
            )
        if self.shard_shuffle:
            # One permutation for all ranks and workers, so that their slices partition it; seeded by
            # the epoch alone, so an epoch resumed at a later step rereads the same shards.
            random.Random(f"{self.seed}/{self.epoch}").shuffle(indices)
        return indices[self.rank :: self.world_size][role::num_workers]


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


class _Reader:
    """A worker's samples with their coordinates (shard index in its order, sample index in the shard),
    and where it is: `next`, the coordinate of the next sample it would read.

    `share` holds indices into the stream's URLs: read in turn, or (resampled) drawn from with
    replacement, endlessly. An endless draw from shards that all turned out to hold no sample would
    never yield a batch: it stops with an error naming them once every shard of its share has been
    seen empty.
    """

    def __init__(
        self,
        urls: list[str],
        share: list[int],
        rng: random.Random,
        skips: _Skips,
        *,
        allow_pipe: bool,
        trail: Trail,
        resampled: bool,
    ) -> None:
        self.urls, self.share, self.rng, self.skips = urls, share, rng, skips
        self.allow_pipe, self.trail, self.resampled = allow_pipe, trail, resampled
        self.drawn: dict[int, int] = {}  # shard index in the order -> index into the URLs, where drawn
        self.next: Coordinate = (0, 0)

    def shard(self, index: int) -> int | None:
        """The URL index of the shard at `index` of the order (None past the end of an epoch's share)."""
        if not self.resampled:
            return self.share[index] if index < len(self.share) else None
        if index not in self.drawn:
            if self.skips.empty_shards.issuperset(self.urls[at] for at in self.share):
                raise EmptyShardsError(redact(_empty_message([self.urls[at] for at in self.share])))
            self.drawn[index] = self.rng.choice(self.share)
        return self.drawn[index]

    def read(
        self, start: Coordinate = (0, 0), found: Callable[[Coordinate, Sample], None] | None = None
    ) -> Iterator[tuple[Coordinate, Sample]]:
        """The samples from `start` on; those of start's shard before it go to `found` (a resumed buffer's)."""
        index, first = start
        while (at := self.shard(index)) is not None:
            for number, sample in enumerate(_shard_samples(self.urls[at], self.skips, self.allow_pipe, self.trail)):
                if number < first:
                    if found is not None:
                        found((index, number), sample)
                    continue
                self.next = (index, number + 1)
                yield (index, number), sample
            index, first = index + 1, 0
            self.next = (index, 0)

    def resume(self, point: ResumePoint, buffer: ShuffleBuffer) -> Iterator[tuple[Coordinate, Sample]]:
        """Rebuild the stream at `point`: refill `buffer` from the shards its samples came from (read again,
        nothing decoded), take up the generator's state and read on from `point.next`."""
        self.rng.setstate(point.rng)
        if self.resampled:
            self.drawn.update(point.shards)
        slots: dict[Coordinate, int] = {(int(j), int(i)): slot for slot, (j, i) in enumerate(point.buffer)}
        items: list[tuple[Coordinate, Sample] | None] = [None] * len(slots)

        def found(coordinate: Coordinate, sample: Sample) -> None:
            if coordinate in slots:
                items[slots[coordinate]] = (coordinate, sample)

        current, first = point.next
        replay = _Skips()  # what these shards skipped was counted before the run stopped
        for index in sorted({j for j, _ in slots if j != current}):
            at = point.shards[index]
            last = max(i for j, i in slots if j == index)
            for number, sample in enumerate(_shard_samples(self.urls[at], replay, self.allow_pipe, self.trail)):
                found((index, number), sample)
                if number >= last:
                    break
        buffer.items = items  # type: ignore[assignment]  # complete once the current shard's start is read
        live = self.read(point.next, found)
        self.next = point.next
        return _checked(live, items, point)

    def point(self, role: int, buffer: ShuffleBuffer) -> ResumePoint:
        coordinates = buffer.coordinates()
        named = {int(j) for j in coordinates[:, 0]} | {self.next[0]}
        shards = {j: at for j in named if (at := self.shard_known(j)) is not None}
        return ResumePoint(role, self.next, coordinates, shards, self.rng.getstate())

    def shard_known(self, index: int) -> int | None:
        """The URL index of an order index already read or drawn (no draw: a resume point must not draw)."""
        if self.resampled:
            return self.drawn.get(index)
        return self.share[index] if index < len(self.share) else None


def _checked(
    live: Iterator[tuple[Coordinate, Sample]], items: list[Any], point: ResumePoint
) -> Iterator[tuple[Coordinate, Sample]]:
    """The live samples, after checking that the resumed buffer found every sample it held."""
    first = next(live, None)
    missing = [tuple(int(v) for v in point.buffer[slot]) for slot, item in enumerate(items) if item is None]
    if missing:
        raise ResumeError(
            f"resuming, {len(missing)} sample(s) of the shuffle buffer were not in their shards (first: shard "
            f"{missing[0][0]} of the worker's order, sample {missing[0][1]}): the shards changed since the "
            "checkpoint was written; resume with the same shards, or start the epoch afresh"
        )
    if first is not None:
        yield first
        yield from live


class ResumeError(RuntimeError):
    """A resume point names samples its shards no longer hold."""


def _shard_samples(url: str, skips: _Skips, allow_pipe: bool, trail: Trail) -> Iterator[Sample]:
    """One shard's samples {"__key__", "__url__", extension: bytes}; a tar that breaks off counts one skip.

    The break also drops the sample in hand (it may lack a member), so a sample is read only
    when its members and the next one's first member (or the end-of-archive block) are whole.
    """
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
    samples: Iterator[tuple[Coordinate, Sample]],
    transform: Callable[[bytes, random.Random], Example],
    rng: random.Random,
    skips: _Skips,
    trail: Trail,
) -> Iterator[tuple[Example, int]]:
    """Samples -> (image (H, W, C) uint8 or an encoded JPEG, label or -1); bad samples are counted and dropped."""
    for _, sample in samples:
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
    examples: Iterator[tuple[Example, int]],
    batch_size: int,
    skips: _Skips,
    shape: tuple[int, int, int],
    where: Callable[[], ResumePoint],
) -> Iterator[Batch]:
    """Collate into batches; each is held back until the next fills, so skips after the last still count.

    Each batch carries, under "position", the worker's ResumePoint as the batch was completed.
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
            held = _collate(images, labels, skips.take(), shape, where())
            images, labels = [], []
    if images:
        if held is not None:
            yield held
        held = _collate(images, labels, skips.take(), shape, where())
    if held is None and skips.count:
        held = _collate([], [], 0, shape, where())
    if held is not None:
        held["skipped"] += skips.take()
        yield held


def _collate(
    examples: list[Example], labels: list[int], skipped: int, shape: tuple[int, int, int], position: ResumePoint
) -> Batch:
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
        "position": position,
    }
    if len(pixels) < len(examples):
        batch["jpegs"] = pack_jpegs(examples)
    return batch
