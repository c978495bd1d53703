"""Peak memory of streaming: one full pass of ShardDataModule's training loader (no model, not
resampled) over 10 shards and over 200 shards of the same size; the peak should stay flat.

Each pass runs in a fresh subprocess, so that its peak is its own; the two passes of a setting
run side by side. A pass reports getrusage's peak resident set size of its main process
(RUSAGE_SELF: it receives the batches and, with 0 workers, also reads and decodes) and of its
largest waited-for child (RUSAGE_CHILDREN: the DataLoader workers, which read the shards when
there are any). Both are compared, 200-shard peak / 10-shard peak, the children only with
workers, and the worst ratio is the verdict. It also shows the main process's resident size
just before the pass (imports and setup: most of the peak) and, from /proc where there is
one, the resident size of the main process and of the largest worker at the first and at the
last batch: growth between them is memory that accumulates while streaming.

    python -m benchmarks.bench_memory   # 0 and 2 workers, buffer 0 and 1000
    python -m benchmarks.bench_memory --workers 2 --shuffle-buffers 1000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.kit import ROOT, SHARD_PREFIX, argument_parser, write_photo_shards
from mpp.data.module import ShardDataModule
from mpp.shards.format import shard_pattern

TARGET = 1.10  # 200-shard peak / 10-shard peak


def megabytes_maxrss(who: int) -> float:
    """getrusage's peak resident set size in MB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(who).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def resident_mb(pid: int | str = "self") -> float | None:
    """The current resident set size of a process, from /proc; None where there is no /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**10
    except OSError:
        return None
    return None


def children_mb() -> float | None:
    """The resident size of this process's largest child (a DataLoader worker), from /proc."""
    try:
        tasks = Path("/proc/self/task").iterdir()
        pids = {pid for task in tasks for pid in (task / "children").read_text().split()}
    except OSError:
        return None
    sizes = [size for size in map(resident_mb, pids) if size is not None]
    return max(sizes) if sizes else None


def one_pass(
    pattern: str, *, workers: int, shuffle_buffer: int, batch: int, image_size: int
) -> dict[str, float | None]:
    """Read every sample of `pattern` once; the memory figures of this process (see the module docstring)."""
    dm = ShardDataModule(
        train=pattern,
        batch_size=batch,
        num_workers=workers,
        image_size=image_size,
        channels=3,
        shuffle_buffer=shuffle_buffer,
        resampled=False,
    )
    dm.setup("fit")
    before = resident_mb()
    started = time.perf_counter()
    samples = 0
    first: tuple[float | None, float | None] | None = None
    last: tuple[float | None, float | None] = (None, None)
    for batch_dict in dm.train_dataloader():
        samples += batch_dict["image"].shape[0]
        # The workers may have exited by the last batch: keep the last size seen of each.
        now = (resident_mb(), children_mb())
        last = (now[0], now[1] if now[1] is not None else last[1])
        first = first or now
    # The loader's workers have exited and been waited for: RUSAGE_CHILDREN now includes them.
    return {
        "samples": samples,
        "seconds": time.perf_counter() - started,
        "before": before,
        "self_peak": megabytes_maxrss(resource.RUSAGE_SELF),
        "children_peak": megabytes_maxrss(resource.RUSAGE_CHILDREN) if workers else None,
        "self_first": first[0] if first else None,
        "self_last": last[0],
        "worker_first": first[1] if first else None,
        "worker_last": last[1],
    }


