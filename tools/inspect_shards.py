"""Summarise WebDataset shards (samples, classes, image sizes and modes); --verify decodes all.

Examples:
    python tools/inspect_shards.py shards/fashion-mnist/train.json
    python tools/inspect_shards.py 'shards/fashion-mnist/train-{000000..000009}.tar' --verify
    python tools/inspect_shards.py downloaded/train-000000.tar.gz   # gzip-compressed and foreign tars too
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from mpp.shards.format import ShardError
from mpp.shards.inspector import Inspection, inspect_shards


def _counts(counter: Counter, name: Callable[[Any], str] = str) -> str:
    """`key: count` pairs, most common first."""
    return ", ".join(f"{name(k)}: {n}" for k, n in sorted(counter.items(), key=lambda kv: -kv[1]))


def render(report: Inspection) -> str:
    """The human-readable summary: per-shard counts, total, class histogram, sizes and modes."""
    width = max([len(s) for s in report.shards] + [5])
    lines = [f"{shard:<{width}}  {count:>8}" for shard, count in report.shards.items()]
    lines += [f"{'total':<{width}}  {report.total:>8}", "", "classes:"]
    for label, count in sorted(report.labels.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        if label is None:
            name = "(no label)"
        elif report.classes is not None and label < len(report.classes):
            name = f"{label:>4}  {report.classes[label]}"
        else:
            name = f"{label:>4}"
        lines.append(f"  {name:<24} {count:>8}")
    lines.append(f"image sizes (w x h): {_counts(report.sizes, lambda s: f'{s[0]}x{s[1]}')}")
    lines.append(f"image modes: {_counts(report.modes)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the summary; exit 1 and list `<shard>:<key>: <reason>` lines if anything is broken."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shards", nargs="+", help="shard paths, brace patterns or sidecar .json files")
    parser.add_argument(
        "--verify", action="store_true", help="fully decode every image and check labels and sidecar counts"
    )
    args = parser.parse_args(argv)
    try:
        report = inspect_shards(args.shards, verify=args.verify)
    except ShardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(render(report))
    for problem in report.problems:
        print(problem, file=sys.stderr)
    if report.problems:
        print(f"{len(report.problems)} problems found", file=sys.stderr)
        return 1
    if args.verify:
        print(f"verified: {report.total} samples decode and match the sidecar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
