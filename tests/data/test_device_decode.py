"""decode="device": the workers send JPEGs encoded, with the CPU path's boxes and flips, and finish
everything else; on the device (here the CPU, through torchvision) the batch becomes the CPU path's
images, PNGs mixed in, past JPEGs that fail, in a real fit. The tests that decode need torchvision
(marked `bench`, run with `make test-bench`); the others run everywhere."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from shardkit import encode, write_shard

from benchmarks.kit import photo, write_photo_shards
from mpp.data import device_decode, transforms
from mpp.data import module as data_module
from mpp.data.module import ShardDataModule
from mpp.data.transforms import EncodedJpeg, ImageTransform
from mpp.errors import ConfigError

CPU = torch.device("cpu")


def jpeg(index: int, side: int = 48) -> bytes:
    return encode(photo(np.random.default_rng(index), side), "jpg", quality=90)


def make(train: str, **kw: object) -> ShardDataModule:
    config = {"val": train, "batch_size": 6, "num_workers": 0, "image_size": 32, "shuffle_buffer": 8, **kw}
    return ShardDataModule(train=train, **config)


def batches(dm: ShardDataModule, *, train: bool) -> list[dict]:
    dm.setup("fit")
    return list(dm.train_dataloader() if train else dm.val_dataloader())


@pytest.fixture
def no_torchvision_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's side of decode="device" needs no torchvision: let the module be built without it."""
    monkeypatch.setattr(data_module, "torchvision_io", lambda: None)


def mixed_samples() -> list[dict]:
    """Samples 0..11, labelled with their index: JPEG photos (4 in grey), and every third one that the
    workers decode themselves: PNGs, and 8 a CMYK JPEG."""
    records = []
    for index in range(12):
        image = photo(np.random.default_rng(index), 40).convert({4: "L", 8: "CMYK"}.get(index, "RGB"))
        ext = "png" if index % 3 == 2 and index != 8 else "jpg"
        records.append({"__key__": f"sample{index:06d}", ext: encode(image, ext), "cls": str(index).encode()})
    return records


def mixed_shard(path: Path) -> str:
    return write_shard(path, mixed_samples())


@pytest.mark.parametrize("train", [True, False])
def test_the_worker_draws_the_cpu_path_s_boxes_and_flips_and_sends_the_bytes(train: bool) -> None:
    transform = ImageTransform(size=(24, 32), channels=3, train=train, scale=(0.2, 1.0))
    on_cpu, on_device = random.Random(7), random.Random(7)
    flips = set()
    for index in range(16):
        data = jpeg(index)
        decoded = transform(data, on_cpu)
        encoded = transform.for_device(data, on_device)
        assert isinstance(encoded, EncodedJpeg) and encoded.data is data
        # The box and flip drawn give the CPU path's image, and leave the rng where the CPU path leaves it.
        assert np.array_equal(transform.finish(encoded.data, encoded.box, encoded.flip), decoded)
        assert on_cpu.getstate() == on_device.getstate()
        flips.add(encoded.flip)
    assert flips == ({False, True} if train else {False})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_batches_carry_the_jpegs_in_place_and_other_images_finished(
    tmp_path: Path, no_torchvision_check: None, num_workers: int
) -> None:
    shard = mixed_shard(tmp_path / "mixed-000000.tar")
    on_cpu = batches(make(shard, num_workers=num_workers), train=True)
    dm = make(shard, num_workers=num_workers, decode="device")
    on_device = batches(dm, train=True)
    assert [b["label"].tolist() for b in on_device] == [b["label"].tolist() for b in on_cpu]
    samples = mixed_samples()
    for cpu, device in zip(on_cpu, on_device):
        labels, jpegs = device["label"].tolist(), device["jpegs"]
        at = [crop.at for crop in jpegs.crops]
        assert [labels[i] for i in at] == [label for label in labels if label % 3 != 2]  # the JPEGs, in place
        finished = [i for i in range(len(labels)) if i not in at]
        assert torch.equal(device["image"], cpu["image"][finished])  # as the CPU path made them
        offsets = np.cumsum([0] + [crop.size for crop in jpegs.crops])
        for crop, start, end in zip(jpegs.crops, offsets, offsets[1:]):
            data = jpegs.data[start:end].numpy().tobytes()
            assert data == samples[labels[crop.at]]["jpg"] and f"sample{labels[crop.at]:06d} of " in crop.name
            finished_here = dm.train_transform.finish(data, crop.box, crop.flip)
            assert torch.equal(torch.from_numpy(finished_here.copy()).permute(2, 0, 1), cpu["image"][crop.at])


def test_decode_device_without_torchvision_is_a_config_error_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = mixed_shard(tmp_path / "mixed-000000.tar")
    monkeypatch.setitem(sys.modules, "torchvision", None)  # an import of it fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    with pytest.raises(ConfigError, match=r"data\.decode=device needs torchvision .*pip install 'mpp\[gpu-decode\]'"):
        make(shard, decode="device")
    with pytest.raises(ValueError, match="decode='gpu' is invalid; it must be \"cpu\" or \"device\""):
        make(shard, decode="gpu")
    make(shard)  # the default needs no torchvision


