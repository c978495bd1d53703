"""Write image sets as WebDataset tar shards with a JSON sidecar, optionally with a seeded held-out set.

Kept over webdataset's ShardWriter: its shards pass the byte limit (130 KiB at 20 KiB); an interrupted one looks whole.

webdataset.ShardWriter checks its maxsize against the member bytes written so far, before the
next sample, so a shard passes it by headers, padding and a sample (tests/shards/test_shards.py's
shard_bytes test fails); closing it on an exception ends the partial shard as a sound tar under
its final name (the interrupted-run test fails), and with nothing to write it leaves an empty
shard. Its TarWriter, given mtime=0, mode 0o644 and no user or group, writes the bytes tarfile
writes here but with each sample's members in name order; importing webdataset loads torch,
which mpp.shards does without.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from mpp.shards.format import EOF_MARKER, FORMAT, PREFIX, ShardError, is_shard_of, shard_name, sidecar_name
from mpp.shards.images import is_16bit, to_8bit
from mpp.shards.sources import Source


@dataclass(frozen=True)
class WriteOptions:
    """How `write_shards` selects, orders, encodes and splits samples."""

    shard_samples: int = 1000
    shard_bytes: int | None = None  # a sample bigger than this gets a shard of its own
    resize_short: int | None = None
    image_format: str = "png"
    quality: int = 95  # JPEG only
    limit: int | None = None  # the first N images, before shuffling
    seed: int | None = None  # shuffle the sample order when set
    overwrite: bool = False
    skip_bad: bool = False  # skip undecodable source images instead of stopping
    progress: bool = True


def storable(image: Image.Image, image_format: str) -> Image.Image:
    """Convert to the nearest of L / LA / RGB / RGBA the format can hold; grey stays grey."""
    if is_16bit(image.mode) or image.mode == "F":  # 16-bit scans, float images: 8 bits as the loader makes them
        image = to_8bit(image)
    grey = image.mode in ("1", "L", "LA", "La")
    alpha = image.mode.endswith(("A", "a")) or (image.mode == "P" and "transparency" in image.info)
    target = ("L" if grey else "RGB") + ("A" if alpha and image_format == "png" else "")
    return image if image.mode == target else image.convert(target)


def encode_image(
    image: Image.Image, image_format: str = "png", quality: int = 95, resize_short: int | None = None
) -> bytes:
    """PNG or JPEG bytes of `image`, optionally resized so its short side is `resize_short`."""
    image = storable(image, image_format)
    if resize_short and min(image.size) != resize_short:
        scale = resize_short / min(image.size)
        width, height = (max(resize_short, round(side * scale)) for side in image.size)
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    if image_format == "png":
        image.save(buffer, "PNG")  # PIL writes no timestamps: same pixels, same bytes
    else:
        image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _member_bytes(size: int) -> int:
    return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _tar_bytes(members: int) -> int:
    """File size of a tar whose members take `members` bytes: end marker, record padding."""
    return -(-(members + len(EOF_MARKER)) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class _ShardWriter:
    """Rolls over to a new `<prefix>-NNNNNN.tar` when a count or byte limit would be passed."""

    def __init__(self, out_dir: Path, prefix: str, options: WriteOptions) -> None:
        self.out_dir, self.prefix, self.options = out_dir, prefix, options
        self.shards: list[dict[str, Any]] = []
        self.path = out_dir / shard_name(prefix, 0)
        self.tar: tarfile.TarFile | None = None
        self.count = self.used = 0

    def add(self, members: list[tuple[str, bytes]]) -> None:
        """Write one sample's members, in a new shard if this one would pass a limit."""
        size = sum(_member_bytes(len(data)) for _, data in members)
        limit = self.options.shard_bytes
        if self.tar is not None and (
            self.count >= self.options.shard_samples or (limit and _tar_bytes(self.used + size) > limit)
        ):
            self.finish()
        if self.tar is None:
            self.path = self.out_dir / shard_name(self.prefix, len(self.shards))
            # Written under a temporary name: an interrupted run leaves no complete-looking shard.
            self.tar = tarfile.open(self.temporary, "w", format=tarfile.USTAR_FORMAT)
            self.count = self.used = 0
        for name, data in members:
            # Fixed metadata so that rebuilding gives byte-identical shards.
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self.tar.addfile(info, io.BytesIO(data))
        self.count += 1
        self.used += size

    @property
    def temporary(self) -> Path:
        """Where the shard in hand is written until it is complete."""
        return self.path.with_name(self.path.name + ".tmp")

    def finish(self) -> None:
        """Close the shard in hand, give it its name and record it."""
        if self.tar is None:
            return
        self.tar.close()
        self.tar = None
        os.replace(self.temporary, self.path)
        self.shards.append({"name": self.path.name, "samples": self.count, "bytes": self.path.stat().st_size})

    def abort(self) -> None:
        """Drop the shard in hand: no partial shard is left."""
        if self.tar is not None:
            self.tar.close()
            self.tar = None
            self.temporary.unlink(missing_ok=True)


def _existing_outputs(out_dir: Path, prefix: str) -> list[Path]:
    names = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    shards = [out_dir / name for name in names if is_shard_of(name, prefix)]
    return shards + [p for p in [out_dir / sidecar_name(prefix)] if p.exists()]


MAX_PREFIX = 80  # a member is `<prefix>_<index>.<ext>`: with room for the index it fits ustar's 100 bytes


