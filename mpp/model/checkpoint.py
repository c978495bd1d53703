"""An encoder out of any mpp checkpoint: its config, its `encoder.*` tensors, its normalisation.

MaskedPatchPretraining and ImageClassifier write `encoder_config` (plain data) next to the
state dict; fine-tuning, few-shot evaluation and the tools rebuild the encoder from those
alone, without the module that wrote them.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import torch

from mpp.model.pixels import Normalise, pair
from mpp.model.vit import ViT, ViTConfig

# Settings that shape no tensor: a checkpoint's encoder may differ from the configured one in these.
_NOT_ARCHITECTURE = ("image_size", "dropout")


def _architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of an encoder config that decide its tensors, sizes as (height, width)."""
    return {
        name: pair(value) if name == "patch_size" else value
        for name, value in config.items()
        if name not in _NOT_ARCHITECTURE
    }


def read_checkpoint(path: str) -> dict[str, Any]:
    """A checkpoint's contents, tensors on the CPU; nothing but plain data and tensors is unpickled."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_encoder(path: str, *, expected: ViTConfig | None = None, checkpoint: dict[str, Any] | None = None) -> ViT:
    """The encoder of a checkpoint written by MaskedPatchPretraining or ImageClassifier, built at
    the checkpoint's image size; only `encoder.*` tensors are read (no heads, no mask token).

    Args:
        path: the `.ckpt` file.
        expected: the encoder the caller configured; every field but image size and dropout
            must match the checkpoint's, and its dropout is used.
        checkpoint: the file's contents, where the caller has read them already.
    """
    if checkpoint is None:
        checkpoint = read_checkpoint(path)
    if "encoder_config" not in checkpoint or "state_dict" not in checkpoint:
        raise ValueError(
            f"checkpoint {path} has no encoder_config or state_dict: give a checkpoint written by "
            "MaskedPatchPretraining or ImageClassifier (runs/<name>/checkpoints/*.ckpt)"
        )
    saved = {
        f.name: checkpoint["encoder_config"][f.name]
        for f in fields(ViTConfig)
        if f.name in checkpoint["encoder_config"]
    }
    config = ViTConfig(**saved)
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
    weights = {k.removeprefix("encoder."): v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
    own = encoder.state_dict()
    missing = sorted(own.keys() - weights.keys())
    unexpected = sorted(weights.keys() - own.keys())
    mismatched = [
        f"{k} {tuple(weights[k].shape)} (encoder wants {tuple(own[k].shape)})"
        for k in sorted(own.keys() & weights.keys())
        if weights[k].shape != own[k].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"the encoder tensors of checkpoint {path} do not fit the encoder: "
            f"missing {missing or 'none'}; unexpected {unexpected or 'none'}; other shapes {mismatched or 'none'}"
        )
    encoder.load_state_dict(weights, strict=True)
    return encoder


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
