"""The lines a run prints: what trains, on what and where before it starts; where its checkpoints,
W&B records and pictures are after it ends; and how to resume it, from the checkpoints that are there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import WandbLogger

from mpp.model.vit import ViTConfig
from mpp.outputs.wandb_records import run_folders
from mpp.outputs.wandb_run import finish_quietly
from mpp.train.steps import global_batch_size


def patches_of(encoder: ViTConfig) -> str:
    """What the encoder's tokens are cut from, for the summary."""
    if encoder.stem is None:
        return f"{encoder.patch_size} px patches"
    stem = encoder.stem
    return (
        f"{encoder.patch_size} patches of a ResNet stem (layers {list(stem.layers)}, width {stem.width}, "
        f"stride {stem.stride}): tokens of {list(encoder.token_size)} px"
    )


def run_summary(trainer: pl.Trainer, model: pl.LightningModule, data: Any, *, precision_note: str = "") -> str:
    """The first lines a user reads: what trains, on what, where, and where the results go."""
    params = sum(p.numel() for p in model.parameters())
    encoder = getattr(model, "encoder_config", None)
    checkpoint_dirs = [str(folder) for folder in checkpoint_folders(trainer)]
    lines = [
        f"mpp: {type(model).__name__}, {params / 1e6:.2f}M parameters"
        + (
            f", encoder {encoder.dim}x{encoder.depth} ({encoder.heads} heads), {patches_of(encoder)} of {encoder.image_size} px images"
            if encoder
            else ""
        ),
        f"mpp: data train={data.hparams.get('train')} val={data.hparams.get('val')}",
        f"mpp: world size {trainer.world_size} ({trainer.num_nodes} node(s) x {trainer.num_devices} device(s)), "
        f"precision {trainer.precision}{precision_note}, max_steps {trainer.max_steps}",
        *batch_and_lr(trainer, model, data),
        f"mpp: run folder {trainer.default_root_dir}; checkpoints in {', '.join(checkpoint_dirs) or 'none'}",
    ]
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            mode = os.environ.get("WANDB_MODE", "online")
            if mode == "disabled":
                lines.append("mpp: W&B disabled (WANDB_MODE=disabled): the run logs nothing to W&B")
                continue
            lines.append(
                f"mpp: W&B {mode} in {logger.save_dir}/wandb"
                + (
                    " (no API key found; upload later with `wandb sync <run folder>/wandb/offline-run-*`)"
                    if mode == "offline"
                    else ""
                )
            )
    return "\n".join(lines)


def batch_and_lr(trainer: pl.Trainer, model: pl.LightningModule, data: Any) -> list[str]:
    """The global batch as the product that makes it, and the learning rate it gets."""
    batch = getattr(data, "batch_size", None)
    if batch is None:
        return []
    total = global_batch_size(trainer, data)
    line = (
        f"mpp: global batch {total} = {trainer.num_nodes} node(s) x {trainer.num_devices} device(s) x "
        f"batch {batch} x {trainer.accumulate_grad_batches} accumulated"
    )
    config = getattr(model, "optimizer_config", None)
    if config is not None:
        factor = config.lr_factor(total)
        line += f"; peak lr {config.lr * factor:.4g}"
        if config.reference_batch_size is not None:
            line += (
                f" (optimizer.lr {config.lr:g} for batch {config.reference_batch_size}, {config.lr_scaling} scaling)"
            )
    return [line]


def checkpoint_folders(trainer: pl.Trainer) -> list[Path]:
    """The folders the run's checkpoint callbacks write to (see `name_checkpoint_folders`)."""
    return sorted(
        {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath}
    )


def name_checkpoint_folders(trainer: pl.Trainer) -> None:
    """Give a checkpoint callback without a folder (Lightning's default one, or a config's without `dirpath`)
    the run folder's `checkpoints`, where mpp puts the configs' own: Lightning would choose one only once
    fitting starts, after the run has said where its checkpoints go."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = os.path.realpath(Path(trainer.default_root_dir) / "checkpoints")


def last_checkpoints(trainer: pl.Trainer) -> list[str]:
    """The `last*.ckpt` files in the run's checkpoint folders: what `--ckpt_path last` resumes from (the
    files Lightning looks for there: named from the callback's CHECKPOINT_NAME_LAST and FILE_EXTENSION)."""
    found: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            fs = get_filesystem(callback.dirpath)
            if fs.isdir(callback.dirpath):
                names = fs.ls(callback.dirpath, detail=False)
                found |= {os.path.normpath(name) for name in names if is_last(callback, Path(name).name)}
    return sorted(found)


def is_last(callback: ModelCheckpoint, name: str) -> bool:
    last = callback.CHECKPOINT_NAME_LAST or "last"
    return name.startswith(last) and name.endswith(callback.FILE_EXTENSION)


def resume_hint(trainer: pl.Trainer) -> str:
    """How to go on from where a run stopped, from the checkpoints that are there."""
    if last_checkpoints(trainer):
        return "resume with --ckpt_path last"
    written = [path for folder in checkpoint_folders(trainer) if folder.is_dir() for path in folder.glob("*.ckpt")]
    if written:
        return f"resume with --ckpt_path {max(written, key=lambda path: path.stat().st_mtime)}"
    return f"no checkpoint in {folders_of(trainer)} to resume from: running it again starts at step 0"


def folders_of(trainer: pl.Trainer) -> str:
    return ", ".join(str(folder) for folder in checkpoint_folders(trainer)) or "no checkpoint folder"


def results_summary(trainer: pl.Trainer) -> str:
    """Where a finished run left its checkpoints, W&B records and pictures. Its W&B run is finished
    here, without W&B's closing lines, which would say where it is again."""
    lines = []
    for callback in trainer.checkpoint_callbacks:
        last = getattr(callback, "last_model_path", "")
        kept = last or getattr(callback, "best_model_path", "")
        if kept:
            lines.append(f"mpp: checkpoint {kept} (resume with --ckpt_path {'last' if last else kept})")
    if not lines:
        lines.append(f"mpp: {resume_hint(trainer)}")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and os.environ.get("WANDB_MODE") != "disabled":
            run_dir = Path(logger.experiment.dir).parent
            attempts = run_folders(run_dir.parent, logger.experiment.id)
            # A resumed run has a folder per attempt; `wandb sync` given all of them uploads one run.
            shown = run_dir if len(attempts) < 2 else run_dir.parent / f"offline-run-*-{logger.experiment.id}"
            hint = f" (upload with `wandb sync {shown}`)" if os.environ.get("WANDB_MODE") == "offline" else ""
            lines.append(f"mpp: W&B run {run_dir}{hint}")
            finish_quietly(logger.experiment)
    pictures = Path(trainer.default_root_dir) / "pictures"
    if pictures.is_dir():
        lines.append(f"mpp: pictures in {pictures}")
    return "\n".join(lines)
