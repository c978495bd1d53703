"""ShardDataModule: WebDataset tar shards -> decoded, augmented uint8 batches.

A batch is a dict:
    "image":   uint8 (B, C, H, W), raw pixels (the model normalises them itself)
    "label":   int64 (B,), -1 for samples without a `.cls` member
    "skipped": int64 (), samples dropped since the worker's previous batch (undecodable
               image, one over max_image_pixels, no image member, a tar that broke off:
               one each); summed over batches, the total.
In evaluation on several ranks, B is 0 for the batches a rank runs while it waits, in step,
for the ranks that still have samples (ShardLoader); modules log nothing for them.

Shards are split over ranks (rank and world size from the trainer) and then over DataLoader
workers. Without `resampled`, each sample is read once per epoch across all ranks x workers;
with it, every rank draws shards at random with replacement from its own share (disjoint
across ranks, and across its workers where there are enough shards) and yields
samples_per_epoch // (world_size * batch_size) batches, so DDP ranks stay in step.

Training streams are seeded by the epoch and by the trainer's global step when iteration
starts. Lightning restarts an iterable loader from its start when a run resumes mid-epoch,
so a resumed run draws fresh samples rather than the ones it already trained on; a run that
is not interrupted starts each epoch at a fixed step, so it is reproducible as before.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from types import FrameType

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from mpp.errors import ConfigError, RunStopped, raised_in_worker, stop_signal
from mpp.secrets import redact, redact_tree
from mpp.storage import expand_urls
from mpp.stream import Batch, Position, ShardStream, Whereabouts, fold_skip_only_batches, some_urls
from mpp.transforms import DEFAULT_MAX_PIXELS, ImageTransform
from mpp.vit import ViTConfig, pair

log = logging.getLogger(__name__)

ShardSpec = str | list[str]


def _plain(value: object) -> object:
    """A size as a user writes it: 224 for (224, 224)."""
    return value[0] if isinstance(value, tuple) and len(set(value)) == 1 else value


def _require(ok: bool, name: str, value: object, wanted: str) -> None:
    if not ok:
        raise ValueError(f"ShardDataModule: {name}={value!r} is invalid; it must be {wanted}")


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

    def __init__(self, stream: ShardStream, *, split: str, num_workers: int,
                 position: Callable[[], tuple[int, int]], num_batches: int | None,
                 in_step: Callable[[bool], bool] | None = None) -> None:
        self.stream, self.split, self.num_batches, self._position = stream, split, num_batches, position
        self.in_step = in_step
        # Batches are collated inside the workers (batch_size=None), where skips are counted.
        self.loader = DataLoader(stream, batch_size=None, num_workers=num_workers,
                                 pin_memory=torch.cuda.is_available())

    def __iter__(self) -> Iterator[Batch]:
        self.stream.epoch, self.stream.start_step = self._position()
        workers = self.loader.num_workers
        self.stream.whereabouts = whereabouts = Whereabouts(workers) if workers else None
        if whereabouts is not None:
            _watched.add(whereabouts)
        # iter() starts the workers, each with a copy of the stream as it is now.
        batches = fold_skip_only_batches(iter(self.loader))
        if self.num_batches is not None:
            batches = islice(batches, self.num_batches)
        if whereabouts is not None:
            _watch_worker_deaths()  # after iter(): torch installs its SIGCHLD handler there
            batches = _naming_deaths(batches, whereabouts)
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
        for count, batch in enumerate(batches, 1):
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
        return {"image": torch.empty((0, channels, height, width), dtype=torch.uint8),
                "label": torch.empty((0,), dtype=torch.int64), "skipped": torch.zeros((), dtype=torch.int64)}

    def _empty(self, everywhere: bool = False) -> EmptyEpochError:
        urls = self.stream.urls
        shown = some_urls(urls)
        where = " on any rank" if everywhere else (f" on rank {self.stream.rank}" if self.stream.world_size > 1 else "")
        return EmptyEpochError(redact(
            f"data.{self.split} yielded no batch{where}: its {len(urls)} shard(s) ({shown}) hold no sample that "
            "could be read (empty tars, or every sample skipped: the warnings above say why); check them with "
            "`python tools/inspect_shards.py <shards> --verify`"))


class WorkerDiedError(RuntimeError):
    """A DataLoader worker was killed or exited; the message names the shard it was reading."""


def _naming_deaths(batches: Iterator[Batch], whereabouts: Whereabouts) -> Iterator[Batch]:
    """The batches; an error met while waiting for one, where a worker has died, names its shard.

    Besides torch's own error, a worker killed just after it queued a batch makes fetching that
    batch fail with an OSError (its tensors are passed through a socket of the dead worker).
    """
    try:
        yield from batches
    except (WorkerDiedError, RunStopped):
        raise
    except (RuntimeError, OSError) as error:
        if raised_in_worker(error):  # the worker's own error, passed on by torch: not a death
            raise
        positions = whereabouts.read()
        dead = _torch_death_pids(error) or _exited({p.pid for p in positions if p.pid})
        if not dead:
            raise
        raise _died(error, positions, dead) from error
    finally:
        _watched.discard(whereabouts)


# The positions of the workers of every loader being iterated, for the SIGCHLD handler below.
_watched: weakref.WeakSet[Whereabouts] = weakref.WeakSet()


def _watch_worker_deaths() -> None:
    """Wrap the SIGCHLD handler torch installs, so that the error for a dead worker names its shard.

    torch raises that error from the handler, in the main thread wherever it is when the signal
    comes: in a training step as often as in the loader, where _naming_deaths cannot see it.
    Signal handlers can only be set from the main thread; elsewhere _naming_deaths remains.
    """
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous) or getattr(previous, "names_dead_workers", False):
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        try:
            previous(signum, frame)
        except RuntimeError as error:
            dead = _torch_death_pids(error)
            if not dead:
                raise
            raise _died(error, [p for w in list(_watched) for p in w.read()], dead) from error

    handler.names_dead_workers = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGCHLD, handler)


def _torch_death_pids(error: BaseException) -> set[int]:
    """The pids in torch's "DataLoader worker (pid N) is killed by signal" / "(pid(s) N, M) exited" errors."""
    match = re.match(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)", str(error))
    return {int(pid) for pid in match.group(1).split(",")} if match else set()


