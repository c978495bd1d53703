"""What a study is set to: its arms, the pretraining objectives of its ablation, its splits and its
settings (seeds, steps, learning-rate grids), saved as settings.json in the study's folder.

Arms (`ARMS`): from scratch (the fine-tuning steps); from scratch with matched compute (pretraining
plus fine-tuning steps); MPP pretrained on the unlabelled pool, then fine-tuned; supervised pretraining
on labelled images the fine-tuning set does not hold, then fine-tuned; and the hybrid encoder (the
ViT on a ResNet stem) from scratch and MPP pretrained, then fine-tuned. The ablation of the pretraining
objective (`VARIANTS`) is judged by few-shot accuracy of the frozen encoder on the validation split.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

ARMS = {
    "scratch": "from scratch",
    "matched": "from scratch, matched compute",
    "mpp": "MPP pretrained, fine-tuned",
    "supervised": "supervised pretrained, fine-tuned",
    "hybrid_scratch": "hybrid from scratch",
    "hybrid_mpp": "hybrid MPP pretrained, fine-tuned",
}
# The run config (a key of Settings.configs) of each arm's fine-tuning or from-scratch runs.
ARM_CONFIGS = {"scratch": "scratch", "matched": "scratch", "mpp": "finetune", "supervised": "finetune",
               "hybrid_scratch": "hybrid_scratch", "hybrid_mpp": "hybrid_finetune"}  # fmt: skip
FROM_SCRATCH = ("scratch", "matched", "hybrid_scratch")
PRETRAINED = ("mpp", "supervised", "hybrid_mpp")
# The paired differences reported, first − second, where a budget has both arms.
PAIRS = [("mpp", "scratch"), ("mpp", "matched"), ("supervised", "mpp"), ("hybrid_mpp", "hybrid_scratch"),
         ("hybrid_mpp", "mpp"), ("hybrid_scratch", "scratch")]  # fmt: skip
# The arms of a study saved before settings named their arms.
FIRST_ARMS = ("scratch", "matched", "mpp", "supervised")


@dataclass(frozen=True)
class Variant:
    """A pretraining objective of the ablation: overrides of the pretraining config."""

    name: str
    label: str
    overrides: tuple[str, ...] = ()


TARGET = "--model.init_args.target."
VARIANTS = (
    Variant("colour3", "3-bit mean colour, 50% corrupted (default)"),
    Variant("ratio15", "3-bit mean colour, 15% corrupted", ("--model.init_args.corruption.ratio", "0.15")),
    Variant(
        "downsized4",
        "4×4 downsized patch, 3-bit colours",
        (TARGET + "kind", "downsized_colour", TARGET + "cells", "4"),
    ),
    Variant("pixels", "L2 on normalised pixels", (TARGET + "kind", "pixels")),
    Variant("grey5", "5-bit mean colour (32 grey levels)", (TARGET + "bits", "5")),
)
DEFAULT_VARIANT = VARIANTS[0].name


@dataclass(frozen=True)
class Splits:
    """Shard specs of every split. `labels[b]`: the fine-tuning set of label budget b;
    `supervised[b]`: labelled images not in `labels[b]` for supervised pretraining (a budget without
    one has no supervised arm); `pool`: the unlabelled pretraining images; `val`: every choice."""

    pool: str
    val: str
    test: str
    labels: dict[int, str]
    supervised: dict[int, str]


@dataclass(frozen=True)
class Settings:
    splits: Splits
    # run configs: pretrain, finetune, scratch, and for the hybrid arms hybrid_pretrain, hybrid_finetune, hybrid_scratch
    configs: dict[str, str]
    seeds: tuple[int, ...]
    pretrain_steps: int
    finetune_steps: int
    finetune_lrs: tuple[float, ...]
    scratch_lrs: tuple[float, ...]
    ablation: tuple[str, ...]  # variants besides the default, pretrained with the first ablation_seeds
    ablation_seeds: int
    shots: tuple[int, ...] = (10, 25)
    overrides: tuple[str, ...] = ()  # for every fit, e.g. a smaller batch
    checkpoint_every: int = 100
    frozen_max_train: int = 10000  # labelled images a frozen evaluation learns from, at most
    selected_arms: tuple[str, ...] = tuple(ARMS)  # supervised runs only for budgets with a supervised split

    @property
    def budgets(self) -> list[int]:
        return sorted(self.splits.labels)

    @property
    def val_every(self) -> int:
        """Validation interval: the largest divisor of every run's length up to 100, so that every
        run validates at its last step (matched compute runs pretrain + fine-tune steps)."""
        common = math.gcd(self.pretrain_steps, self.finetune_steps)
        return max(d for d in range(1, min(common, 100) + 1) if common % d == 0)

    def arms(self, budget: int) -> list[str]:
        return [
            arm
            for arm in ARMS
            if arm in self.selected_arms and (arm != "supervised" or budget in self.splits.supervised)
        ]

    def lrs(self, arm: str) -> tuple[float, ...]:
        return self.scratch_lrs if arm in FROM_SCRATCH else self.finetune_lrs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_runs(cls, configs: dict[str, str], *, test: str = "", **read: Any) -> Settings:
        """The settings of a harness user that is not a study of arms and budgets (experiments.compare,
        experiments.leakage): only what its jobs read, the test shards and e.g. `checkpoint_every`,
        `shots`, `frozen_max_train`; no splits, seeds or grids to choose from."""
        splits = Splits(pool="", val="", test=test, labels={}, supervised={})
        return cls(splits, configs, seeds=(), pretrain_steps=0, finetune_steps=0, finetune_lrs=(), scratch_lrs=(),
                   ablation=(), ablation_seeds=0, **read)  # fmt: skip

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Settings:
        """The settings a study saved (settings.json), as they were: a study saved before settings named
        their arms has FIRST_ARMS."""
        splits = values["splits"]
        by_budget = {key: {int(b): shards for b, shards in splits[key].items()} for key in ("labels", "supervised")}
        tuples = ("seeds", "finetune_lrs", "scratch_lrs", "ablation", "shots", "overrides")
        return cls(
            **{
                **values,
                **{key: tuple(values[key]) for key in tuples if key in values},
                "splits": Splits(splits["pool"], splits["val"], splits["test"], **by_budget),
                "selected_arms": tuple(values.get("selected_arms", FIRST_ARMS)),
            }
        )