def measure_side_by_side(
    patterns: list[str], *, workers: int, shuffle_buffer: int, batch: int, image_size: int
) -> list[dict]:
    """`one_pass` over each pattern, each in a fresh interpreter, all at once: peaks are per process,
    so they do not mix, and the passes share whatever else the machine is doing."""
    options = [
        "--workers",
        str(workers),
        "--shuffle-buffers",
        str(shuffle_buffer),
        "--batch",
        str(batch),
        "--image-size",
        str(image_size),
    ]
    passes = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_memory", "--one-pass", pattern, *options],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for pattern in patterns
    ]
    figures = []
    for pattern, process in zip(patterns, passes):
        out, err = process.communicate()
        if process.returncode:
            raise RuntimeError(f"the pass over {pattern} failed:\n{err[-3000:]}")
        figures.append(json.loads(out.strip().splitlines()[-1]))
    return figures


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def compare_setting(
    patterns: dict[int, str], args: argparse.Namespace, *, workers: int, shuffle_buffer: int, index: int
) -> float:
    """Pairs of passes (few, many shards) of one setting: print their rows and ratios, return the worst ratio."""
    runs: dict[int, list[dict]] = {args.few: [], args.many: []}
    for repeat in range(args.repeats):
        order = [args.few, args.many] if (index + repeat) % 2 == 0 else [args.many, args.few]
        measured = measure_side_by_side(
            [patterns[n] for n in order],
            workers=workers,
            shuffle_buffer=shuffle_buffer,
            batch=args.batch,
            image_size=args.image_size,
        )
        for shards, figures in zip(order, measured):
            if figures["samples"] != shards * args.per_shard:
                raise RuntimeError(f"read {figures['samples']} samples of {shards * args.per_shard}")
            runs[shards].append(figures)
            print(
                f"{workers:>7} {shuffle_buffer:>6} {shards:>6} {figures['samples']:>7} {figures['seconds']:>5.1f} "
                f"{mb(figures['self_peak']):>9} {mb(figures['children_peak']):>8} {mb(figures['before']):>7} "
                f"{mb(figures['self_first']) + ' -> ' + mb(figures['self_last']):>17} "
                f"{mb(figures['worker_first']) + ' -> ' + mb(figures['worker_last']):>19}"
            )
    ratios = {}
    for key in ["self_peak"] + (["children_peak"] if workers else []):
        few, many = (max(r[key] for r in runs[n]) for n in (args.few, args.many))
        ratios[key.replace("_peak", "")] = many / few
    print(
        f"{'':>7} {'':>6} peak {args.many} / {args.few} shards: "
        + ", ".join(f"{name} {ratio:.3f}x" for name, ratio in ratios.items())
    )
    return max(ratios.values())


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--few", type=int, default=10, help="shards in the small pass")
    parser.add_argument("--many", type=int, default=200, help="shards in the large pass")
    parser.add_argument("--per-shard", type=int, default=50, help="samples per shard")
    parser.add_argument("--side", type=int, default=64, help="approximate source JPEG side in px")
    parser.add_argument("--image-size", type=int, default=32, help="crop size in px")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts to try")
    parser.add_argument(
        "--shuffle-buffers", type=int, nargs="+", default=[0, 1000], help="sample shuffle buffer sizes to try (0: none)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="pairs of passes per setting")
    parser.add_argument("--one-pass", metavar="PATTERN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_pass:
        figures = one_pass(
            args.one_pass,
            workers=args.workers[0],
            shuffle_buffer=args.shuffle_buffers[0],
            batch=args.batch,
            image_size=args.image_size,
        )
        print(json.dumps(figures))
        return

    started = time.perf_counter()
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        write_photo_shards(Path(tmp), images=args.many * args.per_shard, per_shard=args.per_shard, side=args.side)
        patterns = {count: str(Path(tmp) / shard_pattern(SHARD_PREFIX, count)) for count in (args.few, args.many)}
        print(
            f"{args.per_shard} JPEGs of ~{args.side} px per shard -> {args.image_size} px crops, batch "
            f"{args.batch}; one full pass per fresh process, the two of a setting side by side; "
            f"{platform.system()} {platform.machine()}"
        )
        print(
            "MB: peak self / peak workers (getrusage); main before the pass; main and largest worker at "
            "the first -> last batch (/proc)\n"
        )
        print(
            f"{'workers':>7} {'buffer':>6} {'shards':>6} {'samples':>7} {'s':>5} {'peak self':>9} "
            f"{'peak wkr':>8} {'before':>7} {'main first->last':>17} {'worker first->last':>19}"
        )
        settings = [(w, b) for b in args.shuffle_buffers for w in args.workers]
        for index, (workers, buffer) in enumerate(settings):
            worst = max(worst, compare_setting(patterns, args, workers=workers, shuffle_buffer=buffer, index=index))

    verdict = "flat: meets" if worst <= TARGET else "NOT flat: misses"
    print(
        f"\nratio peak RSS {args.many} / {args.few} shards, worst of all settings: {worst:.3f}x "
        f"({verdict} the target <= {TARGET:.2f}x); {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
