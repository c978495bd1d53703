"""Hostile shards: seeded random damage to samples and tars, and the exact counts the loader must report.

Each case writes a few shards of samples that are good (an image whose flat colour encodes its
index, see shardkit), bad (garbage, empty, truncated, too large, a label that is not a number,
no image member, a key with a dot, which reads as another key with no image member) or odd
but good (unicode, non-UTF-8, long and repeated keys, other formats, upper-case extensions),
among members that are no sample (a directory, a name with no extension, metadata). Some tars
are then cut at a random byte or have a header zeroed or overwritten. The loader must not
fail, must yield every good sample it can reach exactly once, and count each bad sample and
each broken tar once in batch["skipped"] (when not one batch comes out there is nothing to
count them in, and they are only logged).

Where a tar breaks, the reader keeps the samples it has seen end: a sample is read when its
members and the next sample's first member (or the end-of-archive block) lie before the break,
as only the next name shows that a sample has all its members. The break is one skip.
"""

from __future__ import annotations

import io
import random
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image
from shardkit import colour, decode_index, encode, header_only_png

from mpp.data.module import ShardDataModule
from mpp.shards.tar import iter_files, iter_samples

MAX_PIXELS = 32 * 32  # the loader's max_image_pixels here: good images are at most 30 x 30
GOOD = ("png", "png_as_jpg", "bmp", "tif", "ppm", "upper_case", "rgba", "unlabelled", "unicode_key",
        "non_utf8_key", "long_key", "folder_key", "repeated_key")
BAD = ("garbage", "magic_garbage", "empty", "truncated", "text_as_png", "txt_only", "bomb", "oversize",
       "bad_label", "dotted_key")
MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"II*\x00", b"BM", b"P6\n", b"GIF89a")


@dataclass
class Written:
    """One sample as written: its members (name, bytes), its index if it should be read, else None."""

    members: list[tuple[str, bytes]]
    index: int | None


@dataclass
class Counts:
    """What a case wrote, what the loader read and skipped, and what it should have."""

    written: int = 0
    good: int = 0
    read: int = 0
    skipped: int = 0
    broken_tars: int = 0
    expected: set[int] = field(default_factory=set)
    expected_skipped: int = 0