def test_on_a_gpu_the_jpegs_are_decoded_on_a_stream_of_their_own_then_handed_to_the_caller_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchvision's CUDA decoder writes, on a private stream, into memory handed out on the current one,
    which the training stream's queued kernels may still read: a device-side assert in a compiled step on an
    H200. The decode runs under a stream with no other work, is waited for, and its outputs are then marked
    as used by the caller's stream (CUDA faked: what is checked is the order of the calls)."""
    calls: list[tuple] = []

    class Stream:
        def __init__(self, name: str = "own", device: object = None) -> None:
            self.name = name

        def synchronize(self) -> None:
            calls.append(("synchronize", self.name))

    current = [Stream("caller")]

    @contextlib.contextmanager
    def under(stream: Stream) -> Iterator[None]:
        current.append(stream)
        yield
        current.pop()

    def decode_jpeg(data: list[torch.Tensor], mode: str, device: torch.device) -> list[torch.Tensor]:
        calls.append(("decode", current[-1].name, len(data), mode, device.type))
        return [torch.zeros(3, 2, 2, dtype=torch.uint8) for _ in data]

    io = SimpleNamespace(decode_jpeg=decode_jpeg, ImageReadMode=SimpleNamespace(RGB="RGB", GRAY="GRAY"))
    monkeypatch.setattr(device_decode, "torchvision_io", lambda: io)
    monkeypatch.setattr(device_decode, "_decoder_streams", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", under)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: calls.append(("record", stream.name)))
    jpegs = [torch.zeros(5, dtype=torch.uint8)] * 2
    for _ in range(2):  # the second call takes the same stream
        assert len(device_decode._decode(jpegs, 3, torch.device("cuda"))) == 2
    once = [("decode", "own", 2, "RGB", "cuda"), ("synchronize", "own"), ("record", "caller"), ("record", "caller")]
    assert calls == once + once and len(device_decode._decoder_streams) == 1 and current[-1].name == "caller"
    calls.clear()
    assert device_decode._decode(jpegs, 1, torch.device("cpu"))[0].shape == (3, 2, 2)  # the CPU: no stream at all
    assert calls == [("decode", "caller", 2, "GRAY", "cpu")]


# What follows decodes, with torchvision on the CPU.


def on_the_device(dm: ShardDataModule, batch: dict) -> dict:
    """What the model receives: the batch as Lightning's transfer hook leaves it."""
    return dm.transfer_batch_to_device(batch, CPU, 0)


def differences(first: list[dict], second: list[dict]) -> tuple[int, float]:
    """Max and mean absolute difference of two lists of batches of the same samples."""
    assert [b["label"].tolist() for b in first] == [b["label"].tolist() for b in second]
    one, other = (torch.cat([b["image"] for b in batches]).int() for batches in (first, second))
    return int((one - other).abs().max()), float((one - other).abs().float().mean())


def assert_alike(first: list[dict], second: list[dict]) -> None:
    """Images of the CPU path and the device path (torchvision on the CPU). Measured: max 0 and mean 0,
    the same libjpeg-turbo decode and PIL's integer resampling, passes in Pillow 13's order; the bounds
    leave room for another libjpeg-turbo build or an older Pillow's order (a level, here and there)."""
    largest, mean = differences(first, second)
    assert largest <= 1 and mean <= 0.01, (largest, mean)


@pytest.fixture
def full_scale_jpegs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path's JPEG draft at full scale only (still in the grey mode asked for): the device has no
    reduced-scale decode, so the two are compared where neither reduces."""
    draft = transforms._draft
    monkeypatch.setattr(transforms, "_draft", lambda image, box, size, channels: draft(image, box, (1 << 20,) * 2,
                                                                                          channels))


@pytest.mark.bench
@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize(("side", "image_size"), [(48, 32), (120, 24)])
def test_the_device_path_gives_the_cpu_path_s_images(tmp_path: Path, full_scale_jpegs: None, channels: int,
                                                     train: bool, side: int, image_size: int) -> None:
    """Up- and downscaled crops, flipped or not, RGB and grey."""
    pytest.importorskip("torchvision")
    shards = write_photo_shards(tmp_path, images=36, per_shard=12, side=side)
    dm = make(shards, image_size=image_size, channels=channels, decode="device")
    on_cpu = batches(make(shards, image_size=image_size, channels=channels), train=train)
    on_device = [on_the_device(dm, batch) for batch in batches(dm, train=train)]
    assert on_device[0]["image"].shape[1:] == (channels, image_size, image_size)
    assert_alike(on_cpu, on_device)


@pytest.mark.bench
def test_a_batch_mixes_images_finished_in_the_worker_with_jpegs_decoded_on_the_device(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    shard = mixed_shard(tmp_path / "mixed-000000.tar")
    dm = make(shard, decode="device", batch_size=12)
    on_device = [on_the_device(dm, batch) for batch in batches(dm, train=True)]
    on_cpu = batches(make(shard, batch_size=12), train=True)
    assert len(on_device) == 1 and set(on_device[0]) == {"image", "label", "skipped"}
    assert_alike(on_cpu, on_device)


def jpeg_with_broken_data(index: int) -> bytes:
    """A JPEG whose entropy-coded data is noise: PIL decodes it (with a warning), torchvision refuses."""
    good = jpeg(index)
    start = good.index(b"\xff\xda") + 14  # past the scan header
    noise = np.random.default_rng(index).integers(0, 256, len(good) - start - 2, dtype=np.uint8).tobytes()
    return good[:start] + noise + b"\xff\xd9"


@pytest.mark.bench
def test_a_jpeg_the_device_cannot_decode_is_decoded_on_the_cpu_or_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torchvision")
    records = [{"__key__": f"sample{index:06d}", "jpg": jpeg(index), "cls": str(index).encode()} for index in range(6)]
    records[2]["jpg"] = jpeg_with_broken_data(2)
    records[4]["jpg"] = records[4]["jpg"][: len(records[4]["jpg"]) // 2]  # cut short: its header still reads
    shard = write_shard(tmp_path / "broken-000000.tar", records)
    monkeypatch.setattr(device_decode, "_warned", False)
    dm = make(shard, decode="device")
    raw = batches(dm, train=False)  # evaluation: no flips, so the streams stay in step past a failure
    assert [crop.at for crop in raw[0]["jpegs"].crops] == list(range(6))  # all six reached the device
    with caplog.at_level(logging.DEBUG, logger="mpp.data.device_decode"):
        on_device = [on_the_device(dm, batch) for batch in raw]
    on_cpu = batches(make(shard), train=False)
    assert [b["label"].tolist() for b in on_device] == [[0, 1, 2, 3, 5]] and int(on_device[0]["skipped"]) == 1
    assert int(on_cpu[0]["skipped"]) == 1
    assert_alike(on_cpu, on_device)
    assert torch.equal(on_device[0]["image"][2], on_cpu[0]["image"][2])  # the CPU path's own image
    assert "sample000002 of " in caplog.messages[0] and "decoded on the CPU instead" in caplog.messages[0]
    assert "sample000004 of " in caplog.messages[1] and "the CPU path failed too" in caplog.messages[1]


class _Batches(pl.Callback):
    """Records the shape and dtype of every training batch the module received."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: dict,
                             batch_idx: int) -> None:
        self.seen.append((tuple(batch["image"].shape), batch["image"].dtype))


