"""Our encoder's weights in the layouts of timm's `VisionTransformer` and Hugging Face's `ViTModel`,
and back: an export is a folder of `model.safetensors` and `config.json` that either library loads.

The three layouts hold the same tensors under other names, but for one: Hugging Face splits our fused
qkv projection, whose output rows are q, then k, then v (heads inside each), into query, key and
value. Files keep the names Hugging Face has always written (`encoder.layer.{i}...`); transformers 5
renames them as it loads. `mpp.model.checkpoint.load_encoder` reads exports back.

A hybrid encoder (a ResNet stem) exports to timm only, and only with a stem one of timm's registered
hybrids builds: timm's builders fix the stem, and Hugging Face's ViTModel has none.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from torch import Tensor

from mpp.model.pixels import pair
from mpp.model.vit import ViTConfig

Layout = Literal["timm", "hf"]
LAYOUT_NAMES: dict[Layout, str] = {"timm": "timm VisionTransformer", "hf": "Hugging Face ViTModel"}
# Tensors of the module that wrote a checkpoint but not of its encoder (the MPP head, the mask
# token) go into an export under this prefix, and only when asked (tools/export.py --with-head).
EXTRA_PREFIX = "mpp."

# timm models whose builders set nothing but these sizes (timm 1.0), so that the name alone says the
# architecture: name -> (dim, depth, heads, patch, image). Each has mlp_dim = 4 dim and 3 channels.
TIMM_MODELS = {
    f"vit_{size}_patch{patch}_{image}": (dim, depth, heads, patch, image)
    for size, (dim, depth, heads), variants in [
        ("tiny", (192, 12, 3), [(16, 224), (16, 384)]),
        ("small", (384, 12, 6), [(32, 224), (32, 384), (16, 224), (16, 384), (8, 224)]),
        ("base", (768, 12, 12), [(32, 224), (32, 384), (16, 224), (16, 384), (8, 224)]),
        ("large", (1024, 24, 16), [(32, 224), (32, 384), (16, 224), (16, 384), (14, 224)]),
        ("huge", (1280, 32, 16), [(14, 224)]),
    ]
    for patch, image in variants
}
# timm builds any plain ViT from a registered name whose sizes its `model_args` override.
_TIMM_CARRIER = "vit_base_patch16_224"
# timm's hybrids (ResNet-v2 stems of width 64, 1 x 1 patches, timm 1.0): name -> (stem layers, dim,
# depth, heads, image). The name fixes the stem; `model_args` may override the other sizes.
TIMM_HYBRIDS = {
    "vit_base_r50_s16_224": ((3, 4, 9), 768, 12, 12, 224),
    "vit_base_r50_s16_384": ((3, 4, 9), 768, 12, 12, 384),
    "vit_small_r26_s32_224": ((2, 2, 2, 2), 384, 12, 6, 224),
    "vit_large_r50_s32_224": ((3, 4, 6, 3), 1024, 24, 16, 224),
}
TIMM_STEM_WIDTH = 64

_HF_TOP = {
    "cls_token": "embeddings.cls_token",
    "pos_embed": "embeddings.position_embeddings",
    "patch_embed.weight": "embeddings.patch_embeddings.projection.weight",
    "patch_embed.bias": "embeddings.patch_embeddings.projection.bias",
    "norm.weight": "layernorm.weight",
    "norm.bias": "layernorm.bias",
}
_HF_BLOCK = {
    "norm1": "layernorm_before",
    "attn.qkv": "attention.attention.{query,key,value}",  # one mpp tensor, three Hugging Face ones
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
# Tensors a file may hold beside an encoder: classifier heads, Hugging Face's pooler, our extras.
_NOT_ENCODER = {"timm": re.compile(r"head\.|mpp\."), "hf": re.compile(r"classifier\.|pooler\.|mpp\.")}


def names_in(layout: Layout, name: str) -> list[str]:
    """The names our tensor `name` has in `layout`: one, or Hugging Face's query, key and value for qkv."""
    if layout == "timm":
        if name.startswith("stem."):  # timm's backbone holds the root as `stem`, the stages beside it
            inner = name.removeprefix("stem.")
            return ["patch_embed.backbone." + (inner if inner.startswith("stages.") else "stem." + inner)]
        return [name.replace("patch_embed.", "patch_embed.proj.", 1) if name.startswith("patch_embed.") else name]
    if name in _HF_TOP:
        return [_HF_TOP[name]]
    block = _BLOCK.fullmatch(name)
    if block is None or block[2] not in _HF_BLOCK:
        raise KeyError(f"{name} is no tensor of the mpp encoder")
    index, part, kind = block.groups()
    inner = _HF_BLOCK[part]
    parts = [inner.replace("{query,key,value}", qkv) for qkv in ("query", "key", "value")] if "{" in inner else [inner]
    return [f"encoder.layer.{index}.{p}.{kind}" for p in parts]


