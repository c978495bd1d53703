"""Where a training stream is, so that a run killed mid-epoch resumes on the very next sample.

A DataLoader worker reads shards in an order, groups their members into samples, shuffles them
in a buffer and decodes them into batches (mpp.data.samples names every sample by its
coordinates: the index of its shard in the worker's order and its index in that shard). When a
batch is complete the worker notes its `ResumePoint`: the next sample it would read, the
coordinates of the samples in its buffer (in buffer order), which shards those come from, and
the state of its random generator (shard draws, buffer picks and augmentation all draw from it).
The batch carries the point to the main process, where ShardLoader keeps, in an `EpochState`, the
point of the last batch each worker had trained on; that goes into the checkpoint.

Resuming, a worker `replay`s: it rereads the shards its buffer's samples came from, keeps those
samples (no image is decoded), reopens its current shard at the next sample and sets its
generator's state: it then yields what it would have yielded had the run not stopped. Images are
never pickled into a checkpoint; the cost is reading those shards again (measured by
benchmarks/bench_resume.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpp.data.samples import Coordinate, Sample, ShardReader, ShuffleBuffer, Skips

# In the worker: its point after a batch, and the replay that rebuilds its stream from one.


@dataclass(frozen=True)
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

    @classmethod
    def of(cls, role: int, reader: ShardReader, buffer: ShuffleBuffer) -> ResumePoint:
        """Where the worker playing `role` is now: its reader's next sample, its buffer, its generator."""
        coordinates = buffer.coordinates()
        named = {int(j) for j in coordinates[:, 0]} | {reader.next[0]}
        shards = {j: at for j in named if (at := reader.shard_known(j)) is not None}
        return cls(role, reader.next, coordinates, shards, reader.rng.getstate())

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


class ResumeError(RuntimeError):
    """A resume point names samples its shards no longer hold."""


def replay(reader: ShardReader, point: ResumePoint, buffer: ShuffleBuffer) -> Iterator[tuple[Coordinate, Sample]]:
    """Rebuild a worker's stream at `point`: refill `buffer` from the shards its samples came from (read
    again, nothing decoded), take up the generator's state and the shard draws, and read on from
    `point.next`. The shards before the current one are reread now; the current one's start as the
    returned samples are first asked for."""
    reader.rng.setstate(point.rng)
    if reader.resampled:
        reader.drawn.update(point.shards)
    slots: dict[Coordinate, int] = {(int(j), int(i)): slot for slot, (j, i) in enumerate(point.buffer)}
    items: list[tuple[Coordinate, Sample] | None] = [None] * len(slots)

    def found(coordinate: Coordinate, sample: Sample) -> None:
        if coordinate in slots:
            items[slots[coordinate]] = (coordinate, sample)

    current, first = point.next
    counted = Skips()  # what these shards skipped was counted before the run stopped
    for index in sorted({j for j, _ in slots if j != current}):
        last = max(i for j, i in slots if j == index)
        for number, sample in enumerate(reader.samples_of(point.shards[index], counted)):
            found((index, number), sample)
            if number >= last:
                break
    buffer.items = items  # type: ignore[assignment]  # complete once the current shard's start is read
    live = reader.read(point.next, found)
    reader.next = point.next
    return _checked(live, items, point)


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


# In the main process: the points of the trained batches, and the settings a resume must find unchanged.


@dataclass
class EpochState:
    """One rank's training epoch: its number, the global step that seeded it, how many batches the
    training step took, and for each worker role the resume point of the last of them."""

    epoch: int
    start_step: int
    trained: int = 0
    next_worker: int = 0  # the role whose batch comes next
    points: dict[int, ResumePoint] = field(default_factory=dict)

    def took(self, point: ResumePoint, num_workers: int) -> None:
        self.trained += 1
        self.points[point.worker] = point
        self.next_worker = (point.worker + 1) % max(1, num_workers)

    def as_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "start_step": self.start_step,
            "trained": self.trained,
            "next_worker": self.next_worker,
            "points": [point.as_dict() for point in self.points.values()],
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> EpochState:
        points = [ResumePoint.from_dict(point) for point in state["points"]]
        return cls(
            state["epoch"],
            state["start_step"],
            state["trained"],
            state["next_worker"],
            {point.worker: point for point in points},
        )


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