def fit(model: pl.LightningModule, dm: ShardDataModule, tmp_path: Path, steps: int) -> list:
    recorder = _Batches()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         limit_val_batches=0, default_root_dir=tmp_path, callbacks=[recorder])
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == steps
    return recorder.seen


DEMO = {"image_size": 32, "patch_size": 8, "channels": 3, "dim": 128, "depth": 4, "heads": 4, "mlp_dim": 512}


@pytest.mark.bench
def test_a_fit_with_decode_device_trains_the_demo_model(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    from mpp import MaskedPatchPretraining

    shards = write_photo_shards(tmp_path / "shards", images=48, per_shard=12, side=48)
    model = MaskedPatchPretraining(encoder=DEMO, optimizer={"name": "adamw", "lr": 1e-3})
    dm = make(shards, image_size=None, batch_size=8, num_workers=1, decode="device")
    seen = fit(model, dm, tmp_path, steps=4)
    assert seen == [((8, 3, 32, 32), torch.uint8)] * 4


@pytest.mark.bench
def test_the_classifier_still_checks_labels_before_the_transfer(tmp_path: Path) -> None:
    """ImageClassifier's on_before_batch_transfer runs first, on the host, as with decode="cpu"."""
    pytest.importorskip("torchvision")
    from mpp import ImageClassifier

    def shards(labelled: bool) -> str:
        records = [{"__key__": f"sample{i:06d}", "jpg": jpeg(i), **({"cls": str(i % 2).encode()} if labelled else {})}
                   for i in range(8)]
        return write_shard(tmp_path / f"{'labelled' if labelled else 'unlabelled'}-000000.tar", records)

    def classifier() -> ImageClassifier:
        return ImageClassifier(encoder={**DEMO, "dim": 32, "depth": 1, "heads": 2, "mlp_dim": 64}, num_classes=2,
                               optimizer={"name": "sgd", "lr": 0.01})

    assert fit(classifier(), make(shards(True), image_size=None, batch_size=4, decode="device"), tmp_path, 2) == [
        ((4, 3, 32, 32), torch.uint8)] * 2
    with pytest.raises(ValueError, match="unlabelled samples"):
        fit(classifier(), make(shards(False), image_size=None, batch_size=4, decode="device"), tmp_path, 2)
