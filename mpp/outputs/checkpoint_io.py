"""Checkpoint files that are whole or absent: a run killed while writing keeps the previous one.

Lightning writes a local checkpoint to a file in the system's temporary folder and moves it
into place. Where that folder is on another filesystem (a tmpfs /tmp, a container's scratch
disk) the move is a copy, and a kill during the copy leaves a truncated `last.ckpt` in place
of the good one. Here the bytes go to a hidden file next to the target, are flushed to disk,
and replace the target in one rename, which POSIX makes atomic within a folder.

A checkpoint given to resume from is checked first: a file torch cannot load stops the run with
its name, not with the unpickler's KeyError.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.plugins.io import TorchCheckpointIO

from mpp.errors import ConfigError
from mpp.secrets import redact_tree

_HYPERPARAMETERS = ("hyper_parameters", "datamodule_hyper_parameters")


def partial_path(path: Path) -> Path:
    """Where the bytes of `path` are written before they replace it (hidden, not `*.ckpt`)."""
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save to a local `path` so that readers see the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with open(partial, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    # The rename itself lives in the folder's entry: flush it too, or a power cut may undo it.
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic local writes; remote URLs (s3://, gs://) are written
    as Lightning writes them, as one object upload that is whole or absent. The hyperparameters
    a checkpoint carries (shard URLs among them) are stored with credentials masked."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        checkpoint = {
            key: redact_tree(value) if key in _HYPERPARAMETERS else value for key, value in checkpoint.items()
        }
        protocol = get_filesystem(path).protocol
        local = "file" in (protocol if isinstance(protocol, tuple) else (protocol,))
        if storage_options is not None or not local:
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_torch_save(checkpoint, str(path).removeprefix("file://"))


def check_checkpoint(path: Any) -> None:
    """A `--ckpt_path` that is a local file must be one torch can load, or the run stops naming it."""
    if (
        not isinstance(path, (str, os.PathLike))
        or str(path) in ("last", "best", "hpc", "registry")
        or "://" in str(path)
    ):
        return
    file = Path(path)
    if not file.exists():
        raise ConfigError(
            f"--ckpt_path {file} does not exist; give a .ckpt file, or `last` to resume "
            "from the run folder's last checkpoint"
        )
    if file.is_dir():
        raise ConfigError(f"--ckpt_path {file} is a folder; give a .ckpt file in it, or `last`")
    with open(file, "rb") as stream:
        head = stream.read(4)
    if not (zipfile.is_zipfile(file) or head[:1] == b"\x80"):  # torch.save: a zip archive, or a legacy pickle
        raise ConfigError(
            f"--ckpt_path {file} is not a checkpoint (a file written by torch.save, such as "
            "checkpoints/last.ckpt); give a .ckpt file, or `last`"
        )
