"""Write WebDataset shards with their index from images (write), or check shards (inspect).

Examples:
    mpp shards write folder path/to/photos --out shards/photos --holdout 0.1 --seed 0
    mpp shards write flat path/to/frames --prefix unlabeled --out shards/frames
    mpp shards write fashion-mnist --split train --limit 10000 --out shards/fashion-mnist
    mpp shards write cifar path/to/cifar-100-python --split test --labels coarse --out shards/cifar100
    mpp shards write folder path/to/imagenet/train --out shards/imagenet --resize-short 256 --format jpg --shuffle
    mpp shards inspect shards/photos/train.json --verify
    mpp shards inspect 'downloaded/train-{000000..000009}.tar.gz'

`write` takes a source: `folder` (a sub-folder per class), `flat` (unlabelled images, recursively),
`fashion-mnist` (the IDX files) or `cifar` (the python pickles of CIFAR-10 or CIFAR-100). It writes
<prefix>-000000.tar ... and their index <prefix>.json, which `mpp fit --data.train` takes as it takes
the tars. --holdout N (a count) or F (a fraction, 0 < F < 1) holds out a seeded random choice of the
images (after --limit; the same with or without --shuffle) as a second set under --holdout-prefix.

`inspect` counts the samples of shards (ours, or tars other tools wrote), their classes, image
sizes and modes; --verify decodes every image and checks the counts against the index. A shard
with problems lists them, one `<shard>:<key>: <reason>` line each, and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpp.commands import command_parser
from mpp.shards.format import shard_pattern, sidecar_name
from mpp.shards.inspector import Inspection, inspect_shards
from mpp.shards.sources import FASHION_MNIST_DIR, Source, cifar, fashion_mnist, flat_folder, image_folder
from mpp.shards.writer import WriteOptions, write_shards, write_split


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _holdout(text: str) -> float:
    """A count of images (a whole number, 1 or more) or a fraction of them (0 < F < 1)."""
    try:
        value = int(text) if text.isdigit() else float(text)
    except ValueError:
        value = 0
    if not (value >= 1 if isinstance(value, int) else 0 < value < 1):
        raise argparse.ArgumentTypeError(f"{text} is neither a count (1 or more) nor a fraction in (0, 1)")
    return value


def _write_options(parser: argparse.ArgumentParser) -> None:
    """The options of `mpp shards write`, after its source."""
    parser.add_argument("--out", type=Path, required=True, help="folder of the shards and their index")
    parser.add_argument("--prefix", help="shard name prefix (default: the split, or 'train')")
    parser.add_argument(
        "--shard-samples", type=_positive, default=1000, metavar="N", help="samples per shard (default 1000)"
    )
    parser.add_argument(
        "--shard-bytes", type=_positive, metavar="N", help="start a new shard rather than pass this size"
    )
    parser.add_argument("--resize-short", type=_positive, metavar="N", help="resize so the short side is N px")
    parser.add_argument("--format", choices=("png", "jpg"), default="png", dest="image_format")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality, 1-100 (default 95)")
    parser.add_argument("--limit", type=_positive, metavar="N", help="take only the first N images")
    parser.add_argument("--shuffle", action="store_true", help="shuffle sample order before sharding")
    parser.add_argument("--seed", type=int, default=0, help="seed of --shuffle and --holdout")
    parser.add_argument(
        "--holdout",
        type=_holdout,
        metavar="N|F",
        help="hold out N images, or a fraction F of them, as a second shard set",
    )
    parser.add_argument("--holdout-prefix", default="val", help="prefix of the held-out set (default val)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing shards")
    parser.add_argument("--skip-bad", action="store_true", help="skip undecodable images, list them")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def argument_parser() -> argparse.ArgumentParser:
    """`mpp shards write <source> ...` and `mpp shards inspect ...`."""
    parser = command_parser("shards", __doc__)
    actions = parser.add_subparsers(dest="action", required=True, metavar="{write,inspect}", parser_class=type(parser))
    write = actions.add_parser("write", help="write shards and their index from images")
    sources = write.add_subparsers(dest="source", required=True, metavar="{folder,flat,fashion-mnist,cifar}")
    folder = sources.add_parser("folder", help="one sub-folder per class")
    folder.add_argument("root", type=Path)
    flat = sources.add_parser("flat", help="unlabelled images, recursively")
    flat.add_argument("root", type=Path)
    fmnist = sources.add_parser("fashion-mnist", help="FashionMNIST IDX files")
    fmnist.add_argument(
        "--dir", type=Path, default=FASHION_MNIST_DIR, help=f"folder of the IDX files (default: {FASHION_MNIST_DIR})"
    )
    fmnist.add_argument("--split", choices=("train", "test"), default="train")
    cifar_ = sources.add_parser("cifar", help="CIFAR-10/100 python pickles")
    cifar_.add_argument("root", type=Path, help="cifar-10-batches-py or cifar-100-python folder")
    cifar_.add_argument("--split", choices=("train", "test"), default="train")
    cifar_.add_argument("--labels", choices=("fine", "coarse"), default="fine", help="CIFAR-100 only")
    for source in (folder, flat, fmnist, cifar_):
        _write_options(source)
    inspect = actions.add_parser("inspect", help="count and check shards")
    inspect.add_argument("shards", nargs="+", help="shard paths or URLs, brace patterns, or a shard index (.json)")
    inspect.add_argument(
        "--verify", action="store_true", help="decode every image and check labels and the index's counts"
    )
    return parser


def load_source(args: argparse.Namespace) -> Source:
    """The Source the command line names."""
    if args.source == "folder":
        return image_folder(args.root)
    if args.source == "flat":
        return flat_folder(args.root)
    if args.source == "fashion-mnist":
        return fashion_mnist(args.dir, args.split)
    return cifar(args.root, args.split, args.labels)


def _written(index: dict[str, Any], out: Path) -> str:
    """`N samples in K shards: <pattern> (index <path>)` for one written set."""
    prefix, count = index["prefix"], len(index["shards"])
    return (
        f"{index['samples']} samples in {count} shards: {out / shard_pattern(prefix, count)} "
        f"(index {out / sidecar_name(prefix)})"
    )


def write(args: argparse.Namespace) -> int:
    """Write the shards (and a held-out set); print what was written and what was skipped."""
    options = WriteOptions(
        shard_samples=args.shard_samples,
        shard_bytes=args.shard_bytes,
        resize_short=args.resize_short,
        image_format=args.image_format,
        quality=args.quality,
        limit=args.limit,
        seed=args.seed if args.shuffle else None,
        overwrite=args.overwrite,
        skip_bad=args.skip_bad,
        progress=not args.no_progress,
    )
    prefix = args.prefix or getattr(args, "split", "train")
    source = load_source(args)
    if args.holdout is None:
        index, skipped = write_shards(source, args.out, prefix, options)
        indexes = [index]
    else:
        kept, held, skipped = write_split(
            source, args.out, prefix, args.holdout_prefix, args.holdout, args.seed, options
        )
        indexes = [kept, held]
    for reason in skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    lines = [_written(index, args.out) for index in indexes]
    if len(lines) == 2:
        lines[1] = f"held out (--seed {args.seed}): {lines[1]}"
    print("\n".join(lines) + f"; {len(skipped)} skipped")
    return 0


def _counts(counter: Counter, name: Callable[[Any], str] = str) -> str:
    """`key: count` pairs, most common first."""
    return ", ".join(f"{name(k)}: {n}" for k, n in sorted(counter.items(), key=lambda kv: -kv[1]))


def render(report: Inspection) -> str:
    """The summary: the samples of each shard, the total, the classes, image sizes and modes."""
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


def inspect(args: argparse.Namespace) -> int:
    """Print the summary; list the problems found, one line each, and then exit 1."""
    report = inspect_shards(args.shards, verify=args.verify)
    print(render(report))
    for problem in report.problems:
        print(problem, file=sys.stderr)
    if report.problems:
        print(f"mpp: {len(report.problems)} problems found", file=sys.stderr)
        return 1
    if args.verify:
        print(f"verified: {report.total} samples decode and match the index")
    return 0


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)
    return write(args) if args.action == "write" else inspect(args)
