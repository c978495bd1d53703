"""Loader throughput: ShardDataModule on JPEG shards next to a plain PIL folder Dataset.

Both sides decode the same JPEGs and do a random resized crop to the same size plus a
horizontal flip, into uint8 (B, C, H, W) batches, at the same batch size and worker count.
The baseline is what a torchvision-style folder pipeline does (open, convert to RGB, crop,
resize, flip, to tensor) written with PIL alone. Runs alternate (A B B A ...); each reads every image once.

    python -m benchmarks.bench_loader --workers 1
    python -m benchmarks.bench_loader --workers 2 --images 2000 --repeats 3
"""

from __future__ import annotations

import itertools
import random
import statistics
import tarfile
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from benchmarks.kit import alternate, argument_parser, cpu_name, write_photo_shards
from mpp.data.module import ShardDataModule
from mpp.data.transforms import random_resized_box


def make_data(root: Path, *, images: int, side: int, shards: int, seed: int) -> tuple[Path, str]:
    """Write JPEGs (quality 90) to shards, and the very same bytes to a folder; returns (folder, shard pattern)."""
    pattern = write_photo_shards(root / "shards", images=images, per_shard=-(-images // shards), side=side, seed=seed)
    folder = root / "folder"
    folder.mkdir()
    for shard in sorted((root / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                (folder / member.name).write_bytes(tar.extractfile(member).read())
    return folder, pattern


class FolderDataset(Dataset):
    """The baseline: one JPEG per file, PIL decode, crop, resize, flip -> uint8 (3, H, W)."""

    def __init__(self, folder: Path, size: int) -> None:
        self.paths = sorted(folder.glob("*.jpg"))
        self.size = size
        self.rng = random.Random(0)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = Image.open(self.paths[index]).convert("RGB")
        box = random_resized_box(image.width, image.height, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), rng=self.rng)
        image = image.crop(tuple(round(v) for v in box)).resize((self.size, self.size), Image.BILINEAR)
        if self.rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(image)).permute(2, 0, 1), index % 10


def images_per_second(loader: Iterable, expected: int) -> float:
    """Read one epoch; images per second of wall time, worker start-up included."""
    start = time.perf_counter()
    count = 0
    for batch in loader:
        images = batch["image"] if isinstance(batch, dict) else batch[0]
        count += images.shape[0]
    elapsed = time.perf_counter() - start
    if count != expected:
        raise RuntimeError(f"read {count} images, expected {expected}")
    return count / elapsed


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers on both sides")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--side", type=int, default=256, help="approximate source image side in px")
    parser.add_argument("--image-size", type=int, default=224, help="crop size in px")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder, pattern = make_data(Path(tmp), images=args.images, side=args.side, shards=args.shards, seed=args.seed)
        dm = ShardDataModule(
            train=pattern,
            batch_size=args.batch_size,
            num_workers=args.workers,
            image_size=args.image_size,
            seed=args.seed,
        )
        dm.setup("fit")
        baseline = DataLoader(
            FolderDataset(folder, args.image_size), batch_size=args.batch_size, shuffle=True, num_workers=args.workers
        )
        images_per_second(dm.train_dataloader(), args.images)  # warm the page cache for both
        epochs = itertools.count()

        def shards() -> float:
            dm.set_epoch(next(epochs))
            return images_per_second(dm.train_dataloader(), args.images)

        runs = alternate(
            {"ShardDataModule": shards, "PIL folder Dataset": lambda: images_per_second(baseline, args.images)},
            args.repeats,
        )

    per = max(args.workers, 1)
    print(
        f"{args.images} JPEGs of ~{args.side} px -> {args.image_size} px crops, batch {args.batch_size}, "
        f"{args.workers} workers, {args.repeats} alternating repeats; {cpu_name()}"
    )
    print(f"{'loader':<20} {'img/s (median)':>15} {'img/s per worker':>17} {'all repeats':>28}")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:<20} {median:>15.0f} {median / per:>17.0f} {' '.join(f'{v:.0f}' for v in values):>28}")
    ratio = statistics.median(runs["ShardDataModule"]) / statistics.median(runs["PIL folder Dataset"])
    print(f"ratio ShardDataModule / folder baseline: {ratio:.2f}x")


if __name__ == "__main__":
    main()
