"""Shards we did not write: GNU tar in its formats and orders, webdataset's TarWriter, Python's tarfile,
gzip, empty and zero-byte files, and a shard with members of tens of MiB.

Each is read by the loader (ShardDataModule's validation stream: shard order, no shuffling, so the
labels come out in the order stored) and by the inspector, and the exact labels or keys are checked.
Sample i is shardkit's: a flat colour encoding i, with label i.
"""

from __future__ import annotations

import gzip
import io
import random
import re
import subprocess
import sys
import tarfile
import threading
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from PIL import Image
from shardkit import colour, encode, read_all, sample, write_shard
from workspace import time_limit

from mpp.data.module import ShardDataModule
from mpp.data.remote import ShardOpenError
from mpp.shards.inspector import inspect_shards
from mpp.shards.tar import MemberOrderError, iter_samples

COUNT = 6
KEYS = [f"sample{i:06d}" for i in range(COUNT)]
REMEDY = "Rewrite the tar with `tar --sort=name` (GNU tar >= 1.28) or with `mpp shards write`"
T = TypeVar("T")


def _within(seconds: float, read: Callable[[], T]) -> T:
    """read() in a thread; fail, rather than hang the suite, if it has not finished after `seconds` on the
    reference machine (time_limit)."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = read()
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(time_limit(seconds))
    assert not thread.is_alive(), f"still reading after {time_limit(seconds):.0f} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _load(shards: str | list[str]) -> tuple[list[int], int]:
    """(labels in stored order, samples and shards skipped) of one pass of the validation stream."""
    dm = ShardDataModule(train=shards, val=shards, batch_size=4, num_workers=0, image_size=8)
    dm.setup("fit", rank=0, world_size=1)
    labels, skipped, _ = _within(30, lambda: read_all(dm.val_dataloader()))
    return labels, skipped


def _keys(path: Path) -> list[str]:
    with path.open("rb") as stream:
        return [record["__key__"] for record in _within(10, lambda: list(iter_samples(stream)))]


def _tar(*args: str | Path) -> None:
    subprocess.run(["tar", *map(str, args)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<key>.png and <key>.cls files of samples 0..COUNT-1, as a user's folder would hold them."""
    root = tmp_path_factory.mktemp("folder")
    for index, key in enumerate(KEYS):
        record = sample(index)
        (root / f"{key}.png").write_bytes(record["png"])
        (root / f"{key}.cls").write_bytes(record["cls"])
    return root


