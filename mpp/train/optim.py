"""Optimisers and the warmup + cosine learning-rate schedule, built in one place for every
module: the paper's pretraining (Adam), fine-tuning (SGD with momentum) and from-scratch
(Adam, high weight decay) recipes differ only by these settings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimiser and schedule.

    Args:
        name: `adamw` (Adam with decoupled weight decay) or `sgd` (with momentum).
        lr: peak learning rate, reached at the end of the warmup.
        weight_decay: applied to weight matrices only (linear and convolution weights);
            biases, norms, the class token and the embeddings are never decayed.
        betas: Adam's β1, β2.
        momentum: SGD's momentum.
        warmup_steps: linear warmup from 0 to `lr`.
        final_lr: learning rate at the last step, reached by cosine decay.
        reference_batch_size: the global batch `lr` and `final_lr` are meant for; the run's own
            global batch (nodes x devices x data.batch_size x accumulate_grad_batches) scales
            them by `lr_scaling`. null: `lr` is used as given, whatever the batch.
        lr_scaling: `linear` (lr x batch / reference) or `sqrt` (lr x sqrt(batch / reference)).
        layer_decay: layer-wise learning-rate decay, as MAE and BEiT fine-tune (0.65-0.85): block i of
            the encoder's L (from 1) learns at lr x layer_decay^(L + 1 - i), its embeddings (a hybrid's
            stem too) at lr x layer_decay^(L + 1), its final norm, the head and anything else outside
            the encoder at lr. 1: every parameter at lr (the paper's recipes).
    """

    name: Literal["adamw", "sgd"]
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    warmup_steps: int = 0
    final_lr: float = 0.0
    reference_batch_size: int | None = None
    lr_scaling: Literal["linear", "sqrt"] = "linear"
    layer_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optimizer.name must be adamw or sgd, got {self.name!r}")
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be non-negative, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be non-negative, got {self.warmup_steps}")
        if not 0.0 <= self.final_lr <= self.lr:
            raise ValueError(f"optimizer.final_lr must be in [0, lr], got {self.final_lr}")
        if self.reference_batch_size is not None and self.reference_batch_size < 1:
            raise ValueError(
                f"optimizer.reference_batch_size must be positive or null, got {self.reference_batch_size}"
            )
        if self.lr_scaling not in ("linear", "sqrt"):
            raise ValueError(f"optimizer.lr_scaling must be linear or sqrt, got {self.lr_scaling!r}")
        if not 0.0 < self.layer_decay <= 1.0:
            raise ValueError(f"optimizer.layer_decay must be in (0, 1], got {self.layer_decay}")

    def lr_factor(self, global_batch_size: int | None) -> float:
        """How much `lr` is scaled for a run whose global batch is `global_batch_size`."""
        if self.reference_batch_size is None:
            return 1.0
        if global_batch_size is None:
            raise ValueError(
                "optimizer.reference_batch_size is set but the run's global batch is unknown: "
                "the data module must have a batch_size (ShardDataModule has)"
            )
        ratio = global_batch_size / self.reference_batch_size
        return ratio if self.lr_scaling == "linear" else math.sqrt(ratio)


def parameter_groups(model: nn.Module, weight_decay: float, *, layer_decay: float = 1.0) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (weight matrices) and an undecayed one (the rest); with
    `layer_decay` < 1, each of those by depth in `model.encoder` (`lr_scale`: layer_decay^(top - depth)),
    the top first."""
    decayed = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Linear, nn.Conv2d)) and module.weight.requires_grad
    }
    params = [p for p in model.parameters() if p.requires_grad]
    if layer_decay == 1.0:
        return [
            {"params": [p for p in params if id(p) in decayed], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0},
        ]
    encoder = getattr(model, "encoder", None)
    if not hasattr(encoder, "parameter_depths"):
        raise ValueError(f"optimizer.layer_decay needs a module with a ViT `encoder`; {type(model).__name__} has none")
    named = dict(encoder.named_parameters())  # type: ignore[union-attr]
    depth_of = {id(named[name]): depth for name, depth in encoder.parameter_depths().items()}  # type: ignore[union-attr]
    top = encoder.config.depth + 1  # type: ignore[union-attr]
    groups = []
    for depth in range(top, -1, -1):
        for in_decayed, decay in ((True, weight_decay), (False, 0.0)):
            chosen = [p for p in params if depth_of.get(id(p), top) == depth and (id(p) in decayed) == in_decayed]
            if chosen:
                groups.append({"params": chosen, "weight_decay": decay, "lr_scale": layer_decay ** (top - depth)})
    return groups


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, final_ratio: float) -> float:
    """Multiplier of the peak learning rate at `step`: linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def configure_optimizer(
    model: nn.Module, config: OptimizerConfig, total_steps: int, global_batch: int | None = None, *, fused: bool = True
) -> dict[str, Any]:
    """The optimiser and its per-step schedule, in the form `configure_optimizers` returns.

    `global_batch` scales the learning rate where the config names a reference batch size;
    `fused` allows the fused implementation where the parameters' device has one.
    """
    lr = config.lr * config.lr_factor(global_batch)
    groups = parameter_groups(model, config.weight_decay, layer_decay=config.layer_decay)
    for group in groups:  # the schedule multiplies each group's own lr
        group["lr"] = lr * group.pop("lr_scale", 1.0)
    # Fused kernels on a GPU (one launch for all parameters) and on the CPU (a loop per tensor in
    # C++: a fifth of the time of torch's default there for the demo's AdamW).
    devices = {p.device.type for g in groups for p in g["params"]}
    kwargs = {"fused": True} if fused and devices in ({"cuda"}, {"cpu"}) else {}
    if config.name == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=lr, betas=config.betas, **kwargs)
    else:
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=config.momentum, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_cosine(
            step, warmup_steps=config.warmup_steps, total_steps=total_steps, final_ratio=config.final_lr / config.lr
        ),
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
