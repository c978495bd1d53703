"""How much of a [mask]ed token's colour reaches a hybrid encoder through its stem.

A pure ViT's [mask]ed token holds none of its patch's pixels: whatever the model predicts for it
comes from the other tokens. A hybrid's stem sees every pixel, and its receptive field spans more
than one token, so the features of a masked token's neighbours hold part of its colour. With the
transformer blocks frozen at their random init (`MaskedPatchPretraining(frozen=["encoder.blocks"])`),
the blocks cannot learn to infer a colour from the context; what the head predicts for a [mask]ed
token then comes through the embedding (and stem), the blocks' fixed mixing and the final norm. The
hybrid's [mask]ed accuracy above the pure ViT's there is the leak; `corruption.mask_pixels` blanks
the masked tokens' pixels before the stem, and should take it away.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mpp.model.corruption import KEPT, MASKED, REPLACED
from mpp.model.pixels import to_unit_range

KINDS = {"masked": MASKED, "replaced": REPLACED, "kept": KEPT}


@torch.no_grad()
def accuracy_by_kind(module: Any, images: Tensor, *, seed: int = 0, batch_size: int = 250) -> dict[str, Any]:
    """MPP accuracy of a `MaskedPatchPretraining` on (N, C, H, W) images, per kind of corrupted token.

    One draw of corruption per image from a generator seeded by `seed`, so that modules scored with the
    same seed see the same corrupted tokens. Returns, for each of `masked`, `replaced`, `kept` and `all`,
    the share of right predictions and the number of tokens, and `majority`: the share of [mask]ed
    tokens whose target is the most common target among them (always guessing that class).
    """
    if module.target.kind == "pixels":
        raise ValueError("accuracy_by_kind needs class targets; target.kind is pixels")
    was_training = module.training
    module.eval()
    right = dict.fromkeys([*KINDS, "all"], 0)
    total = dict.fromkeys([*KINDS, "all"], 0)
    masked_targets = []
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for chunk in images.split(batch_size):
            output = module(to_unit_range(chunk))
            hits = output.predictions.argmax(dim=-1) == output.targets
            kinds = output.corrupted.kinds
            if hits.dim() > kinds.dim():  # several predictions per token (downsized colours)
                kinds = kinds.unsqueeze(-1).expand_as(hits)
            for name, kind in KINDS.items():
                chosen = kinds == kind
                right[name] += int(hits[chosen].sum())
                total[name] += int(chosen.sum())
            right["all"] += int(hits.sum())
            total["all"] += hits.numel()
            masked_targets.append(output.targets[kinds == MASKED])
    finally:
        torch.random.set_rng_state(state)
        module.train(was_training)
    targets = torch.cat(masked_targets)
    majority = float(torch.bincount(targets).max() / len(targets)) if len(targets) else float("nan")
    scores: dict[str, Any] = {
        name: {"accuracy": right[name] / total[name] if total[name] else float("nan"), "tokens": total[name]}
        for name in total
    }
    scores["majority"] = majority
    return scores
