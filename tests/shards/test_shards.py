"""Shard writing and checking: sources, round trips, limits, shuffling, overwriting, inspection."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from workspace import ROOT, mpp_command

from mpp.shards.format import ShardError
from mpp.shards.images import IMAGE_EXTENSIONS, is_16bit, to_8bit
from mpp.shards.inspector import inspect_shards
from mpp.shards.sources import (
    FASHION_MNIST_CLASSES,
    IMAGE_SUFFIXES,
    Source,
    cifar,
    fashion_mnist,
    flat_folder,
    image_folder,
    read_idx,
)
from mpp.shards.tar import iter_samples
from mpp.shards.writer import (
    MAX_PREFIX,
    WriteOptions,
    encode_image,
    holdout_split,
    write_shards,
    write_split,
)

QUIET = WriteOptions(progress=False)


def shards_write(argv: list[str]) -> int:
    """`mpp shards write <argv>` in this process -> its exit code."""
    return mpp_command("shards", "write", *argv)


def _options(**changes) -> WriteOptions:
    return WriteOptions(**{**QUIET.__dict__, **changes})


def _idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def read_back(out: Path, prefix: str) -> tuple[dict, list[tuple[str, Image.Image, int | None]]]:
    """Every sample of a written set, read with plain tarfile + PIL in stored order."""
    sidecar = json.loads((out / f"{prefix}.json").read_text())
    samples: dict[str, dict[str, bytes]] = {}
    for entry in sidecar["shards"]:
        with tarfile.open(out / entry["name"]) as tar:
            for info in tar:
                key, ext = info.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(info).read()
    result = []
    for key, members in samples.items():
        image = Image.open(io.BytesIO(members[sidecar["image_format"]]))
        image.load()
        label = int(members["cls"].decode("ascii")) if "cls" in members else None
        result.append((key, image, label))
    return sidecar, result


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, dict[str, tuple[np.ndarray, str]]]:
    """Class folders (deliberately unsorted on creation) of small images in several modes."""
    rng = np.random.default_rng(0)
    root, expected = tmp_path / "images", {}
    for index, (cls, mode) in enumerate([("dog", "RGB"), ("ant", "L"), ("cat", "RGBA"),
                                         ("dog", "L"), ("ant", "RGB"), ("cat", "RGB"), ("dog", "RGB")]):
        shape = (5 + index, 9) + ({"RGB": (3,), "RGBA": (4,)}.get(mode, ()))
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        path = root / cls / ("sub" if index == 6 else "") / f"img{index}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode).save(path)
        expected[str(path)] = (pixels, cls)
    return root, expected


def test_read_idx_plain_and_gzip_exact(tmp_path: Path) -> None:
    images = np.random.default_rng(1).integers(0, 256, (3, 4, 5), dtype=np.uint8)
    shorts = np.array([[-2, 300], [7, -32768]], dtype=np.int16)
    (tmp_path / "images").write_bytes(_idx_bytes(images))
    (tmp_path / "images.gz").write_bytes(gzip.compress(_idx_bytes(images)))
    (tmp_path / "shorts").write_bytes(_idx_bytes(shorts, 0x0B))
    for name in ("images", "images.gz"):
        parsed = read_idx(tmp_path / name)
        assert parsed.dtype == np.uint8 and np.array_equal(parsed, images)
    assert np.array_equal(read_idx(tmp_path / "shorts"), shorts)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + bytes(8))
    with pytest.raises(ShardError, match="bad: not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx_bytes(images)[:-1])
    with pytest.raises(ShardError, match=r"short: 75 bytes, but shape \(3, 4, 5\) needs 76"):
        read_idx(tmp_path / "short")


def test_fashion_mnist_split_writes_exact_grayscale_png(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = np.array([9, 0, 3, 3, 1, 8, 5], dtype=np.uint8)
    data = tmp_path / "fmnist"
    data.mkdir()
    (data / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(images)))
    (data / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(labels))
    with pytest.raises(ShardError, match="train-images-idx3-ubyte"):
        fashion_mnist(data, "train")
    source = fashion_mnist(data, "test")
    assert list(source.classes) == list(FASHION_MNIST_CLASSES)
    write_shards(source, tmp_path / "out", "test", _options(limit=5, shard_samples=2))
    sidecar, samples = read_back(tmp_path / "out", "test")
    assert [s["samples"] for s in sidecar["shards"]] == [2, 2, 1] and sidecar["samples"] == 5
    assert [key for key, _, _ in samples] == [f"test_{i:07d}" for i in range(5)]
    for i, (_, image, label) in enumerate(samples):
        assert image.mode == "L" and np.array_equal(np.asarray(image), images[i])
        assert label == labels[i]
    again, _ = write_shards(source, tmp_path / "again", "test", _options(limit=5, shard_samples=2))
    for entry in again["shards"]:  # fixed tar metadata: rebuilding gives identical bytes
        name = entry["name"]
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_image_folder_round_trip(tmp_path: Path, folder) -> None:
    root, expected = folder
    sidecar, _ = write_shards(image_folder(root), tmp_path / "out", "train", _options(shard_samples=3))
    assert sidecar["classes"] == ["ant", "cat", "dog"] and sidecar["image_format"] == "png"
    assert [s["name"] for s in sidecar["shards"]] == [f"train-00000{i}.tar" for i in range(3)]
    assert [s["samples"] for s in sidecar["shards"]] == [3, 3, 1]
    for entry in sidecar["shards"]:
        assert (tmp_path / "out" / entry["name"]).stat().st_size == entry["bytes"]
    _, samples = read_back(tmp_path / "out", "train")
    files = sorted(expected)  # keys number the images in sorted class, then path, order
    assert len(samples) == len(expected) == sidecar["samples"]
    for key, image, label in samples:
        pixels, cls = expected[files[int(key.split("_")[1])]]
        assert sidecar["classes"][label] == cls
        assert np.array_equal(np.asarray(image), pixels)  # modes L / RGB / RGBA survive


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path) as tar:
        return [(info, tar.extractfile(info).read()) for info in tar]


def _tar_size(members: list[tuple[tarfile.TarInfo, bytes]]) -> int:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data))
    return len(buffer.getvalue())


def test_shard_bytes_limit_is_honoured_and_shards_are_full(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    noise = [rng.integers(0, 256, (8 + 5 * (i % 7), 30), dtype=np.uint8) for i in range(30)]
    source = Source(labels=[1] * 30, load=lambda i: Image.fromarray(noise[i]), origin=str,
                    classes=["a", "b"])
    limit = 2 * tarfile.RECORDSIZE
    sidecar, _ = write_shards(source, tmp_path, "t", _options(shard_bytes=limit, shard_samples=10**6))
    shards = [_members(tmp_path / s["name"]) for s in sidecar["shards"]]
    assert len(shards) > 2 and sum(len(m) for m in shards) == 2 * 30
    assert max(s["bytes"] for s in sidecar["shards"]) <= limit
    for members, after in zip(shards, shards[1:]):  # a new shard starts only when needed
        assert _tar_size(members + after[:2]) > limit
    whole, _ = write_shards(source, tmp_path, "w", _options(shard_bytes=10**9, shard_samples=10**6))
    assert len(whole["shards"]) == 1


def test_seeded_shuffle_is_a_reproducible_permutation(tmp_path: Path) -> None:
    labels = [i % 3 for i in range(40)]
    source = Source(labels=labels, load=lambda i: Image.new("L", (4, 4), i),
                    origin=str, classes=["a", "b", "c"])

    def keys(name: str, seed: int | None) -> list[str]:
        write_shards(source, tmp_path / name, "s", _options(seed=seed, shard_samples=7))
        _, samples = read_back(tmp_path / name, "s")
        for key, image, label in samples:  # each key still carries its own image and label
            index = int(key.split("_")[1])
            assert image.getpixel((0, 0)) == index and label == labels[index]
        return [key for key, _, _ in samples]

    plain, first, again, other = keys("p", None), keys("a", 3), keys("b", 3), keys("c", 4)
    assert first == again and first != plain and first != other
    assert sorted(first) == plain == [f"s_{i:07d}" for i in range(40)]


def test_cifar_pickles(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    batch = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    ten, hundred = tmp_path / "c10", tmp_path / "c100"
    ten.mkdir(), hundred.mkdir()

    def dump(path: Path, obj: dict) -> None:
        path.write_bytes(pickle.dumps(obj))

    dump(ten / "batches.meta", {b"label_names": [b"plane", b"car", b"bird"]})
    dump(ten / "data_batch_1", {b"data": batch[:2], b"labels": [2, 0]})
    dump(ten / "data_batch_2", {b"data": batch[2:], b"labels": [1, 1]})
    dump(ten / "test_batch", {b"data": batch[:1], b"labels": [1]})
    source = cifar(ten, "train")
    assert source.classes == ["plane", "car", "bird"] and list(source.labels) == [2, 0, 1, 1]
    # Rows hold the red plane, then green, then blue, each row-major over 32 x 32.
    image = np.asarray(source.load(3))
    assert image.shape == (32, 32, 3)
    assert image[1, 2].tolist() == [batch[3, 34], batch[3, 1024 + 34], batch[3, 2048 + 34]]
    assert len(cifar(ten, "test")) == 1

    dump(hundred / "meta", {b"fine_label_names": [b"apple", b"bee"], b"coarse_label_names": [b"fruit"]})
    dump(hundred / "test", {b"data": batch, b"fine_labels": [1, 0, 1, 1], b"coarse_labels": [0] * 4})
    assert cifar(hundred, "test", "coarse").classes == ["fruit"]
    fine = cifar(hundred, "test", "fine")
    write_shards(fine, tmp_path / "out", "test", QUIET)
    sidecar, samples = read_back(tmp_path / "out", "test")
    assert sidecar["classes"] == ["apple", "bee"] and [s[2] for s in samples] == [1, 0, 1, 1]
    assert np.array_equal(np.asarray(samples[0][1]), np.asarray(fine.load(0)))
    (hundred / "test").write_bytes(pickle.dumps({b"data": batch, b"fine_labels": print}))
    with pytest.raises(ShardError, match="test: not a readable CIFAR pickle"):
        cifar(hundred, "test")  # pickles may only build numpy arrays, not call arbitrary code


def test_a_prefix_up_to_the_longest_allowed_writes_readable_shards_and_a_longer_one_is_refused(
    tmp_path: Path, folder
) -> None:
    source = image_folder(folder[0])
    longest = "p" * MAX_PREFIX
    write_shards(source, tmp_path / "out", longest, QUIET)
    _, samples = read_back(tmp_path / "out", longest)
    assert len(samples) == len(source)
    with pytest.raises(ShardError, match=f"prefix of {MAX_PREFIX + 1} characters: at most {MAX_PREFIX}"):
        write_shards(source, tmp_path / "out", longest + "p", QUIET)


def test_refuses_to_overwrite_unless_asked(tmp_path: Path, folder) -> None:
    source, out = image_folder(folder[0]), tmp_path / "out"
    write_shards(source, out, "train", _options(shard_samples=2))
    assert len(list(out.glob("train-*.tar"))) == 4
    with pytest.raises(ShardError, match=r"train-000000\.tar already exists; pass --overwrite"):
        write_shards(source, out, "train", _options(shard_samples=100))
    write_shards(source, out, "val", QUIET)  # another prefix in the same folder is fine
    sidecar, _ = write_shards(source, out, "train", _options(shard_samples=100, overwrite=True))
    # The stale shards of the larger first run must not linger next to the new one.
    assert sorted(p.name for p in out.glob("train-*")) == ["train-000000.tar"]
    assert sidecar["samples"] == len(source) and (out / "val-000000.tar").exists()


def test_cli_refusal_and_overwrite(tmp_path: Path, folder, capsys) -> None:
    argv = ["folder", str(folder[0]), "--out", str(tmp_path), "--no-progress", "--shard-samples", "4"]
    assert shards_write(argv) == 0
    assert shards_write(argv) == 1
    assert "train-000000.tar already exists; pass --overwrite" in capsys.readouterr().err
    assert shards_write(argv + ["--overwrite", "--shuffle", "--seed", "1"]) == 0


def test_interrupted_run_leaves_no_complete_looking_shard(tmp_path: Path) -> None:
    def load(i: int) -> Image.Image:
        if i == 5:
            raise KeyboardInterrupt
        return Image.new("L", (3, 3), i)

    source = Source(labels=[0] * 9, load=load, origin=str, classes=["x"])
    with pytest.raises(KeyboardInterrupt):
        write_shards(source, tmp_path, "train", _options(shard_samples=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-000000.tar", "train-000001.tar"]


def test_flat_folder_and_bad_images(tmp_path: Path, folder) -> None:
    root = folder[0]
    source = flat_folder(root)
    assert source.classes is None and len(source) == 7
    sidecar, _ = write_shards(source, tmp_path / "out", "u", QUIET)
    with tarfile.open(tmp_path / "out" / "u-000000.tar") as tar:
        assert not [n for n in tar.getnames() if n.endswith(".cls")]
    assert sidecar["classes"] is None
    (root / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ShardError, match=r"broken\.jpg: cannot decode image"):
        write_shards(flat_folder(root), tmp_path / "bad", "u", QUIET)
    sidecar, skipped = write_shards(flat_folder(root), tmp_path / "skip", "u", _options(skip_bad=True))
    assert sidecar["samples"] == 7 and len(skipped) == 1 and "broken.jpg" in skipped[0]


def test_encoding_modes_and_resize() -> None:
    deep = Image.fromarray(np.array([[0, 255, 256, 65535]], dtype=np.uint16))
    assert np.asarray(Image.open(io.BytesIO(encode_image(deep)))).tolist() == [[0, 1, 1, 255]]  # rounded
    rgba = Image.new("RGBA", (40, 20), (10, 20, 30, 0))
    small = Image.open(io.BytesIO(encode_image(rgba, "jpg", resize_short=10)))
    assert small.format == "JPEG" and small.mode == "RGB" and small.size == (20, 10)
    palette = Image.new("P", (2, 2), 0)
    palette.putpalette([200, 100, 50] * 256)
    assert Image.open(io.BytesIO(encode_image(palette))).getpixel((0, 0)) == (200, 100, 50)


def test_a_16_bit_image_is_stored_as_the_loader_decodes_it(tmp_path: Path) -> None:
    """One rule from 16 to 8 bits: the writer stores what the loader's to_8bit makes of the same file."""
    levels = np.array([[0, 128, 129, 255, 256, 32767, 32768, 65407, 65535]], dtype=np.uint16)
    pixels = np.vstack([levels, np.random.default_rng(5).integers(0, 65536, (5, 9), dtype=np.uint16)])
    root = tmp_path / "deep"
    root.mkdir()
    for suffix in ("png", "tif"):  # 16-bit grey PNG and TIFF
        Image.fromarray(pixels).save(root / f"deep.{suffix}")
    write_shards(flat_folder(root), tmp_path / "out", "d", QUIET)
    _, samples = read_back(tmp_path / "out", "d")
    assert len(samples) == 2
    for (_, stored, _), path in zip(samples, sorted(root.iterdir())):
        with Image.open(path) as original:
            assert is_16bit(original.mode), original.mode
            loaded = np.asarray(to_8bit(original))
        assert stored.mode == "L" and np.array_equal(np.asarray(stored), loaded)
        assert np.asarray(stored)[0].tolist() == [0, 0, 1, 1, 1, 127, 128, 255, 255]  # (v + 128) // 257


