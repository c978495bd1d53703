"""A worker's samples -> decoded, augmented examples -> batches, and the types of those batches.

Each sample's image is decoded, cropped, resized and flipped (mpp.data.transforms; with
decode="device" a JPEG stays encoded, with its crop box and flip, for mpp.data.device_decode);
a sample that cannot be is dropped and counted in the next batch's "skipped". Batches are
collated in the worker, each with the worker's resume point as it was completed (mpp.data.resume),
and, for the predict split, the key and shard of each of its samples.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypedDict

import numpy as np
import torch
from torch import Tensor

from mpp.data.resume import ResumePoint
from mpp.data.samples import BAD_INPUT, Coordinate, Sample, Skips
from mpp.data.transforms import Box, EncodedJpeg
from mpp.data.workers import Trail
from mpp.shards.images import IMAGE_EXTENSIONS

Example = np.ndarray | EncodedJpeg  # a decoded (H, W, C) image, or a JPEG the device decodes


class Batch(TypedDict):
    """What a training or evaluation step receives, on its device.

    image:   uint8 (B, C, H, W), raw pixels (the model normalises them itself)
    label:   int64 (B,), -1 for samples without a `.cls` member
    skipped: int64 (), samples dropped since the worker's previous batch (undecodable image,
             one over max_image_pixels, no image member, a tar that broke off: one each);
             summed over batches, the total.
    In evaluation on several ranks, B is 0 for the batches a rank runs while it waits, in step,
    for the ranks that still have samples (mpp.data.loader); modules log nothing for them.
    """

    image: Tensor
    label: Tensor
    skipped: Tensor


class StreamBatch(Batch, total=False):
    """A batch as the loader yields it, before it moves to the device (ShardDataModule.transfer_batch_to_device).

    position: the worker's ResumePoint as the batch was completed; noted for the next checkpoint
              and dropped (absent from the empty batches of a rank in step with others).
    jpegs:    decode="device": the samples left encoded; "image" then holds only the others (F <= B),
              "label" every sample's, in the stream's order.

    key:      the predict split's only: each sample's key in its shard (the tar members' shared name).
    shard:    the predict split's only: int64 (B,), the index of each sample's shard among the split's URLs.
    """

    position: ResumePoint
    jpegs: Jpegs
    key: list[str]
    shard: Tensor


class Crop(NamedTuple):
    """One encoded JPEG of a batch: where it goes, its length in Jpegs.data, what to cut from it."""

    at: int  # its place among the batch's samples
    size: int
    # The crop box, field by field: a DataLoader hands plain tuples on as lists.
    left: float
    top: float
    right: float
    bottom: float
    flip: bool
    name: str  # "sample <key> of <shard>", for messages

    @property
    def box(self) -> Box:
        return (self.left, self.top, self.right, self.bottom)


class Jpegs(NamedTuple):
    """A batch's encoded JPEGs: their bytes end to end, uint8 (N,), and one Crop each (plain Python
    values, which no precision plugin converts)."""

    data: Tensor
    crops: list[Crop]


def decoded(
    samples: Iterator[tuple[Coordinate, Sample]],
    transform: Callable[[bytes, random.Random], Example],
    rng: random.Random,
    skips: Skips,
    trail: Trail,
) -> Iterator[tuple[Example, int, tuple[str, str]]]:
    """Samples -> (image (H, W, C) uint8 or an encoded JPEG, label or -1, (key, shard URL)); bad samples are
    counted and dropped."""
    for _, sample in samples:
        trail.decoding(sample["__key__"], sample["__url__"])
        try:
            extension = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
            if extension is None:
                members = sorted(k for k in sample if not k.startswith("__"))
                raise ValueError(f"no image member (.png, .jpg, ...); it has {members}")
            label = int(sample["cls"]) if "cls" in sample else -1
            image = transform(sample[extension], rng)
            if isinstance(image, EncodedJpeg):  # named for the device's messages
                image = image._replace(name=f"sample {sample['__key__']} of {sample['__url__']}")
        except BAD_INPUT as error:
            skips.add(f"sample {sample['__key__']} of {sample['__url__']}", error)
            continue
        skips.streak = 0
        yield image, label, (sample["__key__"], sample["__url__"])


def batches(
    examples: Iterator[tuple[Example, int, tuple[str, str]]],
    batch_size: int,
    skips: Skips,
    shape: tuple[int, int, int],
    where: Callable[[], ResumePoint],
    *,
    shards: Sequence[str] | None = None,
) -> Iterator[StreamBatch]:
    """Collate into batches; each is held back until the next fills, so skips after the last still count.

    Each batch carries, under "position", the worker's ResumePoint as the batch was completed, and
    given the split's URLs, `shards`, its samples' "key" and "shard" (their URL's index in `shards`).
    A worker with skips but no sample to batch yields a batch of no images, of (C, H, W) `shape`,
    to carry the count; ShardLoader folds it into another batch, so no training step sees it.
    """
    index = None if shards is None else {url: at for at, url in enumerate(shards)}
    held: StreamBatch | None = None
    images: list[Example] = []
    labels: list[int] = []
    names: list[tuple[str, int]] = []
    for image, label, (key, url) in examples:
        images.append(image)
        labels.append(label)
        if index is not None:
            names.append((key, index[url]))
        if len(images) == batch_size:
            if held is not None:
                yield held
            held = _collate(images, labels, skips.take(), shape, where(), names if index is not None else None)
            images, labels, names = [], [], []
    if images:
        if held is not None:
            yield held
        held = _collate(images, labels, skips.take(), shape, where(), names if index is not None else None)
    if held is None and skips.count:
        held = _collate([], [], 0, shape, where())
    if held is not None:
        held["skipped"] += skips.take()
        yield held


def _collate(
    examples: list[Example],
    labels: list[int],
    skipped: int,
    shape: tuple[int, int, int],
    position: ResumePoint,
    names: list[tuple[str, int]] | None = None,
) -> StreamBatch:
    """(H, W, C) arrays of (C, H, W) `shape` -> a batch; one strided copy per image (numpy's is twice as
    fast as torch.stack's). Encoded JPEGs go under "jpegs", their labels in place among the others';
    `names`, each sample's (key, shard index), under "key" and "shard"."""
    pixels = [example for example in examples if isinstance(example, np.ndarray)]
    images = np.empty((len(pixels), *shape), dtype=np.uint8)
    for slot, hwc in zip(images, pixels):
        slot[...] = hwc.transpose(2, 0, 1)
    batch: StreamBatch = {
        "image": torch.from_numpy(images),
        "label": torch.tensor(labels, dtype=torch.int64),
        "skipped": torch.tensor(skipped, dtype=torch.int64),
        "position": position,
    }
    if len(pixels) < len(examples):
        batch["jpegs"] = _pack_jpegs(examples)
    if names is not None:
        batch["key"] = [key for key, _ in names]
        batch["shard"] = torch.tensor([shard for _, shard in names], dtype=torch.int64)
    return batch


def _pack_jpegs(examples: Sequence[object]) -> Jpegs:
    """The encoded JPEGs among a batch's examples -> Jpegs."""
    jpegs = [(at, example) for at, example in enumerate(examples) if isinstance(example, EncodedJpeg)]
    data = bytearray().join(jpeg.data for _, jpeg in jpegs)
    crops = [Crop(at, len(jpeg.data), *jpeg.box, jpeg.flip, jpeg.name) for at, jpeg in jpegs]
    return Jpegs(torch.frombuffer(data, dtype=torch.uint8), crops)


def empty_batch(shape: tuple[int, int, int]) -> Batch:
    """A batch of no samples of (C, H, W) `shape`: what a rank runs while it waits for the others."""
    return {
        "image": torch.empty((0, *shape), dtype=torch.uint8),
        "label": torch.empty((0,), dtype=torch.int64),
        "skipped": torch.zeros((), dtype=torch.int64),
    }