def _exited(pids: Iterable[int]) -> set[int]:
    """Those of this process's child pids that have exited, without reaping them (torch does that)."""
    if not hasattr(os, "waitid"):
        return set()
    gone = set()
    for pid in pids:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                gone.add(pid)
        except ChildProcessError:  # reaped already
            gone.add(pid)
    return gone


def _died(error: BaseException, positions: list[Position], dead: set[int]) -> WorkerDiedError | RunStopped:
    """The error naming where each dead worker was; torch's words for how it died are kept. A worker
    stopped by SIGTERM, SIGINT or SIGHUP was not killed for memory: the run was asked to stop."""
    cause, seen = error, set()
    while cause is not None and id(cause) not in seen:  # the handler's error, below torch's "exited"
        if isinstance(cause, WorkerDiedError):  # a fresh error: raising `cause` from `error` would loop the chain
            return WorkerDiedError(str(cause))
        if isinstance(cause, RunStopped):
            return RunStopped(str(cause), cause.signum)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    known = {p.pid: p.describe() for p in positions}
    where = "; ".join(known.get(pid, f"pid {pid}, which had not opened a shard") for pid in sorted(dead))
    signals = [p.stopped_by for p in positions if p.pid in dead and p.stopped_by]
    signum = stop_signal(str(error)) or (signals[0] if signals else None)
    if signum is not None:  # sent to the whole process group: a scheduler's stop, `kill`, Ctrl-C
        return RunStopped(redact(
            f"the run was stopped by {signal.Signals(signum).name}, which also stopped its DataLoader workers "
            f"({where}); resume with --ckpt_path last"), signum)
    return WorkerDiedError(redact(
        f"a DataLoader worker died: {where}. {type(error).__name__}: {str(error).rstrip()} If it was killed "
        "(often by the out-of-memory killer), use fewer workers or a smaller shuffle_buffer; if it crashed, "
        "try that sample on its own."))