def _check_prefix(prefix: str) -> None:
    if not re.fullmatch(PREFIX, prefix):
        raise ShardError(f"prefix {prefix!r}: use letters, digits, '_' and '-' (keys must have no '.')")
    if len(prefix) > MAX_PREFIX:
        raise ShardError(
            f"prefix of {len(prefix)} characters: at most {MAX_PREFIX}, so that member names fit a tar header"
        )


def _check_free(out_dir: Path, prefix: str, options: WriteOptions) -> list[Path]:
    """The outputs of an earlier run under `prefix`; an error if there are some and overwriting is off."""
    old = _existing_outputs(out_dir, prefix)
    if old and not options.overwrite:
        raise ShardError(f"{old[0]} already exists; pass --overwrite to replace the {prefix} shards")
    return old


def write_shards(
    source: Source,
    out_dir: Path,
    prefix: str,
    options: WriteOptions = WriteOptions(),
    indices: Sequence[int] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Write `<prefix>-NNNNNN.tar` shards and `<prefix>.json`; return the sidecar and skipped images.

    `indices` are the source images to write (default: all), of which `options.limit` takes the first.
    """
    _check_prefix(prefix)
    if options.image_format not in ("png", "jpg"):
        raise ShardError(f"image format {options.image_format!r}: choose png or jpg")
    if options.shard_samples < 1 or (options.shard_bytes is not None and options.shard_bytes < 1):
        raise ShardError("shard limits must be positive")
    if not 1 <= options.quality <= 100:
        raise ShardError(f"JPEG quality {options.quality}: choose 1..100")
    old = _check_free(out_dir, prefix, options)
    out_dir.mkdir(parents=True, exist_ok=True)
    order = list(range(len(source)) if indices is None else indices)[: options.limit]
    if options.seed is not None:
        random.Random(options.seed).shuffle(order)
    width = max(7, len(str(len(source) - 1)))
    writer, skipped = _ShardWriter(out_dir, prefix, options), []
    try:
        for index in tqdm(order, desc=prefix, unit="img", disable=not options.progress):
            try:
                image = source.load(index)
            except ShardError as error:
                if not options.skip_bad:
                    raise ShardError(f"{error}; pass --skip-bad to skip such images and list them") from None
                skipped.append(str(error))
                continue
            key = f"{prefix}_{index:0{width}d}"  # the source index, so shuffled keys still trace back
            try:
                data = encode_image(image, options.image_format, options.quality, options.resize_short)
            except (OSError, ValueError) as error:
                raise ShardError(f"{source.origin(index)}: cannot encode as {options.image_format} ({error})") from None
            members = [(f"{key}.{options.image_format}", data)]
            if source.labels[index] is not None:
                members.append((f"{key}.cls", str(source.labels[index]).encode("ascii")))
            writer.add(members)
        writer.finish()
        if not writer.shards:
            raise ShardError(
                f"nothing written for {prefix}: the source is empty, the limit is 0 or every image was skipped"
            )
    except BaseException:
        writer.abort()
        raise
    sidecar = {
        "format": FORMAT,
        "prefix": prefix,
        "shards": writer.shards,
        "samples": sum(s["samples"] for s in writer.shards),
        "classes": list(source.classes) if source.classes is not None else None,
        "image_format": options.image_format,
    }
    sidecar_path = out_dir / sidecar_name(prefix)
    temporary = sidecar_path.with_name(sidecar_path.name + ".tmp")
    temporary.write_text(json.dumps(sidecar, indent=1) + "\n")
    os.replace(temporary, sidecar_path)
    # Shards left from an earlier, larger run would silently join a glob or brace pattern.
    written = {s["name"] for s in writer.shards}
    for path in old:
        if is_shard_of(path.name, prefix) and path.name not in written:
            path.unlink()
    return sidecar, skipped


def holdout_split(indices: Sequence[int], holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """(kept, held out): a seeded random choice of `holdout` of the indices (a count, or a fraction
    if below 1, rounded), both in their given order."""
    count = int(holdout * len(indices) + 0.5) if holdout < 1 else int(holdout)
    if not 0 < count < len(indices):
        raise ShardError(
            f"holdout {holdout} of {len(indices)} images is {count}: hold out at least one and keep at least one"
        )
    # Its own stream of the seed: the choice must not change with --shuffle, which draws from `seed`.
    chosen = set(random.Random(f"holdout/{seed}").sample(range(len(indices)), count))
    kept = [index for n, index in enumerate(indices) if n not in chosen]
    return kept, [index for n, index in enumerate(indices) if n in chosen]


def write_split(
    source: Source,
    out_dir: Path,
    prefix: str,
    holdout_prefix: str,
    holdout: float,
    holdout_seed: int,
    options: WriteOptions = WriteOptions(),
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Write the source (after `options.limit`) as two disjoint shard sets, `prefix` and a seeded random
    held-out `holdout_prefix` (see holdout_split); return both sidecars and the skipped images."""
    if prefix == holdout_prefix:
        raise ShardError(f"the held-out prefix {holdout_prefix!r} is the training prefix: choose another")
    for name in (prefix, holdout_prefix):  # checked first, so that neither set is written if one cannot be
        _check_prefix(name)
        _check_free(out_dir, name, options)
    pool = list(range(len(source)))[: options.limit]
    kept, held = holdout_split(pool, holdout, holdout_seed)
    whole = replace(options, limit=None)
    sidecar, skipped = write_shards(source, out_dir, prefix, whole, kept)
    held_sidecar, held_skipped = write_shards(source, out_dir, holdout_prefix, whole, held)
    return sidecar, held_sidecar, skipped + held_skipped
