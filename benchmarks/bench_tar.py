"""Tar reading: mpp.shards.tar.iter_samples next to webdataset's tar_file_expander + group_by_keys.

Both read the same uncompressed tars (written to a temporary folder, then read once into the
page cache), group the members into samples and count them; the best of --repeats is shown.
"small" is --samples 28 x 28 grey PNG samples with a .cls each (a FashionMNIST shard's shape),
"big" is --big samples of one --big-mib MiB .bin member and a .cls each.

    python -m benchmarks.bench_tar
    python -m benchmarks.bench_tar --samples 5000 --big 2 --big-mib 16 --repeats 5
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from mpp.shards.tar import iter_samples

Members = Iterator[tuple[str, bytes]]


def small(count: int) -> Members:
    """`count` samples of a 28 x 28 grey noise PNG (256 distinct ones, repeated) and a .cls."""
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(256):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8), "L").save(buffer, "PNG")
        pngs.append(buffer.getvalue())
    for index in range(count):
        yield f"s{index:07d}.png", pngs[index % 256]
        yield f"s{index:07d}.cls", str(index % 10).encode()


def big(count: int, mib: int) -> Members:
    """`count` samples of a `mib` MiB random .bin member and a .cls."""
    blob = os.urandom(1 << 20) * mib
    for index in range(count):
        yield f"b{index:03d}.bin", blob
        yield f"b{index:03d}.cls", b"1"


def write_tar(path: Path, members: Members) -> None:
    """A ustar tar of the members, in the order given."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def read_mpp(path: Path) -> int:
    """Samples in the tar, as mpp's reader groups them."""
    with path.open("rb") as stream:
        return sum(1 for _ in iter_samples(stream))


def read_webdataset(path: Path) -> int:
    """Samples in the tar, as webdataset's tar_file_expander and group_by_keys group them."""
    from webdataset.tariterators import group_by_keys, tar_file_expander  # imports torch

    with path.open("rb") as stream:
        return sum(1 for _ in group_by_keys(tar_file_expander([{"url": str(path), "stream": stream}])))


def best(read: Callable[[Path], int], path: Path, repeats: int) -> tuple[float, int]:
    """(the shortest of `repeats` reads in seconds, the samples read)."""
    times, count = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        count = read(path)
        times.append(time.perf_counter() - start)
    return min(times), count


def main(argv: list[str] | None = None) -> int:
    """Write both tars, read each with both readers, print samples/s and MiB/s."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000, help="small PNG samples (default 20000)")
    parser.add_argument("--big", type=int, default=4, help="big samples (default 4)")
    parser.add_argument("--big-mib", type=int, default=64, help="MiB of each big member (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="reads per reader and tar (default 3)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        for name, members in (("small", small(args.samples)), ("big", big(args.big, args.big_mib))):
            path = Path(folder) / f"{name}.tar"
            write_tar(path, members)
            size = len(path.read_bytes()) / 2**20
            for reader, read in (("mpp", read_mpp), ("webdataset", read_webdataset)):
                seconds, count = best(read, path, args.repeats)
                print(
                    f"{name:5} {reader:10}: {count} samples, {size:.1f} MiB in {seconds:.3f} s: "
                    f"{count / seconds:,.0f} samples/s, {size / seconds:,.0f} MiB/s"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
