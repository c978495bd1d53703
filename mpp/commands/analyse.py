"""The ViT paper's Figure 7 analyses (section 4.5) of mpp checkpoints' encoders, as pictures and JSON.

Draws the principal components of the patch-embedding filters, the similarity of the position
embeddings, the mean attention distance of every head and the class token's attention over a
few images, for one checkpoint or several side by side.

Examples:
    mpp analyse runs/demo/pretrain/checkpoints/last.ckpt --out runs/analysis
    mpp analyse runs/demo/{pretrain,scratch,finetune}/checkpoints/last.ckpt \\
        --names MPP scratch fine-tuned \\
        --images shards/fashion-mnist/test-000000.tar --out runs/analysis --num-images 64

Writes, under --out: filters-<name>.png and positions-<name>.png for each checkpoint,
attention-distance.png (every encoder on one plot), attention-maps.png (a row per encoder) and
analysis.json (every number but the position similarities, which the positions pictures show).
Each encoder sees the same first images of the shards, at its own image size and channels. Without
--images, they are the first checkpoint's validation shards (its data.val, else data.test), as its run
named them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch

from mpp.commands import DEFAULT, checkpoint_file, command_parser
from mpp.errors import ConfigError
from mpp.eval.analyses import DEFAULTS, Analysis, analyse, sized_images
from mpp.eval.figures import distance_figure, filters_figure, maps_figure, positions_figure, save_pictures
from mpp.model.checkpoint import encoder_and_normalisation, read_checkpoint


def default_names(paths: list[str]) -> list[str]:
    """A short name for each checkpoint: the fewest trailing parts of its path (less `.ckpt` and
    `checkpoints/`) that tell them apart, e.g. pretrain-last and finetune-last."""
    parts = [[p for p in Path(path).with_suffix("").parts if p != "checkpoints"] for path in paths]
    for length in range(1, max(len(p) for p in parts) + 1):
        names = ["-".join(p[-length:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [f"{index + 1}" for index in range(len(paths))]  # the same file given twice


def file_name(name: str) -> str:
    """An encoder's name as it may appear in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def validation_shards(path: str) -> Any:
    """The shards a checkpoint's run validated on (its data.val, else data.test), as the run named them."""
    data = read_checkpoint(path).get("datamodule_hyper_parameters", {})
    shards = data.get("val") or data.get("test")
    if not shards:
        raise ConfigError(f"{path} names no validation or test shards: give the images with --images <shards>")
    return shards


def analyse_checkpoint(path: str, images: Any, args: argparse.Namespace) -> Analysis:
    """One checkpoint's encoder analysed on the first --num-images images of the shards."""
    encoder, normalise = encoder_and_normalisation(path)
    images = sized_images(images, encoder.config, args.num_images, batch_size=args.batch_size)
    return analyse(
        encoder.to(args.device),
        images,
        normalise=normalise.to(args.device),
        components=args.components,
        map_images=args.map_images,
        batch_size=args.batch_size,
    )


def argument_parser() -> argparse.ArgumentParser:
    """The command's options; the defaults are EncoderAnalysis's (mpp.eval.analyses.DEFAULTS)."""
    parser = command_parser("analyse", __doc__)
    parser.add_argument(
        "checkpoints", nargs="+", help=".ckpt files written by MaskedPatchPretraining or ImageClassifier"
    )
    parser.add_argument(
        "--names", nargs="+", help="one per checkpoint, for legends and file names (default: from the paths)"
    )
    parser.add_argument(
        "--images", help="shards the attention is measured on (default: the first checkpoint's validation shards)"
    )
    parser.add_argument("--out", required=True, type=Path, help="folder the pictures and analysis.json are written to")
    parser.add_argument(
        "--num-images", type=int, default=DEFAULTS.num_images, help=f"images read, in shard order{DEFAULT}"
    )
    parser.add_argument(
        "--map-images", type=int, default=DEFAULTS.map_images, help=f"images the attention maps show{DEFAULT}"
    )
    parser.add_argument("--components", type=int, default=DEFAULTS.components, help=f"filter components drawn{DEFAULT}")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help=f"images per forward pass{DEFAULT}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)
    names = args.names or default_names(args.checkpoints)
    if len(names) != len(args.checkpoints) or len({file_name(name) for name in names}) != len(names):
        raise ConfigError(
            f"--names needs one name per checkpoint, distinct in file names: "
            f"{len(args.checkpoints)} checkpoints, names {names}"
        )
    paths = [checkpoint_file(path) for path in args.checkpoints]
    images = args.images or validation_shards(paths[0])
    analyses = {name: analyse_checkpoint(path, images, args) for name, path in zip(names, paths)}
    if not args.images:
        count = next(iter(analyses.values())).num_images
        print(f"images: the first {count} of {images}, the validation shards of {paths[0]}")
    pictures = {}
    for name, analysis in analyses.items():
        pictures[f"filters-{file_name(name)}"] = filters_figure(analysis.components, analysis.explained, title=name)
        pictures[f"positions-{file_name(name)}"] = positions_figure(analysis.similarity, title=name)
    pictures["attention-distance"] = distance_figure({name: a.distances for name, a in analyses.items()})
    pictures["attention-maps"] = maps_figure({name: (a.images, a.maps) for name, a in analyses.items()})
    save_pictures(pictures, args.out)
    numbers = {
        "images": images,
        "left_out": "position-embedding similarities, (gh, gw, gh, gw) per encoder: positions-<name>.png draws them",
        "encoders": {
            name: {"checkpoint": path, **analyses[name].numbers()} for name, path in zip(names, args.checkpoints)
        },
    }
    (args.out / "analysis.json").write_text(json.dumps(numbers, indent=1))
    for name, analysis in analyses.items():
        blocks = ", ".join(f"{d:.1f}" for d in analysis.distances.mean(1).tolist())
        print(f"{name}: mean attention distance per block (pixels): {blocks}")
    print(f"wrote {len(pictures)} pictures and analysis.json to {args.out}")
    return 0
