"""One rank's stream of batches, as each DataLoader worker reads it: shards -> samples -> batches.

A split's stream reads the same `StreamSettings` every epoch, and one `EpochPlan` per epoch, made
in the main process before the workers start (ShardLoader). Each worker then composes its part of
the flow: its share of the shards read into samples and shuffled (mpp.data.samples), or, resuming,
its stream replayed to where the checkpoint left it (mpp.data.resume); the samples decoded,
augmented and collated (mpp.data.batches). While it works, a worker writes where it is (its shard,
the sample it decodes) into shared memory (mpp.data.workers), so that the main process can name
them if the worker is killed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from torch.utils.data import IterableDataset, get_worker_info

from mpp.data.batches import StreamBatch, batches, decoded
from mpp.data.resume import ResumePoint, replay
from mpp.data.samples import EmptyShardsError, ShardReader, ShuffleBuffer, Skips, shard_share
from mpp.data.transforms import ImageTransform
from mpp.data.workers import Trail, Whereabouts

# EmptyShardsError is raised as the stream reads (mpp.data.samples); it is named here for those that catch it.
__all__ = ["Decode", "EmptyShardsError", "EpochPlan", "ShardStream", "StreamSettings"]

Decode = Literal["cpu", "device"]


@dataclass(frozen=True)
class StreamSettings:
    """What a split's stream reads, the same every epoch: its shards, this rank's place among the ranks,
    the batching, shuffling and transform. `decode="device"` leaves JPEGs encoded for the device; `named`
    batches carry their samples' keys and shards (mpp.data.batches.StreamBatch)."""

    urls: tuple[str, ...]
    rank: int
    world_size: int
    batch_size: int
    transform: ImageTransform
    shard_shuffle: bool
    shuffle_buffer: int
    resampled: bool
    seed: int
    allow_pipe: bool
    decode: Decode = "cpu"
    named: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the stream's images."""
        return (self.transform.channels, *self.transform.size)


@dataclass(frozen=True)
class EpochPlan:
    """One epoch of a stream, fixed in the main process before the workers start (each gets a copy).

    epoch: orders the shards; (epoch, start_step) seed the draws, sample shuffle and augmentation.
    resume_points: for an epoch resumed from a checkpoint, each worker role's point (mpp.data.resume).
    rotation: the role of the first worker: a resumed loader rotates the roles so that its first
        worker, which delivers the first batch, is the one whose batch came next.
    whereabouts: where the workers write where they are (None without workers).
    """

    epoch: int
    start_step: int
    resume_points: tuple[ResumePoint, ...] = ()
    rotation: int = 0
    whereabouts: Whereabouts | None = None

    def resume_point(self, role: int) -> ResumePoint | None:
        return next((point for point in self.resume_points if point.worker == role), None)


class ShardStream(IterableDataset):
    """The batches of one rank's share of the shards in one epoch; iterated inside each DataLoader worker.

    Workers are created anew for each epoch (no persistent workers), each with a copy of the stream.
    Each batch carries its worker's ResumePoint under "position" (mpp.data.resume).
    """

    def __init__(self, settings: StreamSettings, plan: EpochPlan) -> None:
        super().__init__()
        self.settings, self.plan = settings, plan

    def __iter__(self) -> Iterator[StreamBatch]:
        settings, plan = self.settings, self.plan
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # The role a worker plays: its share of shards and its seed.
        role = (worker + plan.rotation) % num_workers
        # Seeded by everything that should change the stream, so runs are reproducible.
        rng = random.Random(f"{settings.seed}/{plan.epoch}/{plan.start_step}/{settings.rank}/{role}")
        skips = Skips()
        trail = Trail(plan.whereabouts, worker)
        if info is not None:
            trail.record_stop_signals()
        share = shard_share(
            len(settings.urls),
            rank=settings.rank,
            world_size=settings.world_size,
            role=role,
            num_workers=num_workers,
            resampled=settings.resampled,
            shuffled_by=f"{settings.seed}/{plan.epoch}" if settings.shard_shuffle else None,
        )
        reader = ShardReader(
            list(settings.urls),
            share,
            rng,
            skips,
            allow_pipe=settings.allow_pipe,
            trail=trail,
            resampled=settings.resampled,
        )
        buffer = ShuffleBuffer(settings.shuffle_buffer, min(100, settings.shuffle_buffer), rng)
        point = plan.resume_point(role)
        source = reader.read() if point is None else replay(reader, point, buffer)
        transform = settings.transform.for_device if settings.decode == "device" else settings.transform
        examples = decoded(buffer(source), transform, rng, skips, trail)
        return batches(
            examples,
            settings.batch_size,
            skips,
            settings.shape,
            lambda: ResumePoint.of(role, reader, buffer),
            shards=settings.urls if settings.named else None,
        )
