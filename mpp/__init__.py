"""mpp: self-supervised masked patch prediction for Vision Transformers."""

from mpp.corruption import CorruptedPatches, CorruptionConfig, corrupt_patches
from mpp.optim import OptimizerConfig
from mpp.pretrain import MaskedPatchPretraining
from mpp.targets import TargetConfig, downsized_colour_targets, mean_colour_targets, pixel_targets
from mpp.vit import ViT, ViTConfig, patchify

__all__ = [
    "CorruptedPatches",
    "CorruptionConfig",
    "MaskedPatchPretraining",
    "OptimizerConfig",
    "TargetConfig",
    "ViT",
    "ViTConfig",
    "corrupt_patches",
    "downsized_colour_targets",
    "mean_colour_targets",
    "patchify",
    "pixel_targets",
]