def test_a_float_image_is_stored_as_the_loader_decodes_it(tmp_path: Path) -> None:
    """Float images hold intensities in [0, 1], for the writer as for the loader (not PIL's 0..255)."""
    root = tmp_path / "float"
    root.mkdir()
    Image.fromarray(np.array([[0.0, 0.5, 1.0, 200.0]], dtype=np.float32), "F").save(root / "f.tif")
    write_shards(flat_folder(root), tmp_path / "out", "f", QUIET)
    _, samples = read_back(tmp_path / "out", "f")
    with Image.open(root / "f.tif") as original:
        assert original.mode == "F"
        loaded = np.asarray(to_8bit(original))
    stored = np.asarray(samples[0][1])
    assert np.array_equal(stored, loaded) and stored[0].tolist() == [0, 128, 255, 255]


def _rewrite_member(shard: Path, victim: str, data: bytes) -> None:
    members = _members(shard)
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, content in members:
            content = data if info.name == victim else content
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


def test_inspector_counts_and_verify(tmp_path: Path, folder) -> None:
    out = tmp_path / "out"
    write_shards(image_folder(folder[0]), out, "train", _options(shard_samples=3))
    report = inspect_shards([str(out / "train.json")], verify=True)
    assert report.problems == [] and report.shards == {str(out / f"train-00000{i}.tar"): n
                                                       for i, n in enumerate([3, 3, 1])}
    assert report.classes == ["ant", "cat", "dog"] and report.labels == {0: 2, 1: 2, 2: 3}
    assert report.modes == {"RGB": 4, "L": 2, "RGBA": 1} and report.total == 7
    assert report.sizes[(9, 5)] == 1
    pattern = inspect_shards([str(out / "train-{000000..000001}.tar")])
    assert pattern.total == 6 and pattern.classes == ["ant", "cat", "dog"]
    (out / "copy.tar").write_bytes((out / "train-000000.tar").read_bytes())
    twice = inspect_shards([str(out / "train-000000.tar"), str(out / "copy.tar")], verify=True)
    assert twice.problems[0] == (f"{out / 'copy.tar'}:train_0000000: key already used in "
                                 f"{out / 'train-000000.tar'}")

    _rewrite_member(out / "train-000000.tar", "train_0000001.png", b"\x89PNG\r\n\x1a\n garbage")
    size = (out / "train-000001.tar").stat().st_size
    with tarfile.open(out / "train-000001.tar") as tar:
        cut = tar.getmember("train_0000004.png").offset_data + 10
    with open(out / "train-000001.tar", "r+b") as file:  # cut inside the second sample's image
        file.truncate(cut)
    with open(out / "train-000002.tar", "r+b") as file:  # cut exactly after the only sample
        file.truncate(4 * 512)
    report = inspect_shards([str(out / "train.json")], verify=True)
    text = "\n".join(report.problems)
    assert f"{out / 'train-000000.tar'}:train_0000001: cannot decode .png" in text
    # As the loader reads them: a sample is complete once the next one's first member is whole, or
    # the end-of-archive marker follows it; so neither the first sample of train-000001 counts nor,
    # without the marker, the only one of train-000002.
    assert (f"{out / 'train-000001.tar'}: truncated or garbled after 0 complete samples (the stream "
            "ended inside member data (10 of ") in text
    assert (f"{out / 'train-000002.tar'}: truncated or garbled after 0 complete samples (the stream "
            "ended before the end-of-archive marker: a truncated tar)") in text
    assert f"{out / 'train-000001.tar'}: 0 samples, sidecar says 3" in text
    assert f"{out / 'train-000002.tar'}: 0 samples, sidecar says 1" in text
    assert f"{out / 'train-000001.tar'}: {cut} bytes, sidecar says {size}" in text


