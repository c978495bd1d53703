"""An encoder written for timm or Hugging Face transformers: a folder of `model.safetensors` (named as
mpp.model.layouts says) and `config.json` (and transformers' `preprocessor_config.json`) that either
library loads, with the evaluation pipeline of the checkpoint it came from.

A hybrid encoder (a ResNet stem) exports to timm only, and only with a stem one of timm's registered
hybrids builds: timm's builders fix the stem, and Hugging Face's ViTModel has none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from mpp.model.layouts import EXTRA_PREFIX, TIMM_HYBRIDS, TIMM_MODELS, TIMM_STEM_WIDTH, Layout, to_layout
from mpp.model.pixels import pair
from mpp.model.vit import ViTConfig

# timm builds any plain ViT from a registered name whose sizes its `model_args` override.
_TIMM_CARRIER = "vit_base_patch16_224"


def per_channel(values: Sequence[float], channels: int) -> list[float]:
    """A normalisation's mean or std with one value per channel, as timm and transformers want them."""
    return [float(v) for v in values] * (channels if len(values) == 1 else 1)


def _size(value: tuple[int, int]) -> int | list[int]:
    return value[0] if value[0] == value[1] else list(value)


def timm_hybrid_carrier(config: ViTConfig) -> str:
    """The first timm hybrid whose builder makes the encoder's stem; refuses a stem none of them makes."""
    stem = config.stem
    assert stem is not None
    carriers = [name for name, (layers, *_) in TIMM_HYBRIDS.items() if layers == stem.layers]
    if stem.width != TIMM_STEM_WIDTH or not carriers:
        known = sorted({str(list(layers)) for layers, *_ in TIMM_HYBRIDS.values()})
        raise ValueError(
            f"timm builds hybrid ViTs only on the stems of its registered models (width {TIMM_STEM_WIDTH}, layers "
            f"{' or '.join(known)}); encoder.stem has layers {list(stem.layers)} and width {stem.width}"
        )
    return carriers[0]


def timm_config(
    config: ViTConfig, mean: Sequence[float], std: Sequence[float], crop_fraction: float = 1.0
) -> dict[str, Any]:
    """timm's `config.json`: a registered model name where ours is one, else the model's sizes as
    `model_args` (for a hybrid, on the registered name that builds its stem); in `pretrained_cfg` the
    evaluation pipeline, so that timm's transform is mpp's: resize to cover size / crop_fraction,
    centre-crop, normalise."""
    (image_h, image_w), patch = pair(config.image_size), pair(config.patch_size)
    if int(config.dim * (config.mlp_dim / config.dim)) != config.mlp_dim:  # timm's rule for the MLP width
        raise ValueError(f"timm cannot build an MLP of encoder.mlp_dim {config.mlp_dim} for encoder.dim {config.dim}")
    square = patch[0] == patch[1] and image_h == image_w
    if config.stem is None:
        carrier = _TIMM_CARRIER
        pure = (config.dim, config.depth, config.heads, patch[0], image_h)
        named = [name for name, model in TIMM_MODELS.items() if model == pure]
    else:
        carrier = timm_hybrid_carrier(config)
        hybrid = (config.stem.layers, config.dim, config.depth, config.heads, image_h)
        named = [name for name, model in TIMM_HYBRIDS.items() if model == hybrid and patch == (1, 1)]
    plain = config.mlp_dim == 4 * config.dim and config.channels == 3 and square
    out: dict[str, Any] = {
        "architecture": named[0] if named and plain else carrier,
        "num_classes": 0,
        "num_features": config.dim,
        "global_pool": "token",
    }
    if not (named and plain):
        out["model_args"] = {
            "img_size": _size((image_h, image_w)),
            "patch_size": _size(patch),
            "in_chans": config.channels,
            "embed_dim": config.dim,
            "depth": config.depth,
            "num_heads": config.heads,
            "mlp_ratio": config.mlp_dim / config.dim,
            "num_classes": 0,
            "global_pool": "token",
        }
    out["pretrained_cfg"] = {
        "input_size": [config.channels, image_h, image_w],
        "fixed_input_size": True,
        "interpolation": "bilinear",  # as the shard pipeline resizes
        "crop_pct": crop_fraction,  # without it timm crops 0.875
        "crop_mode": "center",
        "mean": per_channel(mean, config.channels),
        "std": per_channel(std, config.channels),
        "num_classes": 0,
        "first_conv": "patch_embed.proj" if config.stem is None else "patch_embed.backbone.stem.conv",
        "classifier": "head",
    }
    return out


def hf_config(config: ViTConfig) -> dict[str, Any]:
    """transformers' `config.json` for a `ViTModel` that computes what our encoder does; refuses a hybrid."""
    if config.stem is not None:
        raise ValueError(
            "Hugging Face's ViTModel has no ResNet stem: export a hybrid encoder (encoder.stem) for timm "
            "(--format timm)"
        )
    return {
        "model_type": "vit",
        "architectures": ["ViTModel"],
        "hidden_size": config.dim,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "gelu",  # transformers' "gelu" is the exact one, as ours
        "layer_norm_eps": 1e-6,
        "image_size": _size(pair(config.image_size)),
        "patch_size": _size(pair(config.patch_size)),
        "num_channels": config.channels,
        "qkv_bias": True,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }


def hf_preprocessor_config(
    config: ViTConfig, mean: Sequence[float], std: Sequence[float], crop_fraction: float = 1.0
) -> dict[str, Any]:
    """transformers' `preprocessor_config.json`, the shard pipeline's evaluation: the shorter side resized
    to size / crop_fraction (the aspect kept), a centre crop, [0, 1], then our normalisation. (A ViT
    processor would squash the whole image to size.) Colour images are converted to RGB for a 3-channel
    encoder; a 1-channel encoder expects grey images, which the shard pipeline makes of any image."""
    height, width = pair(config.image_size)
    return {
        "image_processor_type": "BitImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": math.floor(min(height, width) / crop_fraction)},  # as timm rounds it
        "resample": 2,  # bilinear, as the shard pipeline resizes
        "do_center_crop": True,
        "crop_size": {"height": height, "width": width},
        "do_convert_rgb": config.channels == 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": per_channel(mean, config.channels),
        "image_std": per_channel(std, config.channels),
    }


def write_export(
    folder: str | Path,
    weights: Mapping[str, Tensor],
    config: ViTConfig,
    layout: Layout,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    crop_fraction: float = 1.0,
    extras: Mapping[str, Tensor] | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write our encoder's `weights` as `layout`'s model.safetensors and config.json (and, for Hugging Face,
    preprocessor_config.json) into `folder`, with the evaluation pipeline of images normalised by `mean` and
    `std` after a centre crop of `crop_fraction` (data.eval_crop_fraction; 1.0, the whole image, as mpp's
    frozen-encoder evaluations); `extras` go in under `EXTRA_PREFIX`, `extra_config` into the config under
    "mpp". Returns the files written."""
    # The configs first: they refuse an encoder the layout cannot hold before any file is written.
    configs = {"config.json": timm_config(config, mean, std, crop_fraction) if layout == "timm" else hf_config(config)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_layout(weights, layout)
    tensors.update({EXTRA_PREFIX + name: value.clone() for name, value in (extras or {}).items()})
    if extra_config:
        configs["config.json"]["mpp"] = dict(extra_config)
    if layout == "hf":
        configs["preprocessor_config.json"] = hf_preprocessor_config(config, mean, std, crop_fraction)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})  # transformers reads "format"
    for name, content in configs.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    return [folder / "model.safetensors", *(folder / name for name in configs)]
