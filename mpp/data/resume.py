"""Where a training stream is, so that a run killed mid-epoch resumes on the very next sample.

A DataLoader worker reads shards in an order, groups their members into samples, shuffles them
in a buffer and decodes them into batches. Every sample is named by its coordinates: the index
of its shard in the worker's order and its index in that shard. When a batch is complete the
worker notes its `ResumePoint`: the next sample it would read, the coordinates of the samples in
its buffer (in buffer order), which shards those come from, and the state of its random
generator (shard draws, buffer picks and augmentation all draw from it). The batch carries the
point to the main process, where ShardLoader keeps the point of the last batch each worker had
trained on; that goes into the checkpoint.

Resuming, a worker rereads the shards its buffer's samples came from, keeps those samples (no
image is decoded), reopens its current shard at the next sample and sets its generator's state:
it then yields what it would have yielded had the run not stopped. Images are never pickled
into a checkpoint; the cost is reading those shards again (`replay`, measured by
tools/bench_resume.py).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Coordinate = tuple[int, int]  # (shard index in the worker's order, sample index in that shard)
Sample = dict[str, Any]


@dataclass
class ResumePoint:
    """One worker's position after a batch: enough to rebuild its stream from the shards.

    worker: the worker's role (the index its shard share and seed were made for).
    next: the coordinate of the next sample to read.
    buffer: (K, 2) int64, the coordinates of the samples in the shuffle buffer, in buffer order.
    shards: for every shard index in `buffer` and next's, the shard's index in the stream's URL
        list (no URL goes into a checkpoint: a signed one holds a credential).
    rng: the state of the worker's random.Random.
    """

    worker: int
    next: Coordinate
    buffer: np.ndarray
    shards: dict[int, int]
    rng: tuple[Any, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (torch.load with weights_only reads it)."""
        return {
            "worker": self.worker,
            "next": list(self.next),
            "buffer": self.buffer.tolist(),
            "shards": {str(index): int(at) for index, at in self.shards.items()},
            "rng": _plain_state(self.rng),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> ResumePoint:
        version, internal, gauss = state["rng"]
        return cls(
            worker=int(state["worker"]),
            next=(int(state["next"][0]), int(state["next"][1])),
            buffer=np.asarray(state["buffer"], dtype=np.int64).reshape(-1, 2),
            shards={int(index): int(at) for index, at in state["shards"].items()},
            rng=(version, tuple(internal), gauss),
        )


def _plain_state(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


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
        return np.array([coordinate for coordinate, _ in self.items], dtype=np.int64).reshape(-1, 2)


SETTINGS = (
    "world_size",
    "num_workers",
    "batch_size",
    "resampled",
    "num_batches",
    "shuffle_buffer",
    "seed",
    "shard_shuffle",
    "shards",
)


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings that differ between a checkpoint's stream and this run's, as `name: was -> is`."""
    changes = []
    for name in SETTINGS:
        if saved.get(name) != now.get(name):
            was, is_ = saved.get(name), now.get(name)
            if name == "shards":
                was, is_ = _shards_said(was), _shards_said(is_)
            changes.append(f"{name}: {was} -> {is_}")
    return changes


def _shards_said(shards: Any) -> str:
    if not shards:
        return "none"
    count, _ = shards
    return f"{count} shard(s) (another list)"


def shard_list_id(urls: list[str]) -> list[Any]:
    """[count, digest] of a shard list: what a checkpoint keeps to know the list again, without the URLs."""
    digest = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]
    return [len(urls), digest]