class ShardDataModule(pl.LightningDataModule):
    """Shards -> batches {"image": uint8 (B, C, H, W), "label": int64 (B,), "skipped": int64 ()}.

    Args:
        train, val, test: shards of each split: a path, a brace pattern
            (`shards/train-{000000..000009}.tar`), a local glob, an http(s)://, s3://, gs://
            or pipe: URL, or a list of those. Labels are read where present and ignored by
            pretraining.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader worker processes per rank (0 reads in the main process).
        image_size: output size, an int or (H, W); null (the default): the encoder's, read from the
            trainer's module (`model.init_args.encoder.image_size`), or 224 used alone. A size set
            here that differs from the encoder's stops the run before training, naming both keys.
        channels: 1 or 3, any PIL mode converted (16-bit scaled, alpha composited on black); null:
            the encoder's, or 3 used alone; checked against the encoder as image_size is.
        crop_scale, crop_ratio: area fraction and aspect (w/h) range of the training crop.
        hflip: flip training images horizontally half of the time.
        eval_crop_fraction: evaluation resizes to cover image_size / eval_crop_fraction, then
            centre-crops image_size (1.0: resize the short side to the crop).
        shard_shuffle: shuffle the training shard order, anew each epoch.
        shuffle_buffer: training samples held in each worker's shuffle buffer (0 or 1: none).
        resampled: draw training shards with replacement, an endless stream cut into epochs of
            samples_per_epoch samples (across all ranks); use it for multi-GPU training. Each
            rank draws from its own shards, urls[rank::world_size], and each of its workers
            from its own part of those, where there are enough; with fewer shards than ranks
            every rank draws from all (and a warning says so).
        samples_per_epoch: global training samples per epoch; required with `resampled`.
        seed: seeds shard order, sample shuffle and augmentation (with epoch, step, rank and worker).
        allow_pipe: allow pipe: URLs, which run shell commands.
        max_image_pixels: an image whose header declares more pixels is skipped (and counted)
            without being decoded. The default is PIL's Image.MAX_IMAGE_PIXELS default, about
            0.25 GiB of RGB; PIL itself still refuses images over twice its own limit.

    Rank and world size come from the trainer in setup(), or from setup(rank=, world_size=).
    The epoch that reseeds shard order comes from trainer.current_epoch, or set_epoch(). A
    training stream is also seeded by trainer.global_step when it starts (or set_epoch's
    `step`): a run resumed mid-epoch, which Lightning restarts at the loader's beginning,
    draws fresh samples. A stream that is not resampled rereads the whole of the resumed
    epoch's shards, in that epoch's order, with fresh sample shuffling and augmentation.
    """

    def __init__(self, *, train: ShardSpec | None = None, val: ShardSpec | None = None,
                 test: ShardSpec | None = None, batch_size: int = 64, num_workers: int = 4,
                 image_size: int | tuple[int, int] | None = None, channels: int | None = None,
                 crop_scale: tuple[float, float] = (0.08, 1.0), crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 hflip: bool = True, eval_crop_fraction: float = 0.875, shard_shuffle: bool = True,
                 shuffle_buffer: int = 1000, resampled: bool = False, samples_per_epoch: int | None = None,
                 seed: int = 0, allow_pipe: bool = False, max_image_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        settings = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        super().__init__()
        # Lightning hands these to every logger and checkpoint: shard URLs go with credentials masked.
        self.save_hyperparameters(redact_tree(settings))
        size = None if image_size is None else pair(image_size)
        _require(batch_size >= 1, "batch_size", batch_size, "a positive number of samples")
        _require(num_workers >= 0, "num_workers", num_workers, "0 or more worker processes")
        _require(size is None or (len(size) == 2 and min(size) >= 1), "image_size", image_size,
                 "an int or (H, W), or null for the encoder's")
        _require(channels in (None, 1, 3), "channels", channels, "1 or 3, or null for the encoder's")
        _require(0 < crop_scale[0] <= crop_scale[1] <= 1, "crop_scale", crop_scale, "(min, max) in (0, 1]")
        _require(0 < crop_ratio[0] <= crop_ratio[1], "crop_ratio", crop_ratio, "(min, max) > 0")
        _require(0 < eval_crop_fraction <= 1, "eval_crop_fraction", eval_crop_fraction, "in (0, 1]")
        _require(shuffle_buffer >= 0, "shuffle_buffer", shuffle_buffer, "0 or more samples")
        _require(samples_per_epoch is None or samples_per_epoch >= 1, "samples_per_epoch", samples_per_epoch,
                 "a positive number")
        _require(not resampled or samples_per_epoch is not None, "samples_per_epoch", samples_per_epoch,
                 "set with resampled=True, which makes an endless stream")
        _require(max_image_pixels >= 1, "max_image_pixels", max_image_pixels, "a positive number of pixels")
        self.specs = {"train": train, "val": val, "test": test}
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.resampled, self.samples_per_epoch, self.allow_pipe = resampled, samples_per_epoch, allow_pipe
        self.shard_shuffle, self.shuffle_buffer = shard_shuffle, shuffle_buffer
        self.image_size, self.channels = size, channels
        self._augment = {"scale": tuple(crop_scale), "ratio": tuple(crop_ratio), "hflip": hflip}
        self._eval_crop_fraction, self._max_pixels = eval_crop_fraction, max_image_pixels
        self.rank, self.world_size = 0, 1
        self.urls: dict[str, list[str]] = {}
        self._epoch = self._step = 0

    def setup(self, stage: str | None = None, *, rank: int | None = None, world_size: int | None = None,
              encoder: ViTConfig | None = None) -> None:
        """Expand and check the shards a stage needs; rank/world size default to the trainer's, else 0/1,
        and the encoder whose image size and channels the images take to the trainer's module's."""
        if rank is not None and world_size is not None:
            self.rank, self.world_size = rank, world_size
        elif self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if encoder is None and self.trainer is not None:
            encoder = getattr(self.trainer.lightning_module, "encoder_config", None)
        size, channels = self._fit_the_encoder(encoder)
        common = {"size": size, "channels": channels, "max_pixels": self._max_pixels}
        self.train_transform = ImageTransform(train=True, **self._augment, **common)
        self.eval_transform = ImageTransform(train=False, crop_fraction=self._eval_crop_fraction, **common)
        required = {"fit": "train", "validate": "val", "test": "test"}.get(stage or "")
        if required is not None and self.specs[required] is None:
            raise ValueError(f"stage {stage!r} needs shards for {required!r}: set data.{required}")
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage or "", self.specs)
        for split in splits:
            if self.specs[split] is not None:
                try:
                    self.urls[split] = expand_urls(self.specs[split], allow_pipe=self.allow_pipe)
                except (OSError, ValueError) as error:
                    raise ConfigError(redact(f"data.{split}: {error}")) from error
        train = self.urls.get("train")
        if train is not None and self.world_size > 1 and not self.resampled:
            log.warning("training on %d ranks without resampled=True: ranks may get unequal batch counts, "
                        "which stalls DDP; set resampled=True and samples_per_epoch", self.world_size)
        if train is not None and len(train) < self.world_size and not self.resampled:
            log.warning("train has %d shards for %d ranks: some ranks read nothing", len(train), self.world_size)
        if train is not None and self.resampled and len(train) < self.world_size and "train" in splits:
            log.warning("train has %d shards for %d ranks: every rank draws from all of them, so ranks "
                        "read the same samples; give at least one shard per rank", len(train), self.world_size)

    def _fit_the_encoder(self, encoder: ViTConfig | None) -> tuple[tuple[int, int], int]:
        """(H, W) and channels of the images: as set, else the encoder's; a mismatch is an error."""
        if encoder is None:
            return self.image_size or (224, 224), self.channels or 3
        wanted = {"image_size": pair(encoder.image_size), "channels": encoder.channels}
        for name, value in (("image_size", self.image_size), ("channels", self.channels)):
            if value is not None and value != wanted[name]:
                raise ValueError(
                    f"data.{name}={_plain(value)} does not fit the encoder's model.init_args.encoder.{name}="
                    f"{_plain(wanted[name])}: leave data.{name} unset (it follows the encoder) or make the two equal")
        return wanted["image_size"], wanted["channels"]

    def set_epoch(self, epoch: int, *, step: int = 0) -> None:
        """Choose the epoch that seeds shard order and augmentation, and the global step a training
        stream starts at, when there is no trainer."""
        self._epoch, self._step = epoch, step

    def train_dataloader(self) -> ShardLoader:
        """Training batches: random crops and flips, shuffled shards and samples."""
        return self._loader("train", train=True)

    def val_dataloader(self) -> ShardLoader | list:
        """Validation batches: centre crops in shard order (none if `val` is not set)."""
        return self._loader("val", train=False) if self.specs["val"] is not None else []

    def test_dataloader(self) -> ShardLoader:
        """Test batches: centre crops in shard order."""
        return self._loader("test", train=False)

    def _training_position(self) -> tuple[int, int]:
        """(epoch, global step) as a training stream starts; read at each iter(), as Lightning never
        calls set_epoch on an iterable dataset and the trainer's counts are the truth."""
        if self.trainer is not None:
            return self.trainer.current_epoch, self.trainer.global_step
        return self._epoch, self._step

    def _eval_position(self) -> tuple[int, int]:
        return self._training_position()[0], 0

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
        position = self._training_position if train else self._eval_position
        return ShardLoader(stream, split=split, num_workers=self.num_workers, position=position,
                           num_batches=num_batches, in_step=None if train else self._any_rank())

    def _any_rank(self) -> Callable[[bool], bool] | None:
        """For evaluation on several ranks: whether any rank still has a batch (see ShardLoader)."""
        if self.world_size == 1 or self.trainer is None:
            return None
        strategy = self.trainer.strategy
        return lambda has_batch: strategy.reduce_boolean_decision(has_batch, all=False)
