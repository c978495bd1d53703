"""Test helpers: tiny shards whose samples can be recognised after cropping and resizing.

Sample i is a flat colour that encodes i (red = i % 256, green = i // 256) with label i,
so a batch says which samples it holds and that each image still sits with its label.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
import webdataset
from PIL import Image

from mpp.shards.format import shard_name, shard_pattern


def colour(index: int) -> tuple[int, int, int]:
    return (index % 256, index // 256, 200)


def encode(image: Image.Image, ext: str = "png", **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format={"jpg": "JPEG", "tif": "TIFF"}.get(ext, ext.upper()), **params)
    return buffer.getvalue()


def sample(index: int, *, ext: str = "png", labelled: bool = True, size: tuple[int, int] = (12, 10)) -> dict:
    """One sample dict for webdataset.TarWriter."""
    record = {"__key__": f"sample{index:06d}", ext: encode(Image.new("RGB", size, colour(index)), ext)}
    if labelled:
        record["cls"] = str(index).encode()
    return record


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height RGB pixels, with no pixel data: opens, never decodes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def write_shard(path: Path, samples: Iterable[dict]) -> str:
    with webdataset.TarWriter(str(path)) as sink:
        for record in samples:
            sink.write(record)
    return str(path)


def write_shards(folder: Path, *, shards: int, per_shard: int, prefix: str = "train", **kw: object) -> str:
    """Write `shards` shards of `per_shard` samples numbered 0.. in order; returns their brace pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        indices = range(s * per_shard, (s + 1) * per_shard)
        write_shard(folder / shard_name(prefix, s), (sample(i, **kw) for i in indices))
    return str(folder / shard_pattern(prefix, shards))


def decode_index(image: torch.Tensor) -> int:
    """(3, H, W) uint8 flat image -> the sample index its colour encodes."""
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    assert (image == image[:, :1, :1]).all(), "a flat colour should stay flat through crop and resize"
    return int(image[0, 0, 0]) + 256 * int(image[1, 0, 0])


def read_all(loader: Iterable[dict]) -> tuple[list[int], int, int]:
    """Iterate a loader -> (labels in order, total skipped, number of batches), checking pairing."""
    labels: list[int] = []
    skipped = batches = 0
    for batch in loader:
        assert batch["image"].dtype == torch.uint8 and batch["label"].dtype == torch.int64
        assert batch["skipped"].dtype == torch.int64 and batch["skipped"].ndim == 0
        for image, label in zip(batch["image"], batch["label"].tolist()):
            if label >= 0 and image.shape[0] == 3:
                assert decode_index(image) == label
        labels.extend(batch["label"].tolist())
        skipped += int(batch["skipped"])
        batches += 1
    return labels, skipped, batches
