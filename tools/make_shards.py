"""Write WebDataset shards (plus a JSON sidecar) from an image folder, FashionMNIST or CIFAR.

Examples:
    python tools/make_shards.py fashion-mnist --split train --limit 10000 --out shards/fashion-mnist
    python tools/make_shards.py folder path/to/imagenet/train --prefix train --out shards/imagenet \\
        --resize-short 256 --format jpg --shuffle --seed 0
    python tools/make_shards.py flat path/to/photos --prefix unlabeled --out shards/photos
    python tools/make_shards.py cifar path/to/cifar-100-python --split test --labels coarse \\
        --out shards/cifar100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpp.shards import WriteOptions, write_shards
from mpp.sources import FASHION_MNIST_DIR, ShardError, Source, cifar, fashion_mnist, flat_folder, image_folder


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: a source subcommand, then options shared by every source."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, required=True, help="directory for shards and sidecar")
    common.add_argument("--prefix", help="shard name prefix (default: the split, or 'train')")
    common.add_argument("--shard-samples", type=_positive, default=1000, metavar="N",
                        help="samples per shard (default 1000)")
    common.add_argument("--shard-bytes", type=_positive, metavar="N",
                        help="start a new shard rather than pass this size")
    common.add_argument("--resize-short", type=_positive, metavar="N",
                        help="resize so the short side is N px")
    common.add_argument("--format", choices=("png", "jpg"), default="png", dest="image_format")
    common.add_argument("--quality", type=int, default=95, help="JPEG quality, 1-100 (default 95)")
    common.add_argument("--limit", type=_positive, metavar="N", help="take only the first N images")
    common.add_argument("--shuffle", action="store_true", help="shuffle sample order before sharding")
    common.add_argument("--seed", type=int, default=0, help="seed of --shuffle")
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
    fmnist.add_argument("--dir", type=Path, default=FASHION_MNIST_DIR,
                        help=f"directory of the IDX files (default: {FASHION_MNIST_DIR})")
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


def main(argv: list[str] | None = None) -> int:
    """Write the shards; print a summary, or the error naming the bad file."""
    args = parse_args(argv)
    options = WriteOptions(shard_samples=args.shard_samples, shard_bytes=args.shard_bytes,
                           resize_short=args.resize_short, image_format=args.image_format,
                           quality=args.quality, limit=args.limit,
                           seed=args.seed if args.shuffle else None, overwrite=args.overwrite,
                           skip_bad=args.skip_bad, progress=not args.no_progress)
    prefix = args.prefix or getattr(args, "split", "train")
    try:
        sidecar, skipped = write_shards(load_source(args), args.out, prefix, options)
    except ShardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for reason in skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    last = len(sidecar["shards"]) - 1
    pattern = f"{prefix}-000000.tar" if last == 0 else f"{prefix}-{{000000..{last:06d}}}.tar"
    print(f"{sidecar['samples']} samples in {last + 1} shards: {args.out / pattern} "
          f"(sidecar {args.out / (prefix + '.json')}); {len(skipped)} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
