"""mpp: self-supervised masked patch prediction for Vision Transformers.

    mpp.shards   torch-free: the shard format, the tar reader, image sources, writer, inspector
    mpp.data     shard URLs -> decoded, augmented batches (ShardDataModule)
    mpp.model    the encoder, corruption, targets, pixels, encoders out of checkpoints
    mpp.train    the Lightning modules (pretraining, classification) and what runs them
    mpp.eval     few-shot evaluation, W&B records
    mpp.cli      the `mpp` console script

The public names below are imported on first use, so that the shard tools, which need
none of them, start without loading torch and Lightning. The modules' names from before
the subpackages (`mpp.fewshot`, `mpp.callbacks.ProgressBar`, ...) still import, with a
FutureWarning naming the new one, so that saved configs keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

_PUBLIC = {
    "ViT": "mpp.model.vit",
    "ViTConfig": "mpp.model.vit",
    "patchify": "mpp.model.pixels",
    "CorruptedPatches": "mpp.model.corruption",
    "CorruptionConfig": "mpp.model.corruption",
    "corrupt_patches": "mpp.model.corruption",
    "TargetConfig": "mpp.model.targets",
    "mean_colour_targets": "mpp.model.targets",
    "downsized_colour_targets": "mpp.model.targets",
    "pixel_targets": "mpp.model.targets",
    "OptimizerConfig": "mpp.train.optim",
    "MaskedPatchPretraining": "mpp.train.pretrain",
    "ImageClassifier": "mpp.train.classify",
    "ShardDataModule": "mpp.data.module",
}

# Modules of the flat layout -> where they live now. `mpp.data` and `mpp.shards` kept their
# names as packages, which hand on the old modules' public names.
MOVED = {
    "mpp.vit": "mpp.model.vit",
    "mpp.corruption": "mpp.model.corruption",
    "mpp.targets": "mpp.model.targets",
    "mpp.images": "mpp.model.pixels",
    "mpp.pretrain": "mpp.train.pretrain",
    "mpp.classify": "mpp.train.classify",
    "mpp.optim": "mpp.train.optim",
    "mpp.guards": "mpp.train.nonfinite_loss",
    "mpp.callbacks": "mpp.train.callbacks",
    "mpp.pictures": "mpp.train.prediction_pictures",
    "mpp.strategies": "mpp.train.strategies",
    "mpp.checkpointing": "mpp.train.checkpoint_io",
    "mpp.wandb_run": "mpp.train.wandb_run",
    "mpp.fewshot": "mpp.eval.fewshot",
    "mpp.wandb_records": "mpp.train.wandb_records",
    "mpp.stream": "mpp.data.stream",
    "mpp.transforms": "mpp.data.transforms",
    "mpp.storage": "mpp.data.remote",
    "mpp.tarstream": "mpp.shards.tar",
    "mpp.sources": "mpp.shards.sources",
    "mpp.inspection": "mpp.shards.inspector",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mpp' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return __all__


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module that now holds its code (the same object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} is now {MOVED[spec.name]}: name the new module in configs and imports",
            FutureWarning,
            stacklevel=2,
        )
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module ran already, under its new name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
