"""An encoder out of any mpp checkpoint: its config, its `encoder.*` tensors, its normalisation;
or out of a timm or Hugging Face export (mpp.model.export writes them; mpp.model.layouts names
their tensors), its config.json read back as our encoder's config.

MaskedPatchPretraining and ImageClassifier write `encoder_config` (plain data) next to the
state dict; fine-tuning, few-shot evaluation and the tools rebuild the encoder from those
alone, without the module that wrote them.
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from mpp.errors import ConfigError
from mpp.model import layouts
from mpp.model.layouts import TIMM_HYBRIDS, TIMM_MODELS, TIMM_STEM_WIDTH, Layout
from mpp.model.pixels import Normalise, pair
from mpp.model.vit import ViT, ViTConfig
from mpp.moved import current_class_paths

# Settings that shape no tensor: a checkpoint's encoder may differ from the configured one in these.
_NOT_ARCHITECTURE = ("image_size", "dropout", "attention_dropout", "drop_path")


def _architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of an encoder config that decide its tensors, sizes as (height, width)."""
    return {
        name: pair(value) if name == "patch_size" else value
        for name, value in config.items()
        if name not in _NOT_ARCHITECTURE
    }


def read_checkpoint(path: str) -> dict[str, Any]:
    """A checkpoint's contents, tensors on the CPU; nothing but plain data and tensors is unpickled. The
    class path Lightning's CLI records in its hyperparameters is today's where it named an earlier one."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        give = "give a checkpoint written by mpp fit, e.g. runs/<run>/checkpoints/last.ckpt"
        if zipfile.is_zipfile(path):  # what torch.save writes: a checkpoint, of something that is not plain data
            raise ConfigError(
                f"checkpoint {path} holds objects other than tensors and plain data, which mpp does not "
                f"unpickle (they could run code): {give}"
            ) from error
        raise ConfigError(f"{path} is not an mpp checkpoint (torch cannot read it as one): {give}") from error
    if not isinstance(checkpoint, dict):
        raise ConfigError(f"{path} is not an mpp checkpoint (it holds a {type(checkpoint).__name__}, not a dict)")
    if isinstance(checkpoint.get("hyper_parameters"), dict):
        checkpoint["hyper_parameters"] = current_class_paths(
            checkpoint["hyper_parameters"], source=f"checkpoint {path}"
        )
    return checkpoint


def misfit(wanted: Mapping[str, tuple[int, ...]], found: Mapping[str, Tensor]) -> str | None:
    """None if `found` holds exactly the tensors `wanted` names, in those shapes; else what differs."""
    missing = sorted(wanted.keys() - found.keys())
    unexpected = sorted(found.keys() - wanted.keys())
    mismatched = [
        f"{name} {tuple(found[name].shape)} (encoder wants {wanted[name]})"
        for name in sorted(wanted.keys() & found.keys())
        if tuple(found[name].shape) != wanted[name]
    ]
    if not (missing or unexpected or mismatched):
        return None
    return f"missing {missing or 'none'}; unexpected {unexpected or 'none'}; other shapes {mismatched or 'none'}"


def load_encoder(path: str, *, expected: ViTConfig | None = None, checkpoint: dict[str, Any] | None = None) -> ViT:
    """The encoder of a checkpoint written by MaskedPatchPretraining or ImageClassifier, or of a timm or
    Hugging Face export, built at the file's image size; only encoder tensors are read (no heads, no
    mask token).

    Args:
        path: the `.ckpt` file; or an export: a folder with model.safetensors and config.json, or
            a `.safetensors` file.
        expected: the encoder the caller configured; every field but image size, the dropouts and drop path
            must match the file's, and its dropout is used (and its heads, for an export that
            does not say them).
        checkpoint: the `.ckpt` file's contents, where the caller has read them already.
    """
    if is_export(path):
        config, weights = read_export(path, heads=expected.heads if expected is not None else None)
    else:
        config, weights = _checkpoint_encoder(path, checkpoint if checkpoint is not None else read_checkpoint(path))
    if expected is not None:
        wanted, found = _architecture(asdict(expected)), _architecture(asdict(config))
        differing = [
            f"encoder.{k}: configured {wanted[k]}, checkpoint {found[k]}" for k in wanted if wanted[k] != found[k]
        ]
        if differing:
            raise ValueError(
                f"the encoder of checkpoint {path} does not match the configured one: " + "; ".join(differing)
            )
        config = ViTConfig(**{**asdict(expected), "image_size": config.image_size})
    encoder = ViT(config)
    problem = misfit({name: tuple(value.shape) for name, value in encoder.state_dict().items()}, weights)
    if problem:
        raise ValueError(f"the encoder tensors of checkpoint {path} do not fit the encoder: {problem}")
    encoder.load_state_dict(weights, strict=True)
    return encoder


def _checkpoint_encoder(path: str, checkpoint: dict[str, Any]) -> tuple[ViTConfig, dict[str, Tensor]]:
    """An mpp checkpoint's encoder config and `encoder.*` tensors (the prefix removed)."""
    if "encoder_config" not in checkpoint or "state_dict" not in checkpoint:
        raise ValueError(
            f"checkpoint {path} has no encoder_config or state_dict: give a checkpoint written by "
            "MaskedPatchPretraining or ImageClassifier (runs/<name>/checkpoints/*.ckpt), or a timm or "
            "Hugging Face export (a folder, or a .safetensors file)"
        )
    saved = {
        f.name: checkpoint["encoder_config"][f.name]
        for f in fields(ViTConfig)
        if f.name in checkpoint["encoder_config"]
    }
    weights = {k.removeprefix("encoder."): v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
    return ViTConfig(**saved), weights


def is_export(path: str) -> bool:
    """Whether `path` names a timm or Hugging Face export (a folder or a .safetensors file), not an mpp .ckpt."""
    return Path(path).is_dir() or path.endswith(".safetensors")


def read_export(path: str, *, heads: int | None = None) -> tuple[ViTConfig, dict[str, Tensor]]:
    """A timm or Hugging Face export -> our encoder's config and state dict, every tensor checked in
    the file's own names.

    Args:
        path: a folder with model.safetensors and config.json, or a .safetensors file (with the
            config.json beside it, if there is one).
        heads: the attention heads to assume where no config.json says them.
    """
    file = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"export {path} has no {file.name}")
    with safe_open(str(file), framework="pt") as opened:
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}
    try:
        layout, tensors = layouts.encoder_tensors(tensors)
        saved_config = file.parent / "config.json"
        saved = json.loads(saved_config.read_text()) if saved_config.is_file() else None
        hybrid = any(name.startswith("patch_embed.backbone.") for name in tensors)
        if saved is None:
            found = _config_from_shapes(tensors, layout, heads) if not hybrid else {}
        else:
            found = config_from_timm(saved) if layout == "timm" else config_from_hf(saved)
        if hybrid and found.get("stem") is None:
            raise ValueError(
                "it is a timm hybrid ViT whose stem mpp cannot tell: give its config.json, naming one of "
                f"{', '.join(TIMM_HYBRIDS)}"
            )
        config = ViTConfig(**found)
    except ValueError as error:
        raise ValueError(f"export {path}: {error}") from error
    with torch.device("meta"):  # names and shapes only: no memory, no initialisation
        own = ViT(config).state_dict()
    problem = misfit({name: tuple(value.shape) for name, value in layouts.to_layout(own, layout).items()}, tensors)
    if problem:
        raise ValueError(
            f"the tensors of {layouts.LAYOUT_NAMES[layout]} export {path} do not fit its encoder: {problem}"
        )
    return config, layouts.from_layout(tensors, layout, list(own))


