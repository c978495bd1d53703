"""Write WebDataset shards (plus a JSON sidecar) from an image folder, FashionMNIST or CIFAR.

Examples:
    python tools/make_shards.py fashion-mnist --split train --limit 10000 --out shards/fashion-mnist
    python tools/make_shards.py folder path/to/imagenet/train --prefix train --out shards/imagenet \\
        --resize-short 256 --format jpg --shuffle --seed 0
    python tools/make_shards.py flat path/to/photos --prefix unlabeled --out shards/photos
    python tools/make_shards.py cifar path/to/cifar-100-python --split test --labels coarse \\
        --out shards/cifar100
    python tools/make_shards.py folder path/to/photos --out shards/photos --holdout 0.1 --seed 0

--holdout N (a count) or F (a fraction, 0 < F < 1) holds out a seeded random choice of the
images (after --limit; the same with or without --shuffle) as a second set of shards under
--holdout-prefix (default val), each set with its sidecar; together they are the source.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mpp.shards.format import ShardError, shard_pattern, sidecar_name
from mpp.shards.sources import (
    FASHION_MNIST_DIR,
    Source,
    cifar,
    fashion_mnist,
    flat_folder,
    image_folder,
)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: a source subcommand, then options shared by every source."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, required=True, help="directory for shards and sidecar")
    common.add_argument("--prefix", help="shard name prefix (default: the split, or 'train')")
    common.add_argument(
        "--shard-samples", type=_positive, default=1000, metavar="N", help="samples per shard (default 1000)"
    )
    common.add_argument(
        "--shard-bytes", type=_positive, metavar="N", help="start a new shard rather than pass this size"
    )
    common.add_argument("--resize-short", type=_positive, metavar="N", help="resize so the short side is N px")
    common.add_argument("--format", choices=("png", "jpg"), default="png", dest="image_format")
    common.add_argument("--quality", type=int, default=95, help="JPEG quality, 1-100 (default 95)")
    common.add_argument("--limit", type=_positive, metavar="N", help="take only the first N images")
    common.add_argument("--shuffle", action="store_true", help="shuffle sample order before sharding")
    common.add_argument("--seed", type=int, default=0, help="seed of --shuffle and --holdout")
    common.add_argument(
        "--holdout",
        type=_holdout,
        metavar="N|F",
        help="hold out N images, or a fraction F of them, as a second shard set",
    )
    common.add_argument("--holdout-prefix", default="val", help="prefix of the held-out set (default val)")
    common.add_argument("--overwrite", action="store_true", help="replace existing shards")
    common.add_argument("--skip-bad", action="store_true", help="skip undecodable images, list them")
    common.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sources = parser.add_subparsers(dest="source", required=True)
    folder = sources.add_parser("folder", parents=[common], help="one sub-folder per class")
    folder.add_argument("root", type=Path)
    flat = sources.add_parser("flat", parents=[common], help="unlabeled images, recursively")
    flat.add_argument("root", type=Path)
    fmnist = sources.add_parser("fashion-mnist", parents=[common], help="FashionMNIST IDX files")
    fmnist.add_argument(
        "--dir", type=Path, default=FASHION_MNIST_DIR, help=f"directory of the IDX files (default: {FASHION_MNIST_DIR})"
    )
    fmnist.add_argument("--split", choices=("train", "test"), default="train")
    cifar_ = sources.add_parser("cifar", parents=[common], help="CIFAR-10/100 python pickles")
    cifar_.add_argument("root", type=Path, help="cifar-10-batches-py or cifar-100-python directory")
    cifar_.add_argument("--split", choices=("train", "test"), default="train")
    cifar_.add_argument("--labels", choices=("fine", "coarse"), default="fine", help="CIFAR-100 only")
    return parser.parse_args(argv)


def load_source(args: argparse.Namespace) -> Source:
    """Build the Source the subcommand names."""
    if args.source == "folder":
        return image_folder(args.root)
    if args.source == "flat":
        return flat_folder(args.root)
    if args.source == "fashion-mnist":
        return fashion_mnist(args.dir, args.split)
    return cifar(args.root, args.split, args.labels)


def _summary(sidecar: dict[str, Any], out: Path) -> str:
    """`N samples in K shards: <pattern> (sidecar <path>)` for one written set."""
    prefix, count = sidecar["prefix"], len(sidecar["shards"])
    return (
        f"{sidecar['samples']} samples in {count} shards: {out / shard_pattern(prefix, count)} "
        f"(sidecar {out / sidecar_name(prefix)})"
    )


def main(argv: list[str] | None = None) -> int:
    """Write the shards (and a held-out set); print a summary, or the error naming the bad file."""
    args = parse_args(argv)
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
    try:
        source = load_source(args)
        if args.holdout is None:
            sidecar, skipped = write_shards(source, args.out, prefix, options)
            sidecars = [sidecar]
        else:
            kept, held, skipped = write_split(
                source, args.out, prefix, args.holdout_prefix, args.holdout, args.seed, options
            )
            sidecars = [kept, held]
    except ShardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for reason in skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    lines = [_summary(sidecar, args.out) for sidecar in sidecars]
    if len(lines) == 2:
        lines[1] = f"held out (--seed {args.seed}): {lines[1]}"
    print("\n".join(lines) + f"; {len(skipped)} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
