"""ShardDataModule: coverage, splitting, epochs, resuming, bad input, dying workers, image modes, crops."""

from __future__ import annotations

import io
import logging
import os
import random
import re
import signal
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.callbacks import ModelCheckpoint
from shardkit import (
    encode,
    header_only_png,
    read_all,
    sample,
    write_shard,
    write_shards,
)

from mpp.data import samples, workers
from mpp.data.batches import Batch, StreamBatch
from mpp.data.loader import EmptyEpochError
from mpp.data.module import ShardDataModule
from mpp.data.samples import resampled_share
from mpp.data.transforms import ImageTransform
from mpp.data.workers import WorkerDiedError
from mpp.errors import ConfigError, RunStopped, exit_code


def make(train: str | list[str], **kw: object) -> ShardDataModule:
    config = {"batch_size": 4, "num_workers": 0, "image_size": 8, "shuffle_buffer": 8, **kw}
    return ShardDataModule(train=train, **config)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """8 shards x 3 samples, numbered 0..23."""
    return write_shards(tmp_path_factory.mktemp("shards"), shards=8, per_shard=3)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_every_sample_once_with_its_label(shards: str, num_workers: int) -> None:
    dm = make(shards, num_workers=num_workers)
    dm.setup("fit")
    labels, skipped, _ = read_all(dm.train_dataloader())
    assert sorted(labels) == list(range(24)) and skipped == 0


def test_batches_are_uint8_dicts_of_the_requested_shape(shards: str) -> None:
    dm = make(shards, image_size=(6, 10), channels=1, shuffle_buffer=0)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"image", "label", "skipped", "position"}  # the data module drops "position" on the device
    assert batch["image"].shape == (4, 1, 6, 10) and batch["image"].dtype == torch.uint8
    assert set(batch) <= StreamBatch.__required_keys__ | StreamBatch.__optional_keys__
    on_device = dm.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert set(on_device) == Batch.__required_keys__  # what a step receives is the typed Batch, all of it


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_and_workers_partition_the_samples(shards: str, world_size: int) -> None:
    seen: Counter[int] = Counter()
    for rank in range(world_size):
        dm = make(shards, num_workers=2)
        dm.setup("fit", rank=rank, world_size=world_size)
        labels, _, _ = read_all(dm.train_dataloader())
        assert labels, f"rank {rank} of {world_size} read nothing"
        seen.update(labels)
    assert sorted(seen) == list(range(24)) and set(seen.values()) == {1}


