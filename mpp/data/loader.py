"""ShardLoader: one split's DataLoader over a ShardStream, as the trainer iterates it.

It sets the stream's (epoch, start step) before each epoch, cuts resampled epochs to their
length, folds the counts of skip-only batches into real ones, keeps the ranks of an
evaluation in step, and names the shard of a worker that dies (mpp.data.workers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from itertools import islice

import torch
from torch.utils.data import DataLoader

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
    ) -> None:
        self.stream, self.split, self.num_batches, self._position = stream, split, num_batches, position
        self.in_step = in_step
        # Batches are collated inside the workers (batch_size=None), where skips are counted.
        self.loader = DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=torch.cuda.is_available())

    def __iter__(self) -> Iterator[Batch]:
        self.stream.epoch, self.stream.start_step = self._position()
        workers = self.loader.num_workers
        self.stream.whereabouts = whereabouts = Whereabouts(workers) if workers else None
        # iter() starts the workers, each with a copy of the stream as it is now.
        batches = supervised(lambda: fold_skip_only_batches(iter(self.loader)), whereabouts)
        if self.num_batches is not None:
            batches = islice(batches, self.num_batches)
        if self.in_step is not None:
            return self._in_step(batches, self.in_step)
        return self._not_empty(batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("a stream that is not resampled has no fixed length")
        return self.num_batches

    def _not_empty(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """The batches; an epoch that ends before its first batch is an error naming the shards."""
        count = 0
        for batch in batches:
            count += 1
            yield batch
        if count == 0:
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
