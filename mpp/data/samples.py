"""One worker's shards -> tar samples, each named by its coordinates, shuffled in a buffer.

A worker reads the shards of its share in turn (or, resampled, draws from them with replacement),
groups each tar's members into samples and shuffles them in a buffer. Every sample is named by its
coordinates: the index of its shard in the worker's order and its index in that shard, so that a
resume point can name the samples in the buffer and where reading goes on (mpp.data.resume). A
shard that breaks off is dropped and counted as a skip (Skips).
"""

from __future__ import annotations

import logging
import random
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from mpp.data.remote import ShardOpenError, open_url
from mpp.data.transforms import DECODE_ERRORS
from mpp.data.workers import Trail
from mpp.secrets import redact
from mpp.shards.tar import EmptyFileError, MemberOrderError, iter_samples

log = logging.getLogger(__name__)

T = TypeVar("T")
Coordinate = tuple[int, int]  # (shard index in the worker's order, sample index in that shard)
Sample = dict[str, Any]  # {"__key__", "__url__", extension: bytes}

# What a broken sample or shard raises while being read or decoded (PIL uses several of these).
BAD_INPUT = (*DECODE_ERRORS, tarfile.TarError)


def resampled_share(urls: Sequence[T], *, rank: int, world_size: int, worker: int, num_workers: int) -> list[T]:
    """The shards one worker of one rank draws from with replacement.

    Ranks draw from disjoint shards, urls[rank::world_size], when there are at least as many
    shards as ranks (else every rank draws from all); a rank's workers split its share the
    same way when it has at least one shard per worker (else each draws from all of it).
    """
    share = list(urls[rank::world_size]) if len(urls) >= world_size else list(urls)
    return share[worker::num_workers] if len(share) >= num_workers else share


def shard_share(
    count: int, *, rank: int, world_size: int, role: int, num_workers: int, resampled: bool, shuffled_by: str | None
) -> list[int]:
    """Indices into a split's `count` URLs of the shards of one rank and worker role: its share of the epoch,
    in order, or (resampled) the share it draws from at random, with replacement. `shuffled_by` seeds the
    shuffle of the shard order (None: the order given).
    """
    indices = list(range(count))
    if resampled:
        return resampled_share(indices, rank=rank, world_size=world_size, worker=role, num_workers=num_workers)
    if shuffled_by is not None:
        # One permutation for all ranks and workers, so that their slices partition it; seeded by
        # the epoch alone, so an epoch resumed at a later step rereads the same shards.
        random.Random(shuffled_by).shuffle(indices)
    return indices[rank::world_size][role::num_workers]


class EmptyShardsError(RuntimeError):
    """Every shard a resampled stream draws from holds no sample."""


def some_urls(urls: Sequence[str]) -> str:
    """The first three URLs and how many more: shards named in a message."""
    return ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")


def _empty_message(share: Sequence[str], empty_files: set[str]) -> str:
    files = [url for url in share if url in empty_files]
    tars = [url for url in share if url not in empty_files]
    kinds = [f"empty (a tar with no members): {some_urls(tars)}"] if tars else []
    kinds += [f"an empty file (0 bytes): {some_urls(files)}"] if files else []
    return (
        f"every shard this stream draws from is {'; or '.join(kinds)}; there is "
        "nothing to train on. Check them with `mpp shards inspect <shards>`"
    )


class Skips:
    """Counts the samples one worker dropped; the first one per process is logged as a warning.

    So many failures in a row that nothing is readable (every shard broken, a wrong format) is an
    error instead: a resampled stream would otherwise spin forever without a batch.
    """

    warned = False
    limit = 1000

    def __init__(self) -> None:
        self.count = self.streak = 0
        self.empty_shards: set[str] = set()  # shards that were whole tars without a member, or empty files
        self.empty_files: set[str] = set()  # shards of 0 bytes (each read is also a skip: data may be lost)

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
        if not Skips.warned:
            Skips.warned = True
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


class ShardReader:
    """A worker's samples with their coordinates, and where it is: `next`, the coordinate of the next
    sample it would read.

    `share` holds indices into the stream's URLs: read in turn, or (resampled) drawn from with
    replacement, endlessly, by `rng`; `drawn` keeps the draws made. An endless draw from shards that
    all turned out to hold no sample would never yield a batch: it stops with an error naming them
    once every shard of its share has been seen empty.
    """

    def __init__(
        self,
        urls: list[str],
        share: list[int],
        rng: random.Random,
        skips: Skips,
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
                share = [self.urls[at] for at in self.share]
                raise EmptyShardsError(redact(_empty_message(share, self.skips.empty_files)))
            self.drawn[index] = self.rng.choice(self.share)
        return self.drawn[index]

    def shard_known(self, index: int) -> int | None:
        """The URL index of an order index already read or drawn (no draw: a resume point must not draw)."""
        if self.resampled:
            return self.drawn.get(index)
        return self.share[index] if index < len(self.share) else None

    def read(
        self, start: Coordinate = (0, 0), found: Callable[[Coordinate, Sample], None] | None = None
    ) -> Iterator[tuple[Coordinate, Sample]]:
        """The samples from `start` on; those of start's shard before it go to `found` (a resumed buffer's)."""
        index, first = start
        while (at := self.shard(index)) is not None:
            for number, sample in enumerate(self.samples_of(at, self.skips)):
                if number < first:
                    if found is not None:
                        found((index, number), sample)
                    continue
                self.next = (index, number + 1)
                yield (index, number), sample
            index, first = index + 1, 0
            self.next = (index, 0)

    def samples_of(self, at: int, skips: Skips) -> Iterator[Sample]:
        """The samples of the shard at URL index `at`, its failures counted in `skips`."""
        return shard_samples(self.urls[at], skips, self.allow_pipe, self.trail)


def shard_samples(url: str, skips: Skips, allow_pipe: bool, trail: Trail) -> Iterator[Sample]:
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
    except EmptyFileError as error:  # a skip, and among the empty shards a resampled stream may stop on
        skips.empty_shards.add(url)
        skips.empty_files.add(url)
        skips.add(f"shard {url}", error)
    except BAD_INPUT as error:
        skips.add(f"shard {url} after sample {last}" if last else f"shard {url}", error)
    finally:
        stream.close()


@dataclass
class ShuffleBuffer:
    """webdataset's shuffle buffer (the same fill rule: it grows by two samples for each one it
    gives until it holds `size`, and gives from `initial` on), holding samples with their
    coordinates so that its contents can be named and rebuilt."""

    size: int
    initial: int
    rng: random.Random
    items: list[tuple[Coordinate, Sample]] = field(default_factory=list)

    def __call__(self, source: Iterator[tuple[Coordinate, Sample]]) -> Iterator[tuple[Coordinate, Sample]]:
        if self.size <= 1:
            yield from source
            return
        for item in source:
            self.items.append(item)
            if len(self.items) < self.size:
                extra = next(source, None)
                if extra is not None:
                    self.items.append(extra)
            if len(self.items) >= self.initial:
                yield self._pick()
        while self.items:
            yield self._pick()

    def _pick(self) -> tuple[Coordinate, Sample]:
        items = self.items
        chosen = self.rng.randint(0, len(items) - 1)
        items[chosen], items[-1] = items[-1], items[chosen]
        return items.pop()

    def coordinates(self) -> np.ndarray:
        """(K, 2) int64: the coordinates of the samples held, in buffer order."""
        return np.array([coordinate for coordinate, _ in self.items], dtype=np.int64).reshape(-1, 2)
