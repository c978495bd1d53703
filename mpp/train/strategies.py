"""FSDP for the ViT: Lightning's FSDPStrategy with one transformer block per shard unit.

Lightning's `auto_wrap_policy` takes a set of module classes, a type a YAML config cannot
spell; this strategy fixes it to the ViT block, so `configs/trainer/fsdp.yaml` can name it.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import FSDPStrategy

from mpp.model.vit import Block


class BlockFSDPStrategy(FSDPStrategy):
    """Fully sharded data parallel, sharding each ViT `Block` as its own unit.

    Args:
        activation_checkpointing: recompute each block's activations in the backward pass
            instead of keeping them (less memory, about a third more compute).
        kwargs: FSDPStrategy's other arguments (sharding_strategy, state_dict_type, ...).
    """

    def __init__(self, *, activation_checkpointing: bool = False, **kwargs: Any) -> None:
        super().__init__(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if activation_checkpointing else None,
            **kwargs,
        )