@pytest.mark.parametrize("world_size", [2, 4])
def test_resampled_ranks_get_equal_batch_counts_and_different_streams(shards: str, world_size: int) -> None:
    streams = []
    for rank in range(world_size):
        dm = make(shards, num_workers=2, resampled=True, samples_per_epoch=64)
        dm.setup("fit", rank=rank, world_size=world_size)
        loader = dm.train_dataloader()
        labels, _, batches = read_all(loader)
        assert batches == len(loader) == 64 // (world_size * 4)
        assert len(labels) == batches * 4
        streams.append(labels)
    assert len({tuple(s) for s in streams}) == world_size


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_resampled_ranks_and_workers_draw_from_disjoint_shards_that_cover_all(shards: str, world_size: int) -> None:
    drawn: list[set[int]] = []
    for rank in range(world_size):
        dm = make(shards, num_workers=2, resampled=True, samples_per_epoch=96)
        dm.setup("fit", rank=rank, world_size=world_size)
        by_worker: list[set[int]] = [set(), set()]
        for index, batch in enumerate(dm.train_dataloader()):
            # Workers take turns, batch by batch; shard s holds samples 3s, 3s + 1, 3s + 2.
            by_worker[index % 2].update(label // 3 for label in batch["label"].tolist())
        share = list(range(rank, 8, world_size))
        assert by_worker == [set(share[0::2]), set(share[1::2])]
        drawn.append(by_worker[0] | by_worker[1])
    assert set().union(*drawn) == set(range(8)) and sum(map(len, drawn)) == 8


def test_resampled_shares_fall_back_to_all_shards_when_too_few() -> None:
    urls = [f"shard-{i}" for i in range(5)]
    parts = [resampled_share(urls, rank=r, world_size=2, worker=w, num_workers=2) for r in (0, 1) for w in (0, 1)]
    assert parts == [["shard-0", "shard-4"], ["shard-2"], ["shard-1"], ["shard-3"]]
    # A rank with fewer shards than workers: each worker draws from all of the rank's shards.
    assert resampled_share(urls, rank=1, world_size=2, worker=2, num_workers=3) == ["shard-1", "shard-3"]
    # Fewer shards than ranks: every rank draws from all.
    assert resampled_share(urls, rank=6, world_size=8, worker=0, num_workers=1) == urls


def test_resampled_with_fewer_shards_than_ranks_warns_and_reads_all(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    dm = make(write_shards(tmp_path, shards=2, per_shard=3), resampled=True, samples_per_epoch=96)
    with caplog.at_level(logging.WARNING, logger="mpp.data.module"):
        dm.setup("fit", rank=2, world_size=3)
    assert caplog.text.count("every rank draws from all") == 1
    labels, _, _ = read_all(dm.train_dataloader())
    assert {label // 3 for label in labels} == {0, 1}


def test_shard_order_changes_with_the_epoch_and_repeats_with_it(shards: str) -> None:
    dm = make(shards, shuffle_buffer=0)
    dm.setup("fit")

    def shard_order(epoch: int) -> list[int]:
        dm.set_epoch(epoch)
        labels, _, _ = read_all(dm.train_dataloader())
        assert sorted(labels) == list(range(24))
        return list(dict.fromkeys(label // 3 for label in labels))

    first, second = shard_order(0), shard_order(1)
    assert first != second and shard_order(0) == first


def test_resampled_stream_changes_with_the_epoch(shards: str) -> None:
    dm = make(shards, num_workers=2, resampled=True, samples_per_epoch=32)
    dm.setup("fit")
    dm.set_epoch(0)
    first, _, _ = read_all(dm.train_dataloader())
    dm.set_epoch(1)
    second, _, _ = read_all(dm.train_dataloader())
    assert first != second


def test_training_streams_repeat_for_the_same_start_step_and_change_for_another(shards: str) -> None:
    dm = make(shards, num_workers=2, resampled=True, samples_per_epoch=32)
    dm.setup("fit")

    def labels(epoch: int, step: int) -> list[int]:
        dm.set_epoch(epoch, step=step)
        return read_all(dm.train_dataloader())[0]

    assert labels(1, 8) == labels(1, 8)
    assert labels(1, 8) != labels(1, 11)


def test_a_resumed_epoch_rereads_its_shards_in_order_with_fresh_sample_shuffling(shards: str) -> None:
    def labels(step: int, shuffle_buffer: int) -> list[int]:
        dm = make(shards, shuffle_buffer=shuffle_buffer)
        dm.setup("fit")
        dm.set_epoch(3, step=step)
        return read_all(dm.train_dataloader())[0]

    assert labels(0, 0) == labels(5, 0)  # the shard order is the epoch's
    shuffled = labels(0, 8), labels(5, 8)
    assert shuffled[0] != shuffled[1] and sorted(shuffled[0]) == sorted(shuffled[1]) == list(range(24))


class _Recorder(pl.LightningModule):
    """Records the epoch and labels of every training batch, and the labels of every validation batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.trained: list[tuple[int, list[int]]] = []
        self.validated: list[int] = []

    def epoch(self, epoch: int) -> list[int]:
        return [label for e, labels in self.trained if e == epoch for label in labels]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.validated.extend(batch["label"].tolist())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.trained.append((self.current_epoch, batch["label"].tolist()))
        return (self.weight * batch["image"].float().mean()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(tmp_path: Path, **kw: object) -> pl.Trainer:
    kw.setdefault("max_epochs", 2)
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path, **kw)


def test_trainer_epochs_reshuffle_shards_across_worker_restarts(shards: str, tmp_path: Path) -> None:
    dm = make(shards, val=shards, num_workers=2, shuffle_buffer=0)
    model = _Recorder()
    _trainer(tmp_path, enable_checkpointing=False).fit(model, datamodule=dm)
    assert sorted(model.epoch(0)) == sorted(model.epoch(1)) == list(range(24))
    assert model.epoch(0) != model.epoch(1)
    assert sorted(model.validated) == sorted(list(range(24)) * 2)


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended")
def test_a_run_resumed_mid_epoch_trains_on_the_batches_the_uninterrupted_run_did(shards: str, tmp_path: Path) -> None:
    def fit(**kw: object) -> list[tuple[int, list[int]]]:
        model = _Recorder()
        trainer = _trainer(tmp_path, enable_checkpointing="callbacks" in kw, callbacks=kw.pop("callbacks", None))
        # 6 batches of 4 an epoch.
        trainer.fit(model, datamodule=make(shards, resampled=True, samples_per_epoch=24), **kw)
        return model.trained

    every_4 = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    whole = fit(callbacks=[every_4])
    resumed = fit(ckpt_path=tmp_path / "step=4.ckpt")
    # The epoch goes on with the 6 - 4 batches it still owes, those the run that was not stopped
    # trained on (the loader's state is in the checkpoint), and the next epoch is as it was.
    assert [epoch for epoch, _ in whole] == [0] * 6 + [1] * 6
    assert [epoch for epoch, _ in resumed] == [0] * 2 + [1] * 6
    assert resumed == whole[4:]


def test_bad_samples_are_skipped_and_counted(tmp_path: Path) -> None:
    good = write_shards(tmp_path, shards=2, per_shard=4)
    corrupt = sample(100, ext="jpg")
    corrupt["jpg"] = corrupt["jpg"][: len(corrupt["jpg"]) // 2]  # a JPEG cut short
    garbage = {**sample(101), "png": b"not an image at all"}
    no_image = {"__key__": "sample000102", "cls": b"102"}
    mixed = write_shard(tmp_path / "mixed.tar", [sample(8), corrupt, sample(9), garbage, no_image, sample(10)])
    whole = write_shard(tmp_path / "whole.tar", [sample(i) for i in range(11, 15)])
    with tarfile.open(whole) as tar:
        cut = tar.getmembers()[3].offset_data + 10  # inside sample 12's image
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(Path(whole).read_bytes()[:cut])
    for num_workers in (0, 2):
        dm = make([good, str(truncated), mixed], num_workers=num_workers)
        dm.setup("fit")
        labels, skipped, _ = read_all(dm.train_dataloader())
        assert sorted(labels) == list(range(12)) and skipped == 4


def test_images_over_the_pixel_limit_are_refused_before_decoding() -> None:
    transform = ImageTransform(size=(4, 4), channels=3, train=False, max_pixels=100)
    assert (transform(sample(1, size=(10, 10))["png"], random.Random(0))[..., 0] == 1).all()
    with pytest.raises(Image.DecompressionBombError, match="12x10 image has 120 pixels, over the limit of 100"):
        transform(sample(2, size=(12, 10))["png"], random.Random(0))
    # Between 1x and 2x its own limit PIL only warns; the default limit refuses such an image at
    # its header (this one has no pixel data, so a decode would fail differently).
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(Image.DecompressionBombError, match="10000x"):
        ImageTransform(size=(4, 4), channels=3, train=False)(header_only_png(10_000, 10_000), random.Random(0))


def test_max_image_pixels_skips_and_counts_larger_images(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "mixed.tar", [sample(i, size=(10, 10) if i % 2 else (12, 10)) for i in range(8)])
    for num_workers in (0, 2):
        dm = make(shard, num_workers=num_workers, max_image_pixels=100)
        dm.setup("fit")
        labels, skipped, _ = read_all(dm.train_dataloader())
        assert sorted(labels) == [1, 3, 5, 7] and skipped == 4


def _kill_this_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does


def test_a_worker_killed_while_decoding_names_its_shard_and_sample(shards: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    decode = ImageTransform.__call__

    def dies_on_sample_13(self: ImageTransform, data: bytes, rng: random.Random) -> np.ndarray:
        if Image.open(io.BytesIO(data)).getpixel((0, 0))[:2] == (13, 0):  # runs in the forked worker
            _kill_this_process()
        return decode(self, data, rng)

    monkeypatch.setattr(ImageTransform, "__call__", dies_on_sample_13)
    dm = make(shards, num_workers=2, shuffle_buffer=0)
    dm.setup("fit")
    named = r"reading shard \S*train-000004\.tar, decoding sample sample000013\b"
    with pytest.raises(WorkerDiedError, match=named):
        read_all(dm.train_dataloader())


def test_a_worker_stopped_by_sigterm_is_a_stopped_run_not_a_death(shards: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler's stop or `kill` reaches the whole process group, workers included: the run was
    asked to stop, and the out-of-memory advice would send the user the wrong way."""
    decode = ImageTransform.__call__

    def stopped_on_sample_13(self: ImageTransform, data: bytes, rng: random.Random) -> np.ndarray:
        if Image.open(io.BytesIO(data)).getpixel((0, 0))[:2] == (13, 0):
            os.kill(os.getpid(), signal.SIGTERM)
        return decode(self, data, rng)

    monkeypatch.setattr(ImageTransform, "__call__", stopped_on_sample_13)
    dm = make(shards, num_workers=2, shuffle_buffer=0)
    dm.setup("fit")
    with pytest.raises(RunStopped, match=r"^the run was stopped by SIGTERM, which also stopped its DataLoader workers "
                                         r"\(worker \d \(pid \d+\) reading shard \S*train-000004\.tar, decoding sample "
                                         r"sample000013\); resume with --ckpt_path last$") as stopped:
        read_all(dm.train_dataloader())
    assert stopped.value.signum == signal.SIGTERM and exit_code(stopped.value) == 143


@pytest.mark.parametrize("words", ["DataLoader worker (pid {pid}) is killed by signal: Terminated. ",
                                   "DataLoader worker (pid(s) {pid}) exited unexpectedly"])
def test_a_worker_that_noted_a_stop_signal_makes_a_stopped_run_whatever_torch_says(words: str) -> None:
    """torch says "exited unexpectedly" when it notices a death while waiting for a batch (it has
    reaped the worker then): the signal the worker noted in Whereabouts says what happened."""

    whereabouts = workers.Whereabouts(2)
    whereabouts.write(1, "shard-000004.tar", "sample000013", stopped_by=signal.SIGTERM)
    noted = whereabouts.read()
    pid = noted[1].pid  # the writer's: this process here
    stopped = workers._died(RuntimeError(words.format(pid=pid)), noted, {pid})
    assert isinstance(stopped, RunStopped) and stopped.signum == signal.SIGTERM
    assert "reading shard shard-000004.tar, decoding sample sample000013" in str(stopped)
    died = workers._died(RuntimeError(f"DataLoader worker (pid(s) {pid}) exited unexpectedly"),
                      [p._replace(stopped_by=0) for p in noted], {pid})
    assert isinstance(died, WorkerDiedError) and "out-of-memory" in str(died)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resampled_stream_of_empty_tars_stops_naming_them(tmp_path: Path, num_workers: int) -> None:
    """Whole tars without a member: before, the endless draw reopened them forever at `Epoch 0: 0/5`."""
    for index in range(2):
        tarfile.open(tmp_path / f"empty-{index:06d}.tar", "w").close()
    dm = make(str(tmp_path / "empty-{000000..000001}.tar"), num_workers=num_workers, resampled=True,
              samples_per_epoch=8)
    dm.setup("fit")
    with pytest.raises(samples.EmptyShardsError, match=r"every shard this stream draws from is empty \(a tar with no "
                                                      r"members\): \S*empty-00000\d\.tar"):
        next(iter(dm.train_dataloader()))


def test_an_empty_tar_among_good_ones_is_read_past_with_a_warning(shards: str, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty-000000.tar"
    tarfile.open(empty, "w").close()
    dm = make([shards, str(empty)], shard_shuffle=False)
    dm.setup("fit")
    with caplog.at_level(logging.WARNING, logger="mpp"):
        labels, skipped, _ = read_all(dm.train_dataloader())
    assert sorted(labels) == list(range(24)) and skipped == 0  # no sample was lost
    assert f"shard {empty} is an empty tar (no members): it adds no samples" in caplog.messages


def test_a_worker_killed_while_the_main_process_trains_names_its_shard(shards: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch reports a dead worker from its SIGCHLD handler, wherever the main thread is: here
    # in a long "training step" (the sleep), outside the loader.
    open_url = samples.open_url

    def dies_soon_after_opening_shard_4(url: str, **kw: object) -> object:
        if url.endswith("train-000004.tar"):
            threading.Timer(0.5, _kill_this_process).start()
        return open_url(url, **kw)

    monkeypatch.setattr(samples, "open_url", dies_soon_after_opening_shard_4)
    dm = make(shards, num_workers=2, batch_size=2, shuffle_buffer=0, shard_shuffle=False)
    dm.setup("fit")
    with pytest.raises(WorkerDiedError, match=r"reading shard \S*train-000004\.tar"):
        for _ in dm.train_dataloader():
            time.sleep(2)  # the "training step" during which the worker dies


def test_a_stream_with_nothing_readable_fails_instead_of_spinning(tmp_path: Path) -> None:
    broken = tmp_path / "broken-000000.tar"
    broken.write_bytes(b"this is not a tar archive" * 40)  # a file of 0 bytes is an empty shard instead
    dm = make(str(broken), resampled=True, samples_per_epoch=8)
    dm.setup("fit")
    with pytest.raises(RuntimeError, match="in a row were unreadable.*broken-000000.tar"):
        next(iter(dm.train_dataloader()))


def test_an_epoch_with_nothing_readable_stops_the_run_naming_the_shards(tmp_path: Path) -> None:
    """Not resampled, every shard unreadable: without the check, max_steps made Lightning start empty
    epoch after empty epoch, forever."""
    broken = [tmp_path / f"broken-{i:06d}.tar" for i in range(2)]
    for path in broken:
        path.write_bytes(b"this is not a tar archive" * 40)
    dm = make([str(p) for p in broken], val=str(broken[0]))
    with pytest.raises(EmptyEpochError, match=r"data\.train yielded no batch: its 2 shard\(s\) \(.*broken-000000\.tar"):
        _trainer(tmp_path, max_epochs=None, max_steps=5, enable_checkpointing=False).fit(_Recorder(), datamodule=dm)
    dm.setup("validate")
    with pytest.raises(EmptyEpochError, match=r"data\.val yielded no batch"):
        read_all(dm.val_dataloader())


def test_a_worker_s_own_error_is_not_reported_as_a_death(tmp_path: Path) -> None:
    """A worker that raises (here: nothing readable on a resampled stream) and then exits with the
    loader is not a worker killed by the out-of-memory killer."""
    broken = tmp_path / "broken-000000.tar"
    broken.write_bytes(b"garbage" * 100)
    samples.Skips.limit = 50
    try:
        for _ in range(2):
            dm = make(str(broken), num_workers=2, resampled=True, samples_per_epoch=8)
            dm.setup("fit")
            with pytest.raises(RuntimeError) as error:
                read_all(dm.train_dataloader())
            assert not isinstance(error.value, WorkerDiedError), error.value
            assert "in a row were unreadable" in str(error.value)
    finally:
        samples.Skips.limit = 1000


def test_a_worker_error_with_an_exited_worker_is_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race seen 1 run in 8: the error arrives after a worker has exited; it is still the worker's own."""

    own = RuntimeError("Caught RuntimeError in DataLoader worker process 1.\nOriginal Traceback ...")

    def failing() -> Iterator[dict]:
        raise own
        yield {}

    whereabouts = workers.Whereabouts(2)
    whereabouts.write(0, "shard-000000.tar", "")
    monkeypatch.setattr(workers, "_exited", lambda pids: set(pids))  # every worker has exited
    with pytest.raises(RuntimeError) as error:
        list(workers._naming_deaths(failing(), whereabouts))
    assert error.value is own


@pytest.mark.parametrize("name, value", [("image_size", 16), ("channels", 1)])
def test_data_that_does_not_fit_the_encoder_fails_before_training_naming_both_keys(shards: str, tmp_path: Path,
                                                                                  name: str, value: int) -> None:
    from mpp import MaskedPatchPretraining

    model = MaskedPatchPretraining(encoder={"image_size": 8, "patch_size": 4, "channels": 3, "dim": 16, "depth": 1,
                                            "heads": 2, "mlp_dim": 32}, optimizer={"name": "adamw", "lr": 1e-3})
    dm = make(shards, **{"image_size": None, name: value})
    wanted = {"image_size": 8, "channels": 3}[name]
    with pytest.raises(ValueError, match=rf"data\.{name}={value} does not fit the encoder's "
                                         rf"model\.init_args\.encoder\.{name}={wanted}"):
        _trainer(tmp_path, max_steps=1, enable_checkpointing=False).fit(model, datamodule=dm)


def test_unset_image_size_and_channels_follow_the_encoder(shards: str) -> None:
    from mpp.model.vit import ViTConfig

    dm = make(shards, image_size=None)
    dm.setup("fit", rank=0, world_size=1, encoder=ViTConfig(image_size=(12, 8), patch_size=4, channels=1, dim=16,
                                                            depth=1, heads=2, mlp_dim=32))
    assert next(iter(dm.train_dataloader()))["image"].shape[1:] == (1, 12, 8)
    alone = make(shards, image_size=None)
    alone.setup("fit")
    assert next(iter(alone.train_dataloader()))["image"].shape[1:] == (3, 224, 224)


def test_unlabelled_samples_get_minus_one(tmp_path: Path) -> None:
    dm = make(write_shards(tmp_path, shards=1, per_shard=3, labelled=False))
    dm.setup("fit")
    labels, _, _ = read_all(dm.train_dataloader())
    assert labels == [-1, -1, -1]


def test_a_shard_named_twice_is_refused_for_evaluation_and_warned_of_for_training(shards: str,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    # It was read twice, silently: 2,000 validation samples from a 1,000-sample shard.
    folder = Path(shards).parent
    first = str(folder / "train-000000.tar")
    twice = re.escape(f"{first} (2 times)")
    for split, spec in [("val", [first, first]), ("test", str(folder / "train-{000000,000000,000001}.tar")),
                        ("val", [first, f"{folder}/../{folder.name}/train-000000.tar"])]:
        with pytest.raises(ConfigError, match=rf"^data\.{split}: names {twice}: their samples would count that many "
                                              "times in the metrics; name each once$"):
            make(shards, **{split: spec}).setup("validate" if split == "val" else "test")
    with caplog.at_level(logging.WARNING, logger="mpp"):
        make([first, first, str(folder / "train-000001.tar")]).setup("fit")
    assert f"data.train names {first} (2 times): each is read that many times per epoch" in caplog.text


def test_missing_or_empty_shard_specs_fail_naming_them(shards: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "train-{000000..000001}.tar")
    with pytest.raises(ConfigError, match=r"^data\.train: shard .*train-000000.tar .*does not exist"):
        make(missing).setup("fit")
    with pytest.raises(ConfigError, match="^data.train: shard pattern .*nothing-"):
        make(str(tmp_path / "nothing-*.tar")).setup("fit")
    folder = Path(shards).parent
    with pytest.raises(ConfigError, match=re.escape(f"data.train: shard {folder} is a folder, not a tar file: give "
                                                    f"its shards as a pattern, e.g. '{folder}/train-{{000000..000007}}.tar'")):
        make(str(folder)).setup("fit")
    with pytest.raises(ValueError, match="empty"):
        make([]).setup("fit")
    with pytest.raises(ValueError, match="'train'"):
        ShardDataModule(val=shards).setup("fit")
    with pytest.raises(ValueError, match="samples_per_epoch"):
        make(shards, resampled=True)


def test_pipe_urls_need_allow_pipe(shards: str, tmp_path: Path) -> None:
    path = write_shards(tmp_path, shards=1, per_shard=3).replace("{000000..000000}", "000000")
    with pytest.raises(ValueError, match="allow_pipe"):
        make(f"pipe:cat {path}").setup("fit")
    dm = make(f"pipe:cat {path}", allow_pipe=True)
    dm.setup("fit")
    labels, _, _ = read_all(dm.train_dataloader())
    assert sorted(labels) == [0, 1, 2]


def _image(mode: str) -> tuple[Image.Image, str]:
    """A 20x16 image in `mode`, and a format that stores that mode."""
    grey = Image.linear_gradient("L").resize((20, 16))
    images = {
        "1": (grey.convert("1"), "png"), "L": (grey, "png"), "LA": (Image.merge("LA", [grey, grey]), "png"),
        "P": (grey.convert("RGB").convert("P"), "png"), "RGB": (grey.convert("RGB"), "jpg"),
        "RGBA": (Image.merge("RGBA", [grey] * 4), "png"), "CMYK": (grey.convert("CMYK"), "jpg"),
        "I;16": (Image.fromarray(np.asarray(grey).astype(np.uint16) * 257), "png"),
        "I": (Image.fromarray(np.asarray(grey).astype(np.int32) * 257), "tif"),
        "F": (Image.fromarray(np.asarray(grey).astype(np.float32) / 255), "tif"),
    }
    return images[mode]


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F"])
@pytest.mark.parametrize("channels", [1, 3])
def test_every_mode_becomes_uint8_of_the_requested_channels(mode: str, channels: int) -> None:
    image, ext = _image(mode)
    data = encode(image, ext)
    assert Image.open(io.BytesIO(data)).mode == mode
    for train in (True, False):
        out = ImageTransform(size=(8, 6), channels=channels, train=train)(data, random.Random(0))
        assert out.shape == (8, 6, channels) and out.dtype == np.uint8


@pytest.mark.parametrize(("mode", "value", "expected"), [
    ("I;16", 65535, 255), ("I;16", 257 * 100, 100), ("I;16", 0, 0), ("1", 1, 255),
])
def test_bit_depths_scale_to_8_bits(mode: str, value: int, expected: int) -> None:
    data = encode(Image.new(mode, (5, 5), value), "png")
    out = ImageTransform(size=(4, 4), channels=1, train=False)(data, random.Random(0))
    assert (out == expected).all()


def test_alpha_is_composited_on_black() -> None:
    half = Image.new("RGBA", (6, 6), (200, 100, 50, 128))
    out = ImageTransform(size=(4, 4), channels=3, train=False)(encode(half), random.Random(0))
    assert out[0, 0].tolist() == [100, 50, 25]
    clear = Image.new("LA", (6, 6), (255, 0))
    assert (ImageTransform(size=(4, 4), channels=1, train=False)(encode(clear), random.Random(0)) == 0).all()


def test_small_images_are_upscaled() -> None:
    data = sample(7, size=(3, 2))["png"]
    for train in (True, False):
        out = ImageTransform(size=(16, 16), channels=3, train=train)(data, random.Random(0))
        assert out.shape == (16, 16, 3) and (out[..., 0] == 7).all()


def test_eval_is_a_deterministic_centre_crop() -> None:
    # A wide image, red | green | blue: the centre crop of its short side (x 30..50) is green,
    # with room to spare for the resampling filter's reach.
    wide = Image.new("RGB", (80, 20), (0, 255, 0))
    wide.paste((255, 0, 0), (0, 0, 25, 20))
    wide.paste((0, 0, 255), (55, 0, 80, 20))
    transform = ImageTransform(size=(10, 10), channels=3, train=False, crop_fraction=1.0)
    first = transform(encode(wide), random.Random(1))
    assert np.array_equal(first, transform(encode(wide), random.Random(2)))
    assert (first[..., 1] >= 250).all() and (first[..., 0] <= 5).all() and (first[..., 2] <= 5).all()


def test_training_crops_vary_and_follow_the_seed() -> None:
    data = encode(Image.linear_gradient("L").convert("RGB"), "jpg")
    transform = ImageTransform(size=(16, 16), channels=3, train=True)
    crops = [transform(data, random.Random(seed)) for seed in (0, 0, 1)]
    assert np.array_equal(crops[0], crops[1]) and not np.array_equal(crops[0], crops[2])


def test_reduced_jpeg_decoding_keeps_the_crop_in_place() -> None:
    # Quadrants of colour, 256 px: an 8 px output lets libjpeg decode at 1/8 scale.
    image = Image.new("RGB", (256, 192), (255, 0, 0))
    image.paste((0, 0, 255), (128, 0, 256, 96))
    image.paste((0, 255, 0), (0, 96, 128, 192))
    jpeg = encode(image, "jpg", quality=95)
    lossless = encode(Image.open(io.BytesIO(jpeg)), "png")  # the same pixels, decoded in full
    for train in (False, True):
        transform = ImageTransform(size=(8, 12), channels=3, train=train, scale=(0.5, 1.0))
        drafted, full = transform(jpeg, random.Random(3)), transform(lossless, random.Random(3))
        assert np.abs(drafted.astype(int) - full.astype(int)).mean() < 6


@pytest.mark.parametrize("num_workers", [1, 2])
def test_folder_written_by_the_shard_writer_reads_back_exactly_once(tmp_path: Path, num_workers: int) -> None:
    from mpp.shards.sources import image_folder
    from mpp.shards.writer import WriteOptions, write_shards

    # 3 classes x 7 images; each image one flat grey level that identifies it.
    root = tmp_path / "images"
    expected = []
    for label, name in enumerate(("cat", "dog", "owl")):
        (root / name).mkdir(parents=True)
        for index in range(7):
            level = 10 * (7 * label + index) + 5
            Image.new("L", (12, 10), level).save(root / name / f"{index}.png")
            expected.append((level, label))
    sidecar, _ = write_shards(image_folder(root), tmp_path / "shards", "train",
                              WriteOptions(shard_samples=4, progress=False, seed=3))
    assert len(sidecar["shards"]) == 6 and sidecar["classes"] == ["cat", "dog", "owl"]

    dm = make(str(tmp_path / "shards" / "train-{000000..000005}.tar"), num_workers=num_workers, channels=1)
    dm.setup("fit")
    seen = []
    for batch in dm.train_dataloader():
        for image, label in zip(batch["image"], batch["label"].tolist()):
            assert (image == image.flatten()[0]).all()  # a flat image stays flat through crop and flip
            seen.append((int(image.flatten()[0]), label))
    assert sorted(seen) == sorted(expected)
