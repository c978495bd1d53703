"""The leakage measurement's parts: `frozen` keeps the named submodules at their initial weights while the
rest learns, and `accuracy_by_kind` scores each kind of corrupted token over one seeded draw."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from workspace import ROOT

from experiments.leakage import accuracy_by_kind
from mpp import MaskedPatchPretraining, OptimizerConfig, ViTConfig
from mpp.config import read_config
from mpp.model.corruption import MASKED

HYBRID = replace(ViTConfig(**read_config(ROOT / "configs/model/vit_demo_hybrid.yaml"), image_size=28, patch_size=1,
                           channels=1), dim=32, depth=2, heads=2, mlp_dim=64)  # fmt: skip
ADAM = OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=1)


def images(count: int = 40, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 1, 28, 28), dtype=torch.uint8, generator=generator)


def test_frozen_blocks_keep_their_initial_weights_while_the_stem_embedding_and_head_learn():
    torch.manual_seed(0)
    module = MaskedPatchPretraining(encoder=HYBRID, optimizer=ADAM, frozen=["encoder.blocks"])
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    optimiser = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimiser.zero_grad()
        module.loss(images()).backward()
        optimiser.step()
    changed = {name for name, p in module.named_parameters() if not torch.equal(p, before[name])}
    blocks = {name for name in before if name.startswith("encoder.blocks.")}
    assert blocks and not changed & blocks
    assert {"head.weight", "mask_token", "encoder.patch_embed.weight", "encoder.pos_embed"} <= changed
    assert any(name.startswith("encoder.stem.") for name in changed)
    assert module.hparams["frozen"] == ["encoder.blocks"]


def test_frozen_names_a_submodule_that_exists():
    with pytest.raises(ValueError, match="no submodule 'encoder.block'"):
        MaskedPatchPretraining(encoder=HYBRID, optimizer=ADAM, frozen=["encoder.block"])


def test_accuracy_by_kind_scores_each_kind_and_the_majority_over_one_seeded_draw():
    torch.manual_seed(0)
    module = MaskedPatchPretraining(encoder=HYBRID, optimizer=ADAM)
    with torch.no_grad():  # always predict class 3
        module.head.weight.zero_()
        module.head.bias.zero_()
        module.head.bias[3] = 1.0
    batch = images()
    scores = accuracy_by_kind(module, batch, seed=5, batch_size=40)
    assert module.training  # its mode is given back
    assert accuracy_by_kind(module, batch, seed=5, batch_size=40) == scores  # the seed's draw, again
    assert accuracy_by_kind(module, batch, seed=6, batch_size=40) != scores

    torch.manual_seed(5)
    output = module.eval()(batch.float() / 255)
    masked = output.targets[output.corrupted.kinds == MASKED]
    assert scores["masked"]["tokens"] == len(masked)
    assert scores["masked"]["accuracy"] == pytest.approx(float((masked == 3).float().mean()))
    assert scores["majority"] == pytest.approx(float(torch.bincount(masked).max() / len(masked)))
    assert scores["all"]["tokens"] == sum(scores[kind]["tokens"] for kind in ("masked", "replaced", "kept"))
    assert scores["all"]["accuracy"] == pytest.approx(float((output.targets == 3).float().mean()))
    assert 0.7 < scores["masked"]["tokens"] / scores["all"]["tokens"] < 0.9  # 80% of the corrupted are masked