def _config_from_shapes(tensors: Mapping[str, Tensor], layout: Layout, heads: int | None) -> dict[str, Any]:
    """The config fields a bare state dict's shapes say; heads, which no shape says, come from the caller."""

    def shape(name: str) -> tuple[int, ...]:
        (theirs, *_) = layouts.names_in(layout, name)
        if theirs not in tensors:
            raise ValueError(f"it has no {theirs}")
        return tuple(tensors[theirs].shape)

    dim, channels, patch_h, patch_w = shape("patch_embed.weight")
    depth = 0
    while layouts.names_in(layout, f"blocks.{depth}.norm1.weight")[0] in tensors:
        depth += 1
    patches = shape("pos_embed")[1] - 1
    grid = math.isqrt(patches)
    if grid * grid != patches:
        raise ValueError(f"its {patches} position embeddings are for a grid that is not square: give its config.json")
    if heads is None:
        raise ValueError("no tensor says the number of attention heads: give its config.json, or configure the encoder")
    return {
        "image_size": (grid * patch_h, grid * patch_w),
        "patch_size": (patch_h, patch_w),
        "channels": channels,
        "dim": dim,
        "depth": depth,
        "heads": heads,
        "mlp_dim": shape("blocks.0.mlp.fc1.weight")[0],
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


def checkpoint_normalisation(path: str, *, checkpoint: dict[str, Any] | None = None) -> Normalise:
    """The input normalisation the checkpoint's module was trained with."""
    hyper = (checkpoint if checkpoint is not None else read_checkpoint(path)).get("hyper_parameters", {})
    if "pixel_mean" not in hyper or "pixel_std" not in hyper:
        raise ValueError(f"checkpoint {path} records no pixel_mean / pixel_std hyperparameters")
    return Normalise(mean=hyper["pixel_mean"], std=hyper["pixel_std"])


def encoder_and_normalisation(path: str) -> tuple[ViT, Normalise]:
    """A checkpoint's encoder (at its image size) and input normalisation, the file read once."""
    checkpoint = read_checkpoint(path)
    encoder = load_encoder(path, checkpoint=checkpoint)
    normalise = checkpoint_normalisation(path, checkpoint=checkpoint)
    normalise.check_channels(encoder.config.channels)
    return encoder, normalise
