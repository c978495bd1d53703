"""What the console shows: mpp's own lines, Lightning's progress and real warnings, and not the
chatter of the libraries underneath; and the introduction `mpp --help` opens with.

Each message is silenced where it is made (its logger, its warning text, or the argument that
causes it), never by hiding a whole class of warnings.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

from jsonargparse import DefaultHelpFormatter
from pytorch_lightning.loggers import WandbLogger

from mpp.commands.names import COMMANDS, RUN_COMMANDS
from mpp.internals import drop_unset_anonymous


class _DropLitLoggerTip(logging.Filter):
    """Lightning's advertisement for its own logging service, logged at INFO with its progress lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


def quiet_console(debug: bool = False) -> None:
    """Set up logging for `mpp`: its own logger at INFO, other libraries' at WARNING.

    - The root logger stays at WARNING: botocore's "Found credentials in environment
      variables." (INFO, at every loader start on S3) and the like stay out.
    - gcsfs logs every request that ran out of its retries with a traceback, then raises; mpp's
      error names the URL, so gcsfs's own log is kept for `debug`.
    - Lightning's litlogger tip goes; its other lines ("GPU available", "Seed set") stay.
    - torch's deprecation of `LeafSpec`, which Lightning's own pytree helper still uses, goes;
      so does the model summary's note that it counts bf16-mixed parameters at 32 bits, which
      they are (bf16-mixed keeps float32 weights).
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("mpp").setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        rank_zero = logging.getLogger(name)  # Lightning's rank_zero_info logs through one of the two
        if not any(isinstance(f, _DropLitLoggerTip) for f in rank_zero.filters):
            rank_zero.addFilter(_DropLitLoggerTip())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"Precision bf16-mixed is not supported by the model summary")


def quiet_wandb(loggers: list[Any]) -> None:
    """Two warnings of wandb.init that Lightning's WandbLogger causes.

    - It passes `anonymous=None`, and wandb warns that the setting has no effect whenever it is
      given at all: it is left out where it is None.
    - wandb looks for the git repository from the run's folder and warns "git root ... does not
      exist" where the folder is not made yet (the first run in a place): it is made now.
    """
    for logger in loggers:
        if not isinstance(logger, WandbLogger):
            continue
        drop_unset_anonymous(logger)
        if logger.save_dir:
            Path(logger.save_dir).mkdir(parents=True, exist_ok=True)


EXAMPLES = (
    ("pretrain a small ViT on the embedded sample, no labels", "mpp fit --config configs/pretrain/demo.yaml"),
    ("fine-tune its encoder on labels", "mpp fit --config configs/finetune/demo.yaml"),
    ("the same classifier from scratch, to compare", "mpp fit --config configs/scratch/demo.yaml"),
)


def configs_folder() -> Path | None:
    """The shipped configs: `configs/` here, else next to the package (a source checkout)."""
    for folder in (Path("configs"), Path(__file__).resolve().parent.parent / "configs"):
        if folder.is_dir():
            return folder
    return None


def introduction() -> str:
    """What `mpp --help` says before the options: what mpp is, its configs, three commands."""
    lines = [
        "mpp: masked patch prediction for Vision Transformers. Pretrain a ViT without labels by",
        "corrupting 50% of its patch embeddings and predicting each corrupted patch's 3-bit mean",
        "colour, from WebDataset shards on disk, HTTP(S), S3 or GCS; fine-tune the encoder on labels",
        "and compare it with the same classifier trained from scratch.",
        "",
    ]
    folder = configs_folder()
    if folder is not None:
        lines.append("shipped configs (a trainer preset first, then a run config; later files win):")
        from mpp.config import read_config

        sizes_of = {path: read_config(path) for path in folder.glob("model/*.yaml")}  # a hybrid's: its ViT's and a stem
        # Small to large; a hybrid after its ViT.
        presets = sorted(sizes_of, key=lambda path: (sizes_of[path].get("dim", 0), "stem" in sizes_of[path], path.name))
        for path in sorted(set(folder.glob("*/*.yaml")) - set(presets)):
            first = (path.read_text().splitlines() or [""])[0].lstrip("# ").strip()
            about = re.split(r" \(|: |\. |; ", first, maxsplit=1)[0].rstrip(".")
            about = about if len(about) <= 60 else about[:60].rsplit(" ", 1)[0] + " ..."
            lines.append(f"  {path.as_posix():<36} {about}")
        if presets:
            sizes = ",".join(p.stem.removeprefix("vit_") for p in presets)
            lines.append(
                f"  {(folder / 'model').as_posix() + '/vit_{' + sizes + '}.yaml':<36} "
                "encoder sizes, e.g. --model.encoder configs/model/vit_l.yaml"
            )
        lines.append("")
    lines.append("commands (`mpp <command> --help` for each):")
    about = {**RUN_COMMANDS, **{name: what for name, (_, what) in COMMANDS.items()}}
    lines += [f"  {name:<9} {what}" for name, what in about.items()]
    lines += ["", "examples:"]
    wide = max(len(command) for _, command in EXAMPLES)
    lines += [f"  {command:<{wide}}  # {what}" for what, command in EXAMPLES]
    lines += [
        "",
        "`mpp fit --help` lists the trainer's and data's options; a module's own options are behind",
        "`mpp fit --model.help mpp.MaskedPatchPretraining` (or mpp.ImageClassifier), e.g.",
        "`--model.init_args.corruption.ratio 0.15`. Add --traceback (or set MPP_DEBUG=1) to see the",
        "traceback of an error.",
    ]
    return "\n".join(lines)


class Introduced(DefaultHelpFormatter):
    """jsonargparse's help format, keeping the line breaks of the introduction."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))
