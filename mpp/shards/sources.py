"""Image sets to write as shards: FashionMNIST IDX files, CIFAR pickles, image folders."""

from __future__ import annotations

import gzip
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from mpp.shards.format import ShardError
from mpp.shards.images import IMAGE_EXTENSIONS

# Where Debian's `dataset-fashion-mnist` package installs the IDX files.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# File suffixes of the images a folder source picks up: those the loader reads from shards.
IMAGE_SUFFIXES = frozenset(f".{extension}" for extension in IMAGE_EXTENSIONS)
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@dataclass(frozen=True)
class Source:
    """Images to write, loaded one at a time, with an optional label each."""

    labels: Sequence[int | None]
    load: Callable[[int], Image.Image]
    origin: Callable[[int], str]  # where image i comes from, for error messages
    classes: Sequence[str] | None

    def __len__(self) -> int:
        return len(self.labels)


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (plain or gzip) into a native-endian array of its declared shape."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # sniff instead of trusting the suffix
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise ShardError(f"{path}: broken gzip data ({error})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES:
        raise ShardError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'})")
    ndim, header = raw[3], 4 + 4 * raw[3]
    if len(raw) < header:
        raise ShardError(f"{path}: IDX header cut short")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise ShardError(f"{path}: {len(raw)} bytes, but shape {shape} needs {expected}")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _array_source(images: np.ndarray, labels: Sequence[int] | np.ndarray, classes: Sequence[str], where: str) -> Source:
    """Wrap uint8 (N, H, W) or (N, H, W, 3) arrays; grayscale stays mode L."""
    return Source(
        labels=[int(y) for y in labels],
        load=lambda i: Image.fromarray(images[i]),
        origin=lambda i: f"{where}[{i}]",
        classes=list(classes),
    )


def fashion_mnist(directory: Path = FASHION_MNIST_DIR, split: str = "train") -> Source:
    """FashionMNIST `train` or `test` split from its IDX files (plain or .gz)."""
    if split not in ("train", "test"):
        raise ShardError(f"FashionMNIST split {split!r}: choose train or test")
    stem = {"train": "train", "test": "t10k"}[split]
    found = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        candidates = [directory / f"{stem}-{kind}{ext}" for ext in ("", ".gz")]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ShardError(
                f"{candidates[0]}(.gz) not found; install Debian's "
                "dataset-fashion-mnist or pass --dir with the folder of the IDX files"
            )
        found.append(path)
    images, labels = read_idx(found[0]), read_idx(found[1])
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ShardError(f"{found[0]}: expected uint8 images (N, H, W), got {images.dtype} {images.shape}")
    if labels.shape != images.shape[:1] or labels.max(initial=0) >= len(FASHION_MNIST_CLASSES):
        raise ShardError(
            f"{found[1]}: {labels.shape[0]} labels in 0..{labels.max(initial=0)} "
            f"do not fit {images.shape[0]} images of 10 classes"
        )
    return _array_source(images, labels, FASHION_MNIST_CLASSES, str(found[0]))


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickle CIFAR batches without running arbitrary code: only numpy arrays may be built."""

    _ALLOWED = {"_reconstruct", "_frombuffer", "ndarray", "dtype", "scalar"}

    def find_class(self, module: str, name: str) -> Any:
        """The numpy class the pickle names, if it is one allowed; else UnpicklingError."""
        if module.split(".")[0] == "numpy" and name in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _unpickle(path: Path) -> dict[bytes, Any]:
    try:
        with path.open("rb") as file:
            return _ArrayUnpickler(file, encoding="bytes").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ShardError(f"{path}: not a readable CIFAR pickle ({error})") from None


def cifar(directory: Path, split: str = "train", labels: str = "fine") -> Source:
    """CIFAR-10 (batches.meta) or CIFAR-100 (meta) pickles; `labels` is CIFAR-100's fine/coarse."""
    if split not in ("train", "test") or labels not in ("fine", "coarse"):
        raise ShardError(f"CIFAR split {split!r} / labels {labels!r}: choose train|test, fine|coarse")
    if (directory / "batches.meta").is_file():
        names = _unpickle(directory / "batches.meta")[b"label_names"]
        label_key = b"labels"
        files = (
            [directory / "test_batch"]
            if split == "test"
            else sorted(directory.glob("data_batch_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
        )
    elif (directory / "meta").is_file():
        names = _unpickle(directory / "meta")[f"{labels}_label_names".encode()]
        label_key = f"{labels}_labels".encode()
        files = [directory / split]
    else:
        raise ShardError(f"{directory}: no batches.meta (CIFAR-10) or meta (CIFAR-100) here")
    if not files or not all(f.is_file() for f in files):
        raise ShardError(f"{directory}: {split} batches missing (looked for {[f.name for f in files]})")
    data, ys = [], []
    for path in files:
        batch = _unpickle(path)
        if b"data" not in batch or label_key not in batch:
            raise ShardError(f"{path}: no {b'data'!r} or {label_key!r} entry")
        data.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.extend(batch[label_key])
    images = np.ascontiguousarray(np.concatenate(data).transpose(0, 2, 3, 1))  # CHW rows -> HWC
    return _array_source(images, ys, [n.decode() for n in names], str(files[0]))


def _image_files(root: Path) -> list[Path]:
    # Dot-files are skipped: macOS leaves `._name.jpg` resource forks that are not images.
    return sorted(
        p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )


def _open_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            image.load()
            return ImageOps.exif_transpose(image)  # re-encoding drops EXIF, so apply it now
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ShardError(f"{path}: cannot decode image ({error})") from None


def _file_source(files: list[Path], labels: list[int | None], classes: list[str] | None, root: Path) -> Source:
    if not files:
        raise ShardError(f"{root}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    return Source(labels=labels, load=lambda i: _open_image(files[i]), origin=lambda i: str(files[i]), classes=classes)


def image_folder(root: Path) -> Source:
    """Class-per-sub-folder tree; class index follows the sorted folder names."""
    if not root.is_dir():
        raise ShardError(f"{root}: not a directory")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files: list[Path] = []
    labels: list[int | None] = []
    for index, name in enumerate(classes):
        found = _image_files(root / name)
        files += found
        labels += [index] * len(found)
    return _file_source(files, labels, classes, root)


def flat_folder(root: Path) -> Source:
    """Every image below `root`, recursively, without labels."""
    if not root.is_dir():
        raise ShardError(f"{root}: not a directory")
    files = _image_files(root)
    return _file_source(files, [None] * len(files), None, root)