def test_inspector_cli_exit_codes(tmp_path: Path, folder, capsys) -> None:
    out = tmp_path / "out"
    write_shards(image_folder(folder[0]), out, "train", QUIET)
    assert mpp_command("shards", "inspect", *[str(out / "train.json"), "--verify"]) == 0
    assert "verified: 7 samples" in capsys.readouterr().out
    (out / "train.json").write_text(json.dumps({"format": "mpp-shards/1", "samples": 8, "shards": [
        {"name": "train-000000.tar", "samples": 8}]}))
    result = subprocess.run([sys.executable, "-m", "mpp", "shards", "inspect",
                             str(out / "train.json"), "--verify"], capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{out / 'train-000000.tar'}: 7 samples, sidecar says 8" in result.stderr
    assert "total" in result.stdout and "7" in result.stdout


def test_embedded_fashion_mnist_sample() -> None:
    for prefix, samples, shards in (("train", 10_000, 10), ("test", 1_000, 1)):
        path = ROOT / "shards" / "fashion-mnist" / f"{prefix}.json"
        sidecar = json.loads(path.read_text())
        assert sidecar["format"] == "mpp-shards/1" and sidecar["image_format"] == "png"
        assert sidecar["samples"] == samples and len(sidecar["shards"]) == shards
        assert sidecar["classes"] == list(FASHION_MNIST_CLASSES)
        for entry in sidecar["shards"]:
            assert (path.parent / entry["name"]).stat().st_size == entry["bytes"]
    report = inspect_shards([str(ROOT / "shards" / "fashion-mnist" / "test.json")], verify=True)
    assert report.problems == [] and report.total == 1000 and len(report.labels) == 10
    assert report.modes == {"L": 1000} and report.sizes == {(28, 28): 1000}


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A plain ustar tar of the members, in the order given."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _png(level: int, ext: str = "png") -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (6, 4), level).save(buffer, {"jpg": "JPEG", "tif": "TIFF"}.get(ext, ext.upper()))
    return buffer.getvalue()


def test_inspector_groups_members_as_the_loader_does(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "mixed.tar", [("a.png", _png(1)), ("a.cls", b"0"), ("a.png", _png(2)),
                                          ("B.PNG", _png(3)), ("c.webp", _png(4, "webp"))])
    with shard.open("rb") as file:
        loaded = list(iter_samples(file))
    assert [(s["__key__"], sorted(s)) for s in loaded] == [
        ("a", ["__key__", "cls", "png"]), ("a", ["__key__", "png"]), ("B", ["__key__", "png"]),
        ("c", ["__key__", "webp"])]
    report = inspect_shards([str(shard)])
    assert report.problems == [] and report.total == 4 and report.labels == {0: 1, None: 3}
    verified = inspect_shards([str(shard)], verify=True)  # every image decodes; only the repeated key is news
    assert verified.problems == [f"{shard}:a: key already used in {shard}"] and sum(verified.modes.values()) == 4


def test_one_image_extension_list_for_loader_inspector_and_folders(tmp_path: Path) -> None:
    assert IMAGE_EXTENSIONS[:3] == ("png", "jpg", "jpeg") and IMAGE_SUFFIXES == {f".{e}" for e in IMAGE_EXTENSIONS}
    formats = {"jpeg": "jpg", "tiff": "tif", "pgm": "ppm", "pbm": "ppm"}  # PIL saves PGM/PBM as PPM by mode
    root = tmp_path / "flat"
    root.mkdir()
    for index, ext in enumerate(IMAGE_EXTENSIONS):
        mode = {"pbm": "1", "pgm": "L"}.get(ext, "L")
        buffer = io.BytesIO()
        Image.new(mode, (6, 4), index).save(buffer, {"jpg": "JPEG", "tif": "TIFF"}.get(
            formats.get(ext, ext), formats.get(ext, ext).upper()))
        (root / f"{index:02d}.{ext.upper() if index % 2 else ext}").write_bytes(buffer.getvalue())
    (root / "notes.txt").write_text("not an image")
    assert len(flat_folder(root)) == len(IMAGE_EXTENSIONS)  # upper-case suffixes too
    shard = _tar(tmp_path / "all.tar", [(f"k{i:02d}.{ext}", (root / name).read_bytes()) for i, (ext, name) in
                                        enumerate(zip(IMAGE_EXTENSIONS, sorted(p.name for p in root.iterdir()
                                                                               if p.suffix != ".txt")))])
    report = inspect_shards([str(shard)], verify=True)
    assert report.problems == [] and report.total == sum(report.modes.values()) == len(IMAGE_EXTENSIONS)


def test_inspector_reads_gzip_shards_and_reports_broken_gzip(tmp_path: Path, folder, capsys) -> None:
    out = tmp_path / "out"
    write_shards(image_folder(folder[0]), out, "train", _options(shard_samples=4))
    packed = gzip.compress((out / "train-000000.tar").read_bytes())
    (tmp_path / "a.tar.gz").write_bytes(packed)
    (tmp_path / "b.tgz").write_bytes(gzip.compress((out / "train-000001.tar").read_bytes()))
    (tmp_path / "cut.tar.gz").write_bytes(packed[: len(packed) // 2])
    assert mpp_command("shards", "inspect", *[str(tmp_path / "a.tar.gz"), str(tmp_path / "b.tgz"), "--verify"]) == 0
    assert "verified: 7 samples" in capsys.readouterr().out
    report = inspect_shards([str(tmp_path / "cut.tar.gz")])
    assert len(report.problems) == 1 and report.problems[0].startswith(
        f"{tmp_path / 'cut.tar.gz'}: truncated or garbled after {report.total} complete samples (broken gzip data: ")


def test_inspector_reports_members_that_are_not_adjacent(tmp_path: Path, capsys) -> None:
    shard = _tar(tmp_path / "apart.tar", [("a.png", _png(1)), ("b.png", _png(2)), ("a.cls", b"0"), ("b.cls", b"1")])
    assert mpp_command("shards", "inspect", *[str(shard)]) == 1
    err = capsys.readouterr().err
    assert (f"{shard}: members out of order after 1 samples: member 'a.cls' belongs to sample 'a', which came "
            "earlier in this tar (the sample in hand is 'b'): the members of one sample must be adjacent. "
            "Rewrite the tar with `tar --sort=name` (GNU tar >= 1.28) or with `mpp shards write`") in err


def test_make_shards_names_skip_bad_when_an_image_is_broken(tmp_path: Path, folder, capsys) -> None:
    (folder[0] / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
    argv = ["folder", str(folder[0]), "--out", str(tmp_path / "out"), "--no-progress"]
    assert shards_write(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mpp: error: {folder[0] / 'cat' / 'broken.jpg'}: cannot decode image (")
    assert err.rstrip().endswith("); pass --skip-bad to skip such images and list them")
    assert not (tmp_path / "out" / "train.json").exists()
    assert shards_write(argv + ["--skip-bad"]) == 0
    assert f"skipped: {folder[0] / 'cat' / 'broken.jpg'}: cannot decode image" in capsys.readouterr().err


def _indexed(out: Path, prefix: str) -> dict[int, int | None]:
    """{source index: label} of a written set, checking that each image still carries its index."""
    _, samples = read_back(out, prefix)
    found = {}
    for key, image, label in samples:
        index = int(key.split("_")[1])
        assert key.startswith(f"{prefix}_") and image.getpixel((0, 0)) == index
        found[index] = label
    assert len(found) == len(samples)
    return found


def test_holdout_split_is_seeded_disjoint_and_covers_the_source(tmp_path: Path) -> None:
    labels = [i % 4 for i in range(50)]
    source = Source(labels=labels, load=lambda i: Image.new("L", (4, 4), i), origin=str, classes=list("abcd"))

    def split(name: str, holdout: float, holdout_seed: int, **changes) -> tuple[dict, dict]:
        train, val, skipped = write_split(source, tmp_path / name, "train", "val", holdout, holdout_seed,
                                          _options(shard_samples=8, **changes))
        kept, held = _indexed(tmp_path / name, "train"), _indexed(tmp_path / name, "val")
        assert skipped == [] and (train["samples"], val["samples"]) == (len(kept), len(held))
        return kept, held

    kept, held = split("a", 0.2, 1)
    assert len(held) == 10 and len(kept) == 40 and not set(kept) & set(held)
    assert sorted({**kept, **held}) == list(range(50))
    assert all(label == labels[index] for part in (kept, held) for index, label in part.items())
    assert split("b", 0.2, 1) == (kept, held)  # the same seed: the same split
    assert set(split("c", 0.2, 2)[1]) != set(held)
    shuffled = split("d", 0.2, 1, seed=7)  # --shuffle reorders each set, but holds out the same
    assert shuffled == (kept, held) and list(shuffled[1]) != list(held)
    kept, held = split("e", 6, 1, limit=20)  # a count, of the first 20
    assert len(held) == 6 and sorted({**kept, **held}) == list(range(20))
    assert holdout_split(list(range(10)), 0.25, 0)[1] == sorted(holdout_split(list(range(10)), 0.25, 0)[1])
    assert len(holdout_split(list(range(10)), 0.25, 0)[1]) == 3  # 2.5 rounds up
    with pytest.raises(ShardError, match="held-out prefix 'train' is the training prefix"):
        write_split(source, tmp_path / "same", "train", "train", 0.2, 1, QUIET)
    for holdout in (0.01, 10, 11):
        with pytest.raises(ShardError, match=rf"holdout {holdout} of 10 images is"):
            holdout_split(list(range(10)), holdout, 0)


def test_make_shards_holdout_writes_two_sets_or_neither(tmp_path: Path, folder, capsys) -> None:
    out = tmp_path / "out"
    argv = ["folder", str(folder[0]), "--out", str(out), "--no-progress", "--holdout", "2", "--seed", "3"]
    assert shards_write(argv + ["--holdout-prefix", "held"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"5 samples in 1 shards: {out / 'train-000000.tar'} (index {out / 'train.json'})",
        f"held out (--seed 3): 2 samples in 1 shards: {out / 'held-000000.tar'} (index {out / 'held.json'}); "
        "0 skipped"]
    files, indices = sorted(folder[1]), []
    for prefix in ("train", "held"):  # labels stay with their images
        sidecar, samples = read_back(out, prefix)
        for key, image, label in samples:
            indices.append(int(key.split("_")[1]))
            pixels, cls = folder[1][files[indices[-1]]]
            assert np.array_equal(np.asarray(image), pixels) and sidecar["classes"][label] == cls
    assert sorted(indices) == list(range(7)) and len(samples) == 2
    (out / "val.json").write_text("{}")
    assert shards_write(argv + ["--prefix", "fresh"]) == 1  # the held-out set exists: neither is written
    assert f"{out / 'val.json'} already exists; pass --overwrite to replace the val shards" in capsys.readouterr().err
    assert not list(out.glob("fresh*"))
    for bad in ("0", "1.5", "half"):
        assert shards_write(argv[:-4] + ["--holdout", bad]) == 2
        assert "neither a count (1 or more) nor a fraction in (0, 1)" in capsys.readouterr().err
