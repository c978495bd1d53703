"""Few-shot (section 4.1), k-NN and linear-probe accuracy of any mpp checkpoint's frozen encoder, as markdown tables.

Examples:
    mpp evaluate runs/demo/pretrain/checkpoints/last.ckpt \\
        --train 'shards/fashion-mnist/train-{000000..000009}.tar' --test shards/fashion-mnist/test-000000.tar
    mpp evaluate runs/demo/finetune/checkpoints/last.ckpt --train ... --test ... --shots 1 5 --seeds 5

The encoder's class-token representation of every image is computed once (in the precision `mpp fit`
takes on this device, unless --precision names one); the n-shot accuracy is a ridge classifier's
from n examples of each class, averaged over --seeds draws (section 4.1 of the ViT paper); k-NN and
the linear probe use every training image read. The defaults are those of the FewShotEvaluation callback, so
both give a checkpoint the same numbers.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from mpp.commands import DEFAULT, checkpoint_file, command_parser, positive_count
from mpp.eval.frozen import FrozenScores, evaluate_checkpoint
from mpp.eval.linear import DEFAULTS, FewShotSettings
from mpp.model.pixels import pair


def render(path: str, scores: FrozenScores, settings: FewShotSettings) -> str:
    """The markdown tables: one row per n, then k-NN and the linear probe from all the training labels."""
    lines = [
        f"Few-shot linear accuracy of {path} ({scores.train} train / {scores.test} test images, mean of {settings.seeds} seeds)",
        "",
        "| shots | accuracy |",
        "|---:|---:|",
    ]
    lines += [f"| {n} | {100 * accuracy:.1f}% |" for n, accuracy in scores.fewshot.items()]
    lines += [
        "",
        f"| all {scores.train} training labels | accuracy |",
        "|---|---:|",
        f"| k-NN (k={settings.knn_k}, temperature {settings.knn_temperature:g}) | {100 * scores.knn:.1f}% |",
        f"| linear probe (l2 {scores.linear_l2:g}, chosen on {100 * settings.probe_held_out:g}% held out) | {100 * scores.linear:.1f}% |",
    ]
    return "\n".join(lines)


def argument_parser() -> argparse.ArgumentParser:
    """The command's options; the defaults are the callback's (mpp.eval.linear.DEFAULTS), so that both give
    a checkpoint the same numbers."""
    parser = command_parser("evaluate", __doc__)
    parser.add_argument("checkpoint", help="a .ckpt written by MaskedPatchPretraining or ImageClassifier")
    parser.add_argument("--train", required=True, help="labelled shards the n-shot examples are drawn from")
    parser.add_argument("--test", required=True, help="labelled shards the accuracy is measured on")
    parser.add_argument(
        "--shots", type=positive_count, nargs="+", default=list(DEFAULTS.shots), help=f"n, examples per class{DEFAULT}"
    )
    parser.add_argument(
        "--seeds", type=positive_count, default=DEFAULTS.seeds, help=f"draws of the n examples, averaged{DEFAULT}"
    )
    parser.add_argument("--num-classes", type=int, help="K (default: the largest label seen + 1)")
    parser.add_argument(
        "--max-train", type=int, default=DEFAULTS.max_train, help=f"training samples read, in shard order{DEFAULT}"
    )
    parser.add_argument(
        "--max-test", type=int, default=DEFAULTS.max_test, help=f"test samples read, in shard order{DEFAULT}"
    )
    parser.add_argument("--image-size", type=int, nargs="+", help="H [W] (default: the encoder's)")
    parser.add_argument("--l2", type=float, default=DEFAULTS.l2, help=f"few-shot ridge regulariser{DEFAULT}")
    parser.add_argument("--knn-k", type=int, default=DEFAULTS.knn_k, help=f"k-NN: the neighbours that vote{DEFAULT}")
    parser.add_argument(
        "--knn-temperature",
        type=float,
        default=DEFAULTS.knn_temperature,
        help=f"k-NN: T of a vote exp(cosine similarity / T){DEFAULT}",
    )
    parser.add_argument(
        "--probe-l2s",
        type=float,
        nargs="+",
        default=list(DEFAULTS.probe_l2s),
        help=f"linear probe: the ridge regularisers to choose from{DEFAULT}",
    )
    parser.add_argument(
        "--probe-held-out",
        type=float,
        default=DEFAULTS.probe_held_out,
        help=f"linear probe: the fraction of the training features its l2 is chosen on{DEFAULT}",
    )
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


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)

    image_size = None
    if args.image_size:
        image_size = pair(args.image_size[0] if len(args.image_size) == 1 else args.image_size)
    settings = replace(
        DEFAULTS,
        shots=tuple(args.shots),
        seeds=args.seeds,
        max_train=args.max_train,
        max_test=args.max_test,
        l2=args.l2,
        knn_k=args.knn_k,
        knn_temperature=args.knn_temperature,
        probe_l2s=tuple(args.probe_l2s),
        probe_held_out=args.probe_held_out,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        eval_crop_fraction=args.eval_crop_fraction,
    )
    scores = evaluate_checkpoint(
        checkpoint_file(args.checkpoint),
        train=args.train,
        test=args.test,
        settings=settings,
        num_classes=args.num_classes,
        image_size=image_size,
        device=args.device,
        precision=args.precision,
    )
    print(render(args.checkpoint, scores, settings))
    return 0