def _pil_refuses(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any failure is a refusal, whatever PIL calls it
        return True
    return False


def _image(index: int, rng: random.Random, size: tuple[int, int] | None = None, mode: str = "RGB") -> Image.Image:
    size = size or (rng.randint(1, 30), rng.randint(1, 30))
    return Image.new(mode, size, colour(index) + ((255,) if mode == "RGBA" else ()))


def _sample(kind: str, index: int, rng: random.Random, previous: Written | None) -> Written:
    """A sample of `kind`; good ones carry `index` in their colour and (most) their label."""
    key, label = f"s{index:05d}", str(index).encode()
    png = encode(_image(index, rng))
    good = {
        "png": [("cls", label), ("png", png)],
        "png_as_jpg": [("cls", label), ("jpg", png)],  # PIL goes by content, not by name
        "bmp": [("bmp", encode(_image(index, rng), "bmp")), ("cls", label)],
        "tif": [("cls", label), ("tif", encode(_image(index, rng), "tif"))],
        "ppm": [("cls", label), ("ppm", encode(_image(index, rng), "ppm"))],
        "upper_case": [("CLS", label), ("PNG", png)],
        "rgba": [("cls", label), ("png", encode(_image(index, rng, mode="RGBA")))],
        "unlabelled": [("png", png)],
    }
    if kind in good:
        return Written([(f"{key}.{ext}", data) for ext, data in good[kind]], index)
    if kind in ("unicode_key", "non_utf8_key", "long_key", "folder_key", "repeated_key"):
        if kind == "repeated_key" and previous is not None and _extensions(previous) == ["cls", "png"]:
            key = previous.members[0][0].rsplit(".", 1)[0]  # the key of the sample before: split by repeats
        else:
            key = {"unicode_key": f"ключ-日本-{index}", "non_utf8_key": f"latin1-\udce9t\udce9-{index}",
                   "long_key": "k" * 180 + str(index),
                   "folder_key": f"dir.v1/sub/{index}"}.get(kind, key)
        return Written([(f"{key}.cls", label), (f"{key}.png", png)], index)
    return Written([(f"{name}", data) for name, data in _bad(kind, key, png, rng)], None)


def _bad(kind: str, key: str, png: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    label = b"7"
    if kind == "garbage":
        image = b"\x00" + rng.randbytes(rng.randint(1, 300))  # no image format starts with a zero byte
    elif kind == "magic_garbage":
        image = rng.choice(MAGIC) + rng.randbytes(rng.randint(0, 300))
    elif kind == "empty":
        image = b""
    elif kind == "truncated":
        image = png[: rng.randrange(len(png) // 2)]
    elif kind == "text_as_png":
        image = b"a caption, not an image"
    elif kind == "bomb":  # over PIL's limit (it refuses) or between 1x and 2x of it (it only warns)
        image = header_only_png(*rng.choice([(10_000, 10_000), (20_000, 20_000)]))
    elif kind == "oversize":
        image = encode(Image.new("RGB", (40, 40), (1, 2, 3)))
    else:
        image = png
    if kind == "txt_only":
        return [(f"{key}.txt", b"no image here")]
    if kind == "bad_label":
        label = rng.choice([b"seven", b"", b"3.5"])
    if kind == "dotted_key":
        key = key + ".v2"  # read as key `key` with extensions v2.cls and v2.png: no image member
    assert kind in ("oversize", "dotted_key", "bad_label") or _pil_refuses(image), kind
    return [(f"{key}.cls", label), (f"{key}.png", image)]


def _extensions(sample: Written) -> list[str]:
    return sorted(name.split(".", 1)[1].lower() for name, _ in sample.members)


def _shard(samples: list[Written], rng: random.Random) -> tuple[bytes, list[tarfile.TarInfo], list[int | None]]:
    """A tar of the samples (pax or GNU names) with a few members that are not samples.

    Returns the bytes, the members as tarfile reads them back, and each member's sample number.
    """
    buffer = io.BytesIO()
    owners: list[int | None] = []
    with tarfile.open(fileobj=buffer, mode="w", format=rng.choice([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])) as tar:
        for number, sample in enumerate(samples):
            extras = rng.choice([[], [], [], ["folder/"], ["README"], ["__meta__.json"]])
            for name in extras:  # ignored by the reader: a directory, no extension, metadata
                info = tarfile.TarInfo(name.rstrip("/"))
                info.type = tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
                tar.addfile(info, io.BytesIO(b"") if info.isreg() else None)
                owners.append(None)
            for name, data in sample.members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                owners.append(number)
    data = buffer.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    assert len(members) == len(owners)
    return data, members, owners


def _end(member: tarfile.TarInfo) -> int:
    return member.offset_data + -(-member.size // 512) * 512


def _damage(data: bytes, members: list[tarfile.TarInfo], rng: random.Random) -> tuple[bytes, int | None]:
    """Cut the tar or ruin one header block -> (bytes, the offset where reading must break, or None)."""
    damage = rng.choice(["none", "none", "none", "cut", "cut", "zeroed_header", "garbage_header"])
    if damage == "cut":
        at = rng.randrange(len(data)) if rng.random() < 0.8 else 0  # sometimes an empty file
        return data[:at], at
    if damage == "none":
        return data, None
    if damage == "zeroed_header":
        # Not the last member: only zeros would follow it, and a tar may end there.
        member = rng.choice(members[:-1] or members)
        at, block = member.offset, bytes(512)
    else:
        member = rng.choice(members)
        at = rng.choice([member.offset, member.offset_data - 512])  # pax / long-name header, or the real one
        block = rng.randbytes(512)
    return data[:at] + block + data[at + 512 :], at


def _expect(written: list[Written], members: list[tarfile.TarInfo], owners: list[int | None],
            break_at: int | None, counts: Counts) -> None:
    """Add the samples of one shard that must be read, and the skips it must count, to `counts`."""
    first_ends: dict[int, int] = {}
    for member, owner in zip(members, owners):
        if owner is not None:
            first_ends.setdefault(owner, _end(member))
    archive_end = max(map(_end, members)) + 512  # the first end-of-archive block, read in full
    for number, sample in enumerate(written):
        complete_at = first_ends.get(number + 1, archive_end)
        if break_at is None or break_at >= complete_at:
            if sample.index is None:
                counts.expected_skipped += 1
            else:
                counts.expected.add(sample.index)
    if break_at is not None and break_at < archive_end:
        counts.expected_skipped += 1
        counts.broken_tars += 1


def write_case(folder: Path, seed: int, *, shards: int = 4, per_shard: int = 8) -> tuple[list[str], Counts]:
    """Write `shards` hostile shards -> (their paths, the counts the loader must report)."""
    rng = random.Random(seed)
    counts = Counts()
    paths, index = [], 0
    for number in range(shards):
        written: list[Written] = []
        for _ in range(rng.randint(1, per_shard)):
            kind = rng.choice(GOOD + BAD)
            written.append(_sample(kind, index, rng, written[-1] if written else None))
            index += 1
        data, members, owners = _shard(written, rng)
        data, break_at = _damage(data, members, rng)
        path = folder / f"fuzz{seed}-{number:06d}.tar"
        path.write_bytes(data)
        paths.append(str(path))
        counts.written += len(written)
        counts.good += sum(sample.index is not None for sample in written)
        _expect(written, members, owners, break_at, counts)
    return paths, counts


def read_case(paths: list[str], num_workers: int, counts: Counts) -> list[int]:
    """Read the shards through ShardDataModule -> the sample indices, as their colours say."""
    dm = ShardDataModule(train=paths, batch_size=3, num_workers=num_workers, image_size=8, shuffle_buffer=4,
                         max_image_pixels=MAX_PIXELS, seed=1)
    dm.setup("fit")
    indices = []
    for batch in dm.train_dataloader():
        assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (3, 8, 8)
        assert len(batch["label"]) > 0, "a batch of no images reached the training step"
        for image, label in zip(batch["image"], batch["label"].tolist()):
            index = decode_index(image)
            assert label in (index, -1), f"sample {index} came with label {label}"
            indices.append(index)
        counts.skipped += int(batch["skipped"])
    counts.read = len(indices)
    return indices


SEEDS = range(8)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("seed", SEEDS)
def test_hostile_shards_are_read_exactly_as_expected(tmp_path: Path, seed: int, num_workers: int) -> None:
    paths, counts = write_case(tmp_path, seed)
    indices = read_case(paths, num_workers, counts)
    print(f"seed {seed} workers {num_workers}: written {counts.written}, good {counts.good}, read {counts.read}, "
          f"skipped {counts.skipped} (broken tars {counts.broken_tars})")
    assert sorted(indices) == sorted(counts.expected), "every reachable good sample once, nothing else"
    # Skips ride on batches: with no batch at all they are only logged.
    assert counts.skipped == (counts.expected_skipped if counts.expected else 0)


def _read_in_thread(data: bytes) -> tuple[list[dict], BaseException | None, bool]:
    """iter_samples over `data` in a thread -> (samples, its error, whether it was still running after 5 s)."""
    result: dict = {"samples": [], "error": None}

    def read() -> None:
        try:
            result["samples"].extend(iter_samples(io.BytesIO(data)))
        except BaseException as error:  # noqa: BLE001 - reported to the test
            result["error"] = error

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(5)
    return result["samples"], result["error"], thread.is_alive()


def _one_member_tar(name: str, data: bytes, format: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _with_header_field(tar: bytes, start: int, value: bytes) -> bytes:
    """The first header with bytes [start, start + len(value)) replaced, and its checksum made right again."""
    header = bytearray(tar[:512])
    header[start : start + len(value)] = value
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\x00 " % sum(header)
    return bytes(header) + tar[512:]


def test_a_pax_record_of_length_zero_is_refused_not_looped_on() -> None:
    tar = bytearray(_one_member_tar("k" * 150 + ".png", b"abc"))
    length = tar[512 : 512 + 8].split(b" ")[0]  # the pax data block starts "<length> path=..."
    tar[512 : 512 + len(length)] = b"0" * len(length)
    _, error, running = _read_in_thread(bytes(tar))
    assert not running and isinstance(error, tarfile.ReadError) and "pax record" in str(error)


def test_sizes_that_are_negative_or_larger_than_the_stream_are_refused(tmp_path: Path) -> None:
    tar = _one_member_tar("a.png", b"abc", tarfile.GNU_FORMAT)
    huge = _with_header_field(tar, 124, b"\x80" + (1 << 60).to_bytes(11, "big"))  # GNU base-256: an exabyte
    negative = _with_header_field(tar, 124, b"-0000000003\x00")
    for damaged in (huge, negative):
        path = tmp_path / "damaged.tar"
        path.write_bytes(damaged)
        with open(path, "rb") as stream, pytest.raises(tarfile.ReadError):
            list(iter_files(stream))  # a file reader would try to allocate what a size claims


def test_a_zeroed_header_inside_the_archive_is_an_error_not_its_end() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("a.png", "a.cls", "b.png"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    data = bytearray(buffer.getvalue())
    data[1024:1536] = bytes(512)  # a.cls's header
    _, error, _ = _read_in_thread(bytes(data))
    assert isinstance(error, tarfile.ReadError) and "end-of-archive" in str(error)


def test_samples_written_under_one_key_stay_apart() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in [("a.cls", b"1"), ("a.png", b"x"), ("a.cls", b"2"), ("a.png", b"y"), ("b.PNG", b"z")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    samples = list(iter_samples(io.BytesIO(buffer.getvalue())))
    assert samples == [{"__key__": "a", "cls": b"1", "png": b"x"}, {"__key__": "a", "cls": b"2", "png": b"y"},
                       {"__key__": "b", "png": b"z"}]


if __name__ == "__main__":  # the counts per seed and worker count, for a report
    import tempfile

    for seed in SEEDS:
        for num_workers in (0, 2):
            with tempfile.TemporaryDirectory() as folder:
                paths, counts = write_case(Path(folder), seed)
                read_case(paths, num_workers, counts)
                print(f"seed {seed} workers {num_workers}: written {counts.written}, good {counts.good}, "
                      f"expected read {len(counts.expected)}, read {counts.read}, expected skipped "
                      f"{counts.expected_skipped}, skipped {counts.skipped}, broken tars {counts.broken_tars}")
