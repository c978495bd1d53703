"""Our encoder's tensors as timm's `VisionTransformer` and Hugging Face's `ViTModel` name them, and the
sizes of timm's registered ViTs.

The three layouts hold the same tensors under other names, but for one: Hugging Face splits our fused
qkv projection, whose output rows are q, then k, then v (heads inside each), into query, key and
value. Files keep the names Hugging Face has always written (`encoder.layer.{i}...`); transformers 5
renames them as it loads. mpp.model.export writes exports in these layouts; mpp.model.checkpoint
reads them back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

Layout = Literal["timm", "hf"]
LAYOUT_NAMES: dict[Layout, str] = {"timm": "timm VisionTransformer", "hf": "Hugging Face ViTModel"}
# Tensors of the module that wrote a checkpoint but not of its encoder (the MPP head, the mask
# token) go into an export under this prefix, and only when asked (mpp export --with-head).
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
