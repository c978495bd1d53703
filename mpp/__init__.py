"""mpp: self-supervised masked patch prediction for Vision Transformers.

The public names below are imported on first use, so that the shard tools, which need
none of them, start without loading torch and Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "ViT": "mpp.vit",
    "ViTConfig": "mpp.vit",
    "patchify": "mpp.vit",
    "CorruptedPatches": "mpp.corruption",
    "CorruptionConfig": "mpp.corruption",
    "corrupt_patches": "mpp.corruption",
    "TargetConfig": "mpp.targets",
    "mean_colour_targets": "mpp.targets",
    "downsized_colour_targets": "mpp.targets",
    "pixel_targets": "mpp.targets",
    "OptimizerConfig": "mpp.optim",
    "MaskedPatchPretraining": "mpp.pretrain",
    "ImageClassifier": "mpp.classify",
    "ShardDataModule": "mpp.data",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mpp' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return __all__