@pytest.fixture(scope="module")
def sorted_tar(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tar --sort=name -C folder -cf sorted.tar .`: members "./", "./sample000000.cls", ..."""
    path = tmp_path_factory.mktemp("sorted") / "sorted.tar"
    _tar("--sort=name", "-C", folder, "-cf", path, ".")
    return path


@pytest.mark.parametrize("format", [None, "gnu", "oldgnu", "pax", "ustar", "v7"])
def test_gnu_tar_sorted_by_name_reads_every_sample_with_its_label(folder: Path, tmp_path: Path,
                                                                  format: str | None) -> None:
    path = tmp_path / "sorted.tar"
    _tar("--sort=name", *([f"--format={format}"] if format else []), "-C", folder, "-cf", path, ".")
    assert _keys(path) == KEYS
    assert _load(str(path)) == (list(range(COUNT)), 0)
    report = inspect_shards([str(path)], verify=True)
    assert report.problems == [] and report.total == COUNT and report.labels == {i: 1 for i in range(COUNT)}


def test_a_dot_slash_prefix_gives_the_same_samples(folder: Path, sorted_tar: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain.tar"
    _tar("-C", folder, "-cf", plain, *sorted(p.name for p in folder.iterdir()))
    with plain.open("rb") as file:
        assert b"./" not in file.read(100)  # the first member is named without the prefix
    with sorted_tar.open("rb") as dotted, plain.open("rb") as undotted:
        assert list(iter_samples(dotted)) == list(iter_samples(undotted))
    assert _load(str(plain)) == _load(str(sorted_tar)) == (list(range(COUNT)), 0)


def _directory_order(folder: Path, tmp_path: Path) -> Path:
    """What `tar -C folder -cf x.tar .` may store, made deterministic: every image, then every label."""
    names = [f"./{key}.{ext}" for ext in ("png", "cls") for key in KEYS]
    (tmp_path / "list").write_text("\n".join(names) + "\n")
    path = tmp_path / "apart.tar"
    _tar("-C", folder, "-cf", path, "-T", tmp_path / "list")
    return path


def test_members_of_one_sample_apart_are_refused_with_the_remedy(folder: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    path = _directory_order(folder, tmp_path)
    with path.open("rb") as stream, pytest.raises(MemberOrderError) as refused:
        _within(10, lambda: list(iter_samples(stream)))
    assert str(refused.value) == (f"member './{KEYS[0]}.cls' belongs to sample '{KEYS[0]}', which came earlier "
                                  f"in this tar (the sample in hand is '{KEYS[-1]}'): the members of one sample "
                                  f"must be adjacent. {REMEDY}")
    script = subprocess.run([sys.executable, "-m", "mpp", "shards", "inspect", str(path)],
                            capture_output=True, text=True, timeout=time_limit(60))
    assert script.returncode == 1
    assert (f"{path}: members out of order after {COUNT - 1} samples: member './{KEYS[0]}.cls'" in script.stderr
            and REMEDY in script.stderr)


def test_the_loader_stops_at_a_tar_with_members_apart_naming_it_and_the_remedy(folder: Path, tmp_path: Path,
                                                                             sorted_tar: Path) -> None:
    """Reading on would part images from their labels: a wrong result, so the run stops, not a skip."""
    path = _directory_order(folder, tmp_path)
    with pytest.raises(MemberOrderError, match=re.escape(f"shard {path}: member")) as error:
        _load([str(sorted_tar), str(path)])
    assert REMEDY in str(error.value)


def test_webdataset_tarwriter_and_python_tarfile_with_pax_headers(tmp_path: Path) -> None:
    written = write_shard(tmp_path / "wds.tar", [sample(i) for i in range(COUNT)])
    assert _keys(Path(written)) == KEYS
    # Long and non-ASCII names: tarfile stores them in pax records, with a pax global header first.
    keys = ["k" * 150 + "-0", "ключ-日本-1", "dir.v1/sub/2"]
    with tarfile.open(tmp_path / "pax.tar", "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}) as tar:
        for index, key in enumerate(keys):
            record = sample(index)
            for ext in ("cls", "png"):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(record[ext])
                tar.addfile(info, io.BytesIO(record[ext]))
    assert _keys(tmp_path / "pax.tar") == keys
    assert _load([written, str(tmp_path / "pax.tar")]) == (list(range(COUNT)) + [0, 1, 2], 0)
    report = inspect_shards([written, str(tmp_path / "pax.tar")], verify=True)
    assert report.problems == [] and report.total == COUNT + 3


def test_hand_made_tar_with_repeats_upper_case_and_webp(tmp_path: Path) -> None:
    """a.png a.cls a.png B.PNG c.webp: four samples, each with an image, for loader and inspector alike."""
    images = [encode(Image.new("RGB", (12, 10), colour(i))) for i in range(3)]
    members = [("a.png", images[0]), ("a.cls", b"0"), ("a.png", images[1]), ("B.PNG", images[2]),
               ("c.webp", encode(Image.new("RGB", (12, 10), colour(3)), "webp", lossless=True))]
    with tarfile.open(tmp_path / "mixed.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert _keys(tmp_path / "mixed.tar") == ["a", "a", "B", "c"]
    assert _load(str(tmp_path / "mixed.tar")) == ([0, -1, -1, -1], 0)
    report = inspect_shards([str(tmp_path / "mixed.tar")])
    assert report.problems == [] and report.total == 4 and report.labels == {0: 1, None: 3}


def test_gzip_shards_are_read_whatever_their_name(folder: Path, sorted_tar: Path, tmp_path: Path) -> None:
    _tar("--sort=name", "-C", folder, "-czf", tmp_path / "a.tar.gz", ".")
    _tar("--sort=name", "-C", folder, "-czf", tmp_path / "b.tgz", ".")
    (tmp_path / "c.tar").write_bytes(gzip.compress(sorted_tar.read_bytes()))  # sniffed, not named
    shards = [str(tmp_path / name) for name in ("a.tar.gz", "b.tgz", "c.tar")]
    assert [_keys(Path(shard)) for shard in shards] == [KEYS] * 3
    assert _load(shards) == (list(range(COUNT)) * 3, 0)
    report = inspect_shards(shards)
    assert report.problems == [] and report.shards == {shard: COUNT for shard in shards}
    script = subprocess.run([sys.executable, "-m", "mpp", "shards", "inspect", shards[0], "--verify"],
                            capture_output=True, text=True, timeout=time_limit(60))
    assert script.returncode == 0, script.stderr
    assert f"verified: {COUNT} samples" in script.stdout


class _FailingAfter(io.BytesIO):
    """A stream whose storage gives up after `limit` bytes, as a remote read whose retries are spent."""

    def __init__(self, data: bytes, limit: int) -> None:
        super().__init__(data)
        self.limit = limit

    def read(self, size: int | None = -1) -> bytes:
        left = self.limit - self.tell()
        if left <= 0:
            raise ShardOpenError("cannot read s3://bucket/a.tar.gz: gave up after 6 attempts")
        return super().read(left if size is None or size < 0 else min(size, left))


def test_a_storage_failure_inside_a_gzip_shard_is_not_taken_for_broken_gzip(sorted_tar: Path) -> None:
    stream = _FailingAfter(gzip.compress(sorted_tar.read_bytes()), 100)
    with pytest.raises(ShardOpenError, match="gave up after 6 attempts"):
        list(iter_samples(stream))


def _complete_before(tar: bytes, available: int) -> list[int]:
    """The samples of a tar the reader yields when only its first `available` bytes can be read: those
    whose next sample's first member (or, for the last, the end-of-archive block) is whole by then."""
    firsts: dict[str, int] = {}
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive:
            if member.isfile():
                end = member.offset_data + -(-member.size // 512) * 512
                firsts.setdefault(member.name.removeprefix("./").split(".")[0], end)
        archive_end = archive.offset + 512
    ends = list(firsts.values())[1:] + [archive_end]
    return [index for index, end in enumerate(ends) if end <= available]


def test_a_gzip_shard_cut_in_half_is_one_broken_shard(sorted_tar: Path, tmp_path: Path) -> None:
    rng = random.Random(0)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for index in range(20):  # random .txt members, so that half the gzip holds about half the tar
            record = {**sample(index), "txt": rng.randbytes(3000)}
            for ext in ("png", "cls", "txt"):
                info = tarfile.TarInfo(f"{record['__key__']}.{ext}")
                info.size = len(record[ext])
                tar.addfile(info, io.BytesIO(record[ext]))
    packed = gzip.compress(buffer.getvalue())
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    available = len(zlib.decompressobj(wbits=31).decompress(cut.read_bytes()))
    before = _complete_before(buffer.getvalue(), available)
    assert 5 < len(before) < 15
    with cut.open("rb") as stream, pytest.raises(tarfile.ReadError, match="^broken gzip data: "):
        _within(10, lambda: list(iter_samples(stream)))
    assert _load([str(cut), str(sorted_tar)]) == (before + list(range(COUNT)), 1)
    report = inspect_shards([str(cut)])
    assert report.problems == [f"{cut}: truncated or garbled after {len(before)} complete samples (broken gzip "
                               "data: Compressed file ended before the end-of-stream marker was reached)"]


def test_an_empty_tar_reads_as_no_samples_and_a_zero_byte_file_as_an_empty_one(sorted_tar: Path,
                                                                                 tmp_path: Path) -> None:
    """The empty tar has no sample, the zero-byte file is an empty file (one skip); an epoch of nothing
    else has no batch, which is an error naming the shard."""
    empty, zero = tmp_path / "empty.tar", tmp_path / "zero.tar"
    _tar("-cf", empty, "-T", "/dev/null")
    zero.write_bytes(b"")
    assert empty.stat().st_size == 10240 and _keys(empty) == []
    with zero.open("rb") as stream, pytest.raises(tarfile.ReadError, match=r"an empty file \(0 bytes\)"):
        list(iter_samples(stream))
    for alone in (empty, zero):
        with pytest.raises(RuntimeError, match=f"yielded no batch: its 1 shard.*{alone.name}"):
            _load(str(alone))
    assert _load([str(empty), str(sorted_tar)]) == (list(range(COUNT)), 0)
    assert _load([str(zero), str(sorted_tar)]) == (list(range(COUNT)), 1)
    report = inspect_shards([str(empty), str(zero)])
    assert report.shards == {str(empty): 0, str(zero): 0}
    assert report.problems == [f"{zero}: an empty file (0 bytes), not a tar"]


MEMBER = 32 << 20  # bytes of each .bin member of the huge shard


def test_a_huge_shard_is_read_one_member_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "huge.tar"
    blob = bytes(MEMBER)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for index in range(5):
            record = sample(index, size=(4000, 3000) if index == 2 else (12, 10))
            if index != 2:
                record["bin"] = blob  # not an image: the loader reads it and passes it over
            for ext, data in record.items():
                if ext != "__key__":
                    info = tarfile.TarInfo(f"{record['__key__']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    del blob
    assert path.stat().st_size > 4 * MEMBER
    tracemalloc.start()
    try:
        loaded = _load(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert loaded == (list(range(5)), 0)
    # A member is read in chunks and joined (2 copies), while the sample before may still be held: about
    # 3 members at most, less than the shard.
    assert peak < 3.5 * MEMBER, f"peak {peak / 2**20:.0f} MiB reading a {path.stat().st_size / 2**20:.0f} MiB shard"