def to_layout(weights: Mapping[str, Tensor], layout: Layout) -> dict[str, Tensor]:
    """Our encoder's state dict -> the same tensors named as `layout` names them."""
    out = {}
    for name, value in weights.items():
        names = names_in(layout, name)
        # Clones: chunks share their storage, which safetensors refuses to write.
        pieces = value.chunk(3) if len(names) == 3 else (value,)
        out.update({n: piece.clone() for n, piece in zip(names, pieces)})
    return out


def from_layout(tensors: Mapping[str, Tensor], layout: Layout, own: Sequence[str]) -> dict[str, Tensor]:
    """`layout`'s tensors (every one of `own`, our names, present) -> our encoder's state dict."""
    return {name: torch.cat([tensors[n] for n in names_in(layout, name)]) for name in own}


def encoder_tensors(tensors: Mapping[str, Tensor]) -> tuple[Layout, dict[str, Tensor]]:
    """A timm or Hugging Face state dict -> its layout and its encoder's tensors (no heads, no pooler)."""
    if any(name.startswith("vit.embeddings.") for name in tensors):  # ViTForImageClassification
        tensors = {name.removeprefix("vit."): value for name, value in tensors.items()}
    layout: Layout
    if "patch_embed.proj.weight" in tensors:
        layout = "timm"
    elif "embeddings.patch_embeddings.projection.weight" in tensors:
        layout = "hf"
    else:
        raise ValueError(
            "it is neither a timm ViT (patch_embed.proj.weight) nor a Hugging Face ViTModel "
            f"(embeddings.patch_embeddings.projection.weight); its first tensors are {sorted(tensors)[:5]}"
        )
    return layout, {name: value for name, value in tensors.items() if not _NOT_ENCODER[layout].match(name)}


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


def config_from_timm(saved: Mapping[str, Any]) -> dict[str, Any]:
    """timm's `config.json` -> our encoder's config fields; refuses what a plain ViT is not."""
    pretrained = saved.get("pretrained_cfg", saved)  # older files hold the pretrained_cfg alone
    args = dict(saved.get("model_args") or {})
    architecture = saved.get("architecture")
    sizes: dict[str, Any] = {"mlp_ratio": 4.0, "in_chans": 3, "img_size": 224}  # timm's own defaults
    stem = None
    if architecture in TIMM_MODELS:
        dim, depth, heads, patch, image = TIMM_MODELS[architecture]
        sizes.update(embed_dim=dim, depth=depth, num_heads=heads, patch_size=patch, img_size=image)
    elif architecture in TIMM_HYBRIDS:
        layers, dim, depth, heads, image = TIMM_HYBRIDS[architecture]
        sizes.update(embed_dim=dim, depth=depth, num_heads=heads, patch_size=1, img_size=image)
        stem = {"layers": layers, "width": TIMM_STEM_WIDTH}
    if pretrained.get("input_size"):
        channels, *image_size = pretrained["input_size"]
        sizes.update(in_chans=channels, img_size=image_size)
    sizes.update(args)
    unknown = [k for k in ("embed_dim", "depth", "num_heads", "patch_size") if k not in sizes]
    if unknown:
        raise ValueError(f"timm architecture {architecture!r} is not one mpp knows, and model_args lack {unknown}")
    if sizes.get("act_layer") not in (None, "gelu"):
        raise ValueError(f"timm model_args act_layer {sizes['act_layer']!r}: the mpp encoder has exact GELU")
    return {
        "image_size": pair(sizes["img_size"]),
        "patch_size": pair(sizes["patch_size"]),
        "channels": sizes["in_chans"],
        "dim": sizes["embed_dim"],
        "depth": sizes["depth"],
        "heads": sizes["num_heads"],
        "mlp_dim": int(sizes["embed_dim"] * sizes["mlp_ratio"]),  # as timm computes it
        "stem": stem,
    }


_HF_FIELDS = {
    "hidden_size": "dim",
    "num_hidden_layers": "depth",
    "num_attention_heads": "heads",
    "intermediate_size": "mlp_dim",
    "num_channels": "channels",
    "image_size": "image_size",
    "patch_size": "patch_size",
}


def config_from_hf(saved: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' `config.json` -> our encoder's config fields; refuses what our encoder does not compute."""
    wrong = [f"{k} is missing" for k in _HF_FIELDS if k not in saved]
    if saved.get("model_type", "vit") != "vit":
        wrong.append(f"model_type {saved['model_type']!r} is not 'vit'")
    if saved.get("hidden_act", "gelu") != "gelu":
        wrong.append(f"hidden_act {saved['hidden_act']!r} is not 'gelu' (exact, as the mpp encoder's)")
    # transformers' own ViTs have 1e-12: as good as our 1e-6 for activations of unit scale.
    if saved.get("layer_norm_eps", 1e-12) > 1e-5:
        wrong.append(f"layer_norm_eps {saved['layer_norm_eps']} is far from the mpp encoder's 1e-6")
    if wrong:
        raise ValueError("its config.json describes no encoder mpp can build: " + "; ".join(wrong))
    fields = {ours: saved[theirs] for theirs, ours in _HF_FIELDS.items()}
    return {**fields, "image_size": pair(fields["image_size"]), "patch_size": pair(fields["patch_size"])}


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
