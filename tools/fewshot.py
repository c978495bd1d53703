"""Few-shot linear accuracy (section 4.1) of any mpp checkpoint's frozen encoder, as a markdown table.

Examples:
    python tools/fewshot.py runs/demo/pretrain/checkpoints/last.ckpt \\
        --train 'shards/fashion-mnist/train-{000000..000009}.tar' --test shards/fashion-mnist/test-000000.tar
    python tools/fewshot.py runs/demo/finetune/checkpoints/last.ckpt --train ... --test ... --shots 1 5 --seeds 5
"""

from __future__ import annotations

import argparse
import sys

import torch

from mpp.eval.fewshot import evaluate_checkpoint
from mpp.eval.linear import DEFAULTS
from mpp.model.pixels import pair


def render(path: str, results: dict[int, float], *, seeds: int, train: int, test: int) -> str:
    """The markdown table: one row per n."""
    lines = [
        f"Few-shot linear accuracy of {path} ({train} train / {test} test images, mean of {seeds} seeds)",
        "",
        "| shots | accuracy |",
        "|---:|---:|",
    ]
    lines += [f"| {n} | {100 * accuracy:.1f}% |" for n, accuracy in results.items()]
    return "\n".join(lines)


DEFAULT = " (default: %(default)s)"


def argument_parser() -> argparse.ArgumentParser:
    """The tool's options; the defaults are the callback's (mpp.eval.fewshot.DEFAULTS), so that both give
    a checkpoint the same numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a .ckpt written by MaskedPatchPretraining or ImageClassifier")
    parser.add_argument("--train", required=True, help="labelled shards the n-shot examples are drawn from")
    parser.add_argument("--test", required=True, help="labelled shards the accuracy is measured on")
    parser.add_argument(
        "--shots", type=int, nargs="+", default=list(DEFAULTS.shots), help=f"n, examples per class{DEFAULT}"
    )
    parser.add_argument("--seeds", type=int, default=DEFAULTS.seeds, help=f"draws of the n examples, averaged{DEFAULT}")
    parser.add_argument("--num-classes", type=int, help="K (default: the largest label seen + 1)")
    parser.add_argument(
        "--max-train", type=int, default=DEFAULTS.max_train, help=f"training samples read, in shard order{DEFAULT}"
    )
    parser.add_argument(
        "--max-test", type=int, default=DEFAULTS.max_test, help=f"test samples read, in shard order{DEFAULT}"
    )
    parser.add_argument("--image-size", type=int, nargs="+", help="H [W] (default: the encoder's)")
    parser.add_argument("--l2", type=float, default=DEFAULTS.l2, help=f"ridge regulariser{DEFAULT}")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help=f"images per forward pass{DEFAULT}")
    parser.add_argument(
        "--num-workers",
        type=int,
        default=DEFAULTS.num_workers,
        help=f"DataLoader workers; more reorder the samples, and so change the numbers{DEFAULT}",
    )
    parser.add_argument(
        "--eval-crop-fraction",
        type=float,
        default=DEFAULTS.eval_crop_fraction,
        help=f"as data.eval_crop_fraction{DEFAULT}",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        help="of the features (default: what `mpp fit` takes on this device when a config names none)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)

    image_size = None
    if args.image_size:
        image_size = pair(args.image_size[0] if len(args.image_size) == 1 else args.image_size)
    try:
        results, train, test = evaluate_checkpoint(
            args.checkpoint,
            train=args.train,
            test=args.test,
            shots=args.shots,
            seeds=args.seeds,
            num_classes=args.num_classes,
            max_train=args.max_train,
            max_test=args.max_test,
            image_size=image_size,
            l2=args.l2,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            eval_crop_fraction=args.eval_crop_fraction,
            device=args.device,
            precision=args.precision,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(render(args.checkpoint, results, seeds=args.seeds, train=train, test=test))
    return 0


if __name__ == "__main__":
    sys.exit(main())
