"""ShardLoader: one split's DataLoader over a ShardStream, as the trainer iterates it.

It sets the stream's (epoch, start step) before each epoch, cuts resampled epochs to their
length, folds the counts of skip-only batches into real ones, keeps the ranks of an
evaluation in step, and names the shard of a worker that dies (mpp.data.workers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader

from mpp.data.resume import ResumePoint, changed_settings, shard_list_id
from mpp.data.stream import Batch, ShardStream, some_urls
from mpp.data.workers import Whereabouts, supervised
from mpp.secrets import redact

log = logging.getLogger(__name__)


class EmptyEpochError(RuntimeError):
    """An epoch of a split yielded not one batch: every shard empty, unreadable or skipped."""


class ShardLoader:
    """Iterates a DataLoader over a ShardStream: sets the stream's (epoch, start step) first, cuts
    resampled epochs, names the shard and sample of a worker that dies, and stops an epoch that
    yields nothing.

    `in_step` keeps the ranks of an evaluation in step: given whether this rank has another batch,
    it answers whether any rank has (one collective per batch). A rank whose shards are spent then
    yields empty batches until every rank is done, so all run the same number of steps; an empty
    batch counts for nothing in the metrics (its batch size is 0).
    """

    def __init__(
        self,
        stream: ShardStream,
        *,
        split: str,
        num_workers: int,
        position: Callable[[], tuple[int, int]],
        num_batches: int | None,
        in_step: Callable[[bool], bool] | None = None,
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self.stream, self.split, self.num_batches, self._position = stream, split, num_batches, position
        self.in_step, self.gather = in_step, gather
        # Batches are collated inside the workers (batch_size=None), where skips are counted.
        self.loader = DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=torch.cuda.is_available())
        self.epoch: EpochState | None = None  # the epoch being read, with the points of its trained batches
        self._loaded: dict[str, Any] | None = None  # a checkpoint's state, taken up by the next epoch

    def __iter__(self) -> Iterator[Batch]:
        """The epoch's batches. Nothing starts before the first is asked for: Lightning may call iter()
        before it restores a checkpoint, whose state (load_state_dict) decides where the epoch starts."""
        epoch, step = self._position()
        state = self._resumed(epoch) or EpochState(epoch, step)
        self.epoch = state
        stream = self.stream
        stream.epoch, stream.start_step = state.epoch, state.start_step
        stream.resume_points, stream.rotation = dict(state.points), state.next_worker
        workers = self.loader.num_workers
        stream.whereabouts = whereabouts = Whereabouts(workers) if workers else None
        # iter() starts the workers, each with a copy of the stream as it is now.
        batches = supervised(lambda: fold_skip_only_batches(iter(self.loader)), whereabouts)
        if self.num_batches is not None:
            batches = islice(batches, self.num_batches - state.trained)
        if self.in_step is not None:
            yield from self._in_step(batches, self.in_step)
        else:
            yield from self._not_empty(batches, resumed=state.trained > 0)

    def trained(self, batch: Batch) -> None:
        """Note that the training step took `batch` (its "position" is removed): a checkpoint written
        after it resumes with the batch after it."""
        point = batch.pop("position", None)
        if point is not None and self.epoch is not None:
            self.epoch.took(point, self.loader.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch is on every rank (Lightning calls this on every rank as it writes a checkpoint;
        rank 0 writes it): its seed step, the batches trained and each worker's resume point."""
        if self.epoch is None or self.split != "train":
            return {}
        mine = self.epoch.as_dict()
        ranks = self.gather(mine) if self.gather is not None else [mine]
        return {"settings": self.settings(), "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take up a checkpoint's state: the next epoch that is the checkpoint's resumes where it was."""
        self._loaded = state or None

    def settings(self) -> dict[str, Any]:
        """What a resume must find unchanged to be exact (mpp.data.resume.SETTINGS)."""
        stream = self.stream
        return {
            "world_size": stream.world_size,
            "num_workers": self.loader.num_workers,
            "batch_size": stream.batch_size,
            "resampled": stream.resampled,
            "num_batches": self.num_batches,
            "shuffle_buffer": stream.shuffle_buffer,
            "seed": stream.seed,
            "shard_shuffle": stream.shard_shuffle,
            "shards": shard_list_id(stream.urls),
        }

    def _resumed(self, epoch: int) -> EpochState | None:
        """This rank's state from a loaded checkpoint, if it is of `epoch` and the stream is the same."""
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return None
        ranks = loaded["ranks"]
        if self.stream.rank >= len(ranks) or ranks[self.stream.rank]["epoch"] != epoch:
            return None  # the checkpoint's epoch was done: this one starts afresh
        changed = changed_settings(loaded["settings"], self.settings())
        if changed:
            log.warning(
                "data.%s: the run resumes with other data settings than its checkpoint's (%s); the stream cannot "
                "continue where it was: epoch %d starts afresh, with draws seeded by the step it resumes at",
                self.split,
                "; ".join(changed),
                epoch,
            )
            return None
        return EpochState.from_dict(ranks[self.stream.rank])

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("a stream that is not resampled has no fixed length")
        return self.num_batches

    def _not_empty(self, batches: Iterator[Batch], *, resumed: bool) -> Iterator[Batch]:
        """The batches; an epoch that ends before its first batch is an error naming the shards (one
        resumed after its last batch ends without one)."""
        count = 0
        for batch in batches:
            count += 1
            yield batch
        if count == 0 and not resumed:
            raise self._empty()

    def _in_step(self, batches: Iterator[Batch], any_rank: Callable[[bool], bool]) -> Iterator[Batch]:
        """This rank's batches, then empty ones for as long as another rank still has batches."""
        first = True
        while True:
            batch = next(batches, None)
            if not any_rank(batch is not None):
                if first:
                    raise self._empty(everywhere=True)
                return
            first = False
            yield batch if batch is not None else self._empty_batch()

    def _empty_batch(self) -> Batch:
        channels, (height, width) = self.stream.transform.channels, self.stream.transform.size
        return {
            "image": torch.empty((0, channels, height, width), dtype=torch.uint8),
            "label": torch.empty((0,), dtype=torch.int64),
            "skipped": torch.zeros((), dtype=torch.int64),
        }

    def _empty(self, everywhere: bool = False) -> EmptyEpochError:
        urls = self.stream.urls
        shown = some_urls(urls)
        where = " on any rank" if everywhere else (f" on rank {self.stream.rank}" if self.stream.world_size > 1 else "")
        return EmptyEpochError(
            redact(
                f"data.{self.split} yielded no batch{where}: its {len(urls)} shard(s) ({shown}) hold no sample that "
                "could be read (empty tars, or every sample skipped: the warnings above say why); check them with "
                "`python tools/inspect_shards.py <shards> --verify`"
            )
        )


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


def fold_skip_only_batches(batches: Iterator[Batch]) -> Iterator[Batch]:
    """The batches with images; the count of a batch of none (from a worker that had nothing good
    to read) is added to another. Run on the DataLoader's output, in the main process; the last
    batch is held back until the stream ends, as a batch of none can come after it."""
    held: Batch | None = None
    carried = 0
    for batch in batches:
        if len(batch["label"]) == 0:
            carried += int(batch["skipped"])
            continue
        if held is not None:
            yield held
        batch["skipped"] += carried
        held, carried = batch, 0
    if held is not None:
        held["skipped"] += carried
        yield held
    elif carried:
        log.warning("skipped %d samples and had not one left to batch", carried)
