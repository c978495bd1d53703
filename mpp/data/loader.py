"""ShardLoader: one split's DataLoader over a ShardStream, as the trainer iterates it.

Before each epoch it plans the stream's epoch (epoch, start step, and where a checkpoint left
it: mpp.data.stream.EpochPlan) and starts the workers on it. It cuts resampled epochs to their
length, folds the counts of skip-only batches into real ones, keeps the ranks of an evaluation
in step, notes the resume point of each batch trained on, and names the shard of a worker that
dies (mpp.data.workers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader

from mpp.data.batches import Batch, StreamBatch, empty_batch
from mpp.data.resume import EpochState, changed_settings, shard_list_id
from mpp.data.samples import some_urls
from mpp.data.stream import EpochPlan, ShardStream, StreamSettings
from mpp.data.workers import Whereabouts, supervised
from mpp.secrets import redact

log = logging.getLogger(__name__)


class EmptyEpochError(RuntimeError):
    """An epoch of a split yielded not one batch: every shard empty, unreadable or skipped."""


class ShardLoader:
    """Iterates a DataLoader over each epoch's ShardStream: plans the epoch first, cuts resampled
    epochs, names the shard and sample of a worker that dies, and stops an epoch that yields nothing.

    `in_step` keeps the ranks of an evaluation in step: given whether this rank has another batch,
    it answers whether any rank has (one collective per batch). A rank whose shards are spent then
    yields empty batches until every rank is done, so all run the same number of steps; an empty
    batch counts for nothing in the metrics (its batch size is 0).
    """

    def __init__(
        self,
        settings: StreamSettings,
        *,
        split: str,
        num_workers: int,
        position: Callable[[], tuple[int, int]],
        num_batches: int | None,
        in_step: Callable[[bool], bool] | None = None,
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self.settings, self.split, self.num_workers, self.num_batches = settings, split, num_workers, num_batches
        self._position, self.in_step, self.gather = position, in_step, gather
        self.epoch: EpochState | None = None  # the epoch being read, with the points of its trained batches
        self._loaded: dict[str, Any] | None = None  # a checkpoint's state, taken up by the next epoch

    def __iter__(self) -> Iterator[Any]:
        """The epoch's batches: StreamBatch, or Batch for a rank in step with others (typed Any for callers
        that take plain dicts). Nothing starts before the first is asked for: Lightning may call iter()
        before it restores a checkpoint, whose state (load_state_dict) decides where the epoch starts."""
        epoch, step = self._position()
        state = self._resumed(epoch) or EpochState(epoch, step)
        self.epoch = state
        whereabouts = Whereabouts(self.num_workers) if self.num_workers else None
        plan = EpochPlan(state.epoch, state.start_step, tuple(state.points.values()), state.next_worker, whereabouts)
        # Batches are collated inside the workers (batch_size=None), where skips are counted.
        loader = DataLoader(
            ShardStream(self.settings, plan),
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        # iter() starts the workers, each with a copy of the stream and its plan.
        batches = supervised(lambda: fold_skip_only_batches(iter(loader)), whereabouts)
        if self.num_batches is not None:
            batches = islice(batches, self.num_batches - state.trained)
        if self.in_step is not None:
            yield from self._in_step(batches, self.in_step)
        else:
            yield from self._not_empty(batches, resumed=state.trained > 0)

    def trained(self, batch: StreamBatch) -> None:
        """Note that the training step took `batch` (its "position" is removed): a checkpoint written
        after it resumes with the batch after it."""
        point = batch.pop("position", None)
        if point is not None and self.epoch is not None:
            self.epoch.took(point, self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch is on every rank (Lightning calls this on every rank as it writes a checkpoint;
        rank 0 writes it): its seed step, the batches trained and each worker's resume point."""
        if self.epoch is None or self.split != "train":
            return {}
        mine = self.epoch.as_dict()
        ranks = self.gather(mine) if self.gather is not None else [mine]
        return {"settings": self.resume_settings(), "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take up a checkpoint's state: the next epoch that is the checkpoint's resumes where it was."""
        self._loaded = state or None

    def resume_settings(self) -> dict[str, Any]:
        """What a resume must find unchanged to be exact (mpp.data.resume.SETTINGS)."""
        settings = self.settings
        return {
            "world_size": settings.world_size,
            "num_workers": self.num_workers,
            "batch_size": settings.batch_size,
            "resampled": settings.resampled,
            "num_batches": self.num_batches,
            "shuffle_buffer": settings.shuffle_buffer,
            "seed": settings.seed,
            "shard_shuffle": settings.shard_shuffle,
            "shards": shard_list_id(list(settings.urls)),
        }

    def _resumed(self, epoch: int) -> EpochState | None:
        """This rank's state from a loaded checkpoint, if it is of `epoch` and the stream is the same."""
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return None
        ranks, rank = loaded["ranks"], self.settings.rank
        if rank >= len(ranks) or ranks[rank]["epoch"] != epoch:
            return None  # the checkpoint's epoch was done: this one starts afresh
        changed = changed_settings(loaded["settings"], self.resume_settings())
        if changed:
            log.warning(
                "data.%s: the run resumes with other data settings than its checkpoint's (%s); the stream cannot "
                "continue where it was: epoch %d starts afresh, with draws seeded by the step it resumes at",
                self.split,
                "; ".join(changed),
                epoch,
            )
            return None
        return EpochState.from_dict(ranks[rank])

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("a stream that is not resampled has no fixed length")
        return self.num_batches

    def _not_empty(self, batches: Iterator[StreamBatch], *, resumed: bool) -> Iterator[StreamBatch]:
        """The batches; an epoch that ends before its first batch is an error naming the shards (one
        resumed after its last batch ends without one)."""
        count = 0
        for batch in batches:
            count += 1
            yield batch
        if count == 0 and not resumed:
            raise self._empty()

    def _in_step(
        self, batches: Iterator[StreamBatch], any_rank: Callable[[bool], bool]
    ) -> Iterator[StreamBatch | Batch]:
        """This rank's batches, then empty ones for as long as another rank still has batches."""
        first = True
        while True:
            batch = next(batches, None)
            if not any_rank(batch is not None):
                if first:
                    raise self._empty(everywhere=True)
                return
            first = False
            yield batch if batch is not None else empty_batch(self.settings.shape)

    def _empty(self, everywhere: bool = False) -> EmptyEpochError:
        urls, rank, world_size = self.settings.urls, self.settings.rank, self.settings.world_size
        shown = some_urls(urls)
        where = " on any rank" if everywhere else (f" on rank {rank}" if world_size > 1 else "")
        return EmptyEpochError(
            redact(
                f"data.{self.split} yielded no batch{where}: its {len(urls)} shard(s) ({shown}) hold no sample that "
                "could be read (empty files or tars, or every sample skipped: the warnings above say why); check them with "
                "`mpp shards inspect <shards> --verify`"
            )
        )


def fold_skip_only_batches(batches: Iterator[StreamBatch]) -> Iterator[StreamBatch]:
    """The batches with images; the count of a batch of none (from a worker that had nothing good
    to read) is added to another. Run on the DataLoader's output, in the main process; the last
    batch is held back until the stream ends, as a batch of none can come after it."""
    held: StreamBatch | None = None
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


def gather_ranks(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (all ranks call it, as Lightning dumps a checkpoint on all)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    values: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values
