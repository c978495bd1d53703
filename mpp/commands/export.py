"""Export the encoder of an mpp checkpoint for timm or Hugging Face transformers: model.safetensors and config.json.

Examples:
    mpp export runs/demo/pretrain/checkpoints/last.ckpt --format hf --out exports/demo-hf
    mpp export runs/demo/pretrain/checkpoints/last.ckpt --format timm --out exports/demo-timm

Load an export with `transformers.ViTModel.from_pretrained("exports/demo-hf", add_pooling_layer=False)`
or `timm.create_model("local-dir:exports/demo-timm", pretrained=True)`; either computes the encoder's
y = LN(z_L^0) as the class token's output. Each library's own preprocessing (`AutoImageProcessor`, or
timm's `create_transform(**resolve_data_config({}, model=m))`) does what the checkpoint's evaluation did:
the shorter side resized to cover the crop (data.eval_crop_fraction), a centre crop, the normalisation. Fine-tune
from one with `--model.init_args.pretrained exports/demo-hf`.

`--with-head` adds the checkpoint's other tensors (MaskedPatchPretraining: the MPP head `mpp.head.weight`,
`mpp.head.bias` and the mask token `mpp.mask_token`; ImageClassifier: its classifier as `mpp.head.*`) to
model.safetensors, and the settings that give them their meaning (target and corruption; num_classes
and class_names) to config.json under "mpp". The
libraries do not know these tensors: transformers reports them as unused, and timm loads such a file
only with `pretrained_strict=False`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mpp.commands import checkpoint_file, command_parser
from mpp.errors import ConfigError
from mpp.model.checkpoint import checkpoint_normalisation, load_encoder, read_checkpoint
from mpp.model.export import write_export
from mpp.model.layouts import EXTRA_PREFIX, LAYOUT_NAMES, Layout


def export(path: str, *, layout: Layout, out: str, with_head: bool) -> list[str]:
    """Write the checkpoint's encoder (and with `with_head` its other tensors) as `layout` into `out`."""
    checkpoint = read_checkpoint(path)
    encoder = load_encoder(path, checkpoint=checkpoint)
    checkpoint_normalisation(path, checkpoint=checkpoint).check_channels(encoder.config.channels)
    hyper = checkpoint["hyper_parameters"]  # there: checkpoint_normalisation read it
    extras, settings = {}, {}
    if with_head:
        extras = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("encoder.")}
        settings = {k: hyper[k] for k in ("target", "corruption", "num_classes", "class_names") if k in hyper}
    written = write_export(
        out,
        encoder.state_dict(),
        encoder.config,
        layout,
        mean=hyper["pixel_mean"],
        std=hyper["pixel_std"],
        # The checkpoint's own evaluation crop; a module trained without the shard data module: the whole image.
        crop_fraction=checkpoint.get("datamodule_hyper_parameters", {}).get("eval_crop_fraction", 1.0),
        extras=extras,
        extra_config=settings,
    )
    return [str(file) for file in written]


def argument_parser() -> argparse.ArgumentParser:
    parser = command_parser("export", __doc__)
    parser.add_argument("checkpoint", help="a .ckpt written by MaskedPatchPretraining or ImageClassifier")
    parser.add_argument(
        "--format", required=True, choices=("timm", "hf"), help="timm, or hf for transformers' ViTModel"
    )
    parser.add_argument("--out", required=True, help="the folder to write (made if missing; its files are replaced)")
    parser.add_argument(
        "--with-head",
        action="store_true",
        help=f"also write the checkpoint's head and mask token, as {EXTRA_PREFIX}* tensors",
    )
    return parser


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file: give a folder to write the export into (made if missing)")
    try:
        written = export(checkpoint_file(args.checkpoint), layout=args.format, out=args.out, with_head=args.with_head)
    except ValueError as error:  # not an mpp checkpoint, or an encoder the format cannot hold: exit code 2
        raise ConfigError(str(error)) from error
    print(f"{LAYOUT_NAMES[args.format]} export of {args.checkpoint}:")
    print("\n".join(f"  {file}" for file in written))
    return 0
