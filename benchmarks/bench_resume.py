"""What resuming a training stream mid-epoch costs: the time a worker spends replaying to its position.

A resumed worker rereads the shards its shuffle buffer's samples came from and its current shard
up to the next sample (mpp.data.resume); no image is decoded. This tool repacks the embedded
FashionMNIST training images into shards of each `--shard-sizes` size, trains `--batches` batches
of a resampled stream (batch 128, shuffle buffer 1000, as the demo), takes the stream's state, and
times the first batch of the stream resumed from that state next to the first batch of a fresh
stream (the same work less the replay), `--repeats` times each, alternating. One worker (in the
process, `num_workers=0`): with more, each replays its own part at the same time.

    python -m benchmarks.bench_resume
    python -m benchmarks.bench_resume --shard-sizes 100 1000 10000 --batches 60
"""

from __future__ import annotations

import argparse
import io
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.kit import ROOT
from mpp.data import ShardDataModule
from mpp.shards.format import shard_name, shard_pattern
from mpp.shards.tar import iter_samples


def repack(out: Path, shard_size: int) -> str:
    """The embedded training samples in shards of `shard_size` samples; returns their pattern."""
    out.mkdir(parents=True, exist_ok=True)
    members = []
    for index in range(10):
        with open(ROOT / "shards" / "fashion-mnist" / shard_name("train", index), "rb") as stream:
            members += [sample for sample in iter_samples(stream)]
    shards = 0
    for start in range(0, len(members), shard_size):
        with tarfile.open(out / shard_name("train", shards), "w") as tar:
            for sample in members[start : start + shard_size]:
                for extension, data in sample.items():
                    if extension.startswith("__"):
                        continue
                    info = tarfile.TarInfo(f"{sample['__key__']}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards += 1
    return str(out / shard_pattern("train", shards))


def stream(shards: str) -> ShardDataModule:
    data = ShardDataModule(
        train=shards,
        batch_size=128,
        num_workers=0,
        image_size=28,
        channels=1,
        crop_scale=(0.5, 1.0),
        resampled=True,
        samples_per_epoch=20_000,
        shuffle_buffer=1000,
    )
    data.setup("fit")
    return data


def first_batch(shards: str, state: dict | None) -> float:
    loader = stream(shards).train_dataloader()
    if state is not None:
        loader.load_state_dict(state)
    start = time.perf_counter()
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    batches.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--batches", type=int, default=50, help="batches trained before the state is taken")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'shard size':>10} {'shards reread':>13} {'replayed samples':>16} {'fresh first batch':>17} "
        f"{'resumed first batch':>19} {'replay':>8}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for size in args.shard_sizes:
            shards = repack(Path(folder) / str(size), size)
            loader = stream(shards).train_dataloader()
            batches = iter(loader)
            for _ in range(args.batches):
                loader.trained(next(batches))
            batches.close()
            state = loader.state_dict()
            (point,) = state["ranks"][0]["points"]
            reread = {j for j, _ in point["buffer"]} | {point["next"][0]}
            replayed = (
                sum(1 + max(i for j, i in point["buffer"] if j == shard) for shard in reread - {point["next"][0]})
                + point["next"][1]
            )
            fresh, resumed = [], []
            for _ in range(args.repeats):
                fresh.append(first_batch(shards, None))
                resumed.append(first_batch(shards, state))
            f, r = statistics.median(fresh), statistics.median(resumed)
            print(f"{size:>10} {len(reread):>13} {replayed:>16} {f:>16.3f}s {r:>18.3f}s {r - f:>7.3f}s")


if __name__ == "__main__":
    main()
