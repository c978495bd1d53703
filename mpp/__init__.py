"""mpp: self-supervised masked patch prediction for Vision Transformers.

    mpp.shards   torch-free: the shard format, the tar reader, image sources, writer, inspector
    mpp.data     shard URLs -> decoded, augmented batches (ShardDataModule)
    mpp.model    the encoder, corruption, targets, pixels, encoders out of checkpoints and exports
    mpp.train    the Lightning modules (pretraining, classification), what runs them, the W&B run
    mpp.eval     few-shot, k-NN and linear-probe evaluation of frozen encoders, Figure 7 analyses
    mpp.commands the `mpp` console script, and its commands shards, export, evaluate, analyse
    mpp.cli      its Lightning runs: fit, validate, test, predict
    mpp.moved    class paths of earlier layouts, as configs and checkpoints may name them -> today's

The public names below are imported on first use, so that `mpp shards`, which needs
none of them, starts without loading torch and Lightning.
"""

from __future__ import annotations

import importlib
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

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mpp' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return __all__
