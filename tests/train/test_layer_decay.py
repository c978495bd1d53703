"""Layer-wise learning-rate decay: after warm-up and cosine, every parameter of a fine-tuned classifier
learns at lr · schedule · decay^(L + 1 − i) for block i of L (from 1), decay^(L + 1) for the embeddings
(a hybrid's stem among them), and lr for the final norm and the head; decay 1 is the paper's recipe."""

from __future__ import annotations

import pytest
import torch

from mpp import ImageClassifier, MaskedPatchPretraining, OptimizerConfig, ViTConfig
from mpp.model.stem import StemConfig
from mpp.train.optim import configure_optimizer, warmup_cosine

TINY = ViTConfig(image_size=28, patch_size=4, channels=1, dim=32, depth=3, heads=2, mlp_dim=64)
HYBRID = ViTConfig(image_size=28, patch_size=1, channels=1, dim=32, depth=3, heads=2, mlp_dim=64,
                   stem=StemConfig(layers=(1,), width=32))


def expected_power(name: str, depth: int) -> int:
    """The exponent of the decay for a parameter, by its name alone."""
    if name.startswith("encoder.blocks."):
        return depth + 1 - (int(name.split(".")[2]) + 1)
    if name.startswith(("encoder.patch_embed", "encoder.cls_token", "encoder.pos_embed", "encoder.stem")):
        return depth + 1
    return 0  # the encoder's final norm, the head


@pytest.mark.parametrize("encoder", [TINY, HYBRID], ids=["vit", "hybrid"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_each_parameter_learns_at_the_decayed_rate_through_warmup_and_cosine(encoder: ViTConfig, name: str) -> None:
    config = OptimizerConfig(name=name, lr=0.01, weight_decay=0.05, warmup_steps=4, layer_decay=0.75)
    model = ImageClassifier(encoder=encoder, num_classes=10, optimizer=config)
    built = configure_optimizer(model, config, total_steps=20)
    optimizer, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    names = dict(model.named_parameters())
    assert {id(p) for p in names.values()} == group_of.keys(), "every parameter in one group"
    assert any(n.startswith("encoder.stem.") for n in names) == (encoder.stem is not None)
    for step in range(20):
        factor = warmup_cosine(step, warmup_steps=4, total_steps=20, final_ratio=0.0)
        for parameter_name, parameter in names.items():
            wanted = 0.01 * factor * 0.75 ** expected_power(parameter_name, encoder.depth)
            assert group_of[id(parameter)]["lr"] == pytest.approx(wanted, rel=1e-12), (step, parameter_name)
        optimizer.step()
        schedule.step()
    decayed = {n for n, p in names.items() if group_of[id(p)]["weight_decay"] == 0.05}
    assert decayed == {n for n in names if n.endswith("weight") and names[n].dim() > 1}
    assert optimizer.param_groups[0]["lr"] == schedule.get_last_lr()[0], "the first group (the one logged) is at lr"


def test_without_decay_the_groups_are_the_papers_two() -> None:
    config = OptimizerConfig(name="sgd", lr=0.03)
    groups = configure_optimizer(ImageClassifier(encoder=TINY, num_classes=4, optimizer=config), config, 10)[
        "optimizer"
    ].param_groups
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0] and [g["lr"] for g in groups] == [0.03, 0.03]


def test_pretraining_decays_the_encoder_and_leaves_the_mask_embedding_and_head_at_lr() -> None:
    config = OptimizerConfig(name="adamw", lr=1e-3, layer_decay=0.5)
    model = MaskedPatchPretraining(encoder=TINY, optimizer=config)
    group_of = {id(p): g for g in configure_optimizer(model, config, 10)["optimizer"].param_groups for p in g["params"]}
    lr = {name: group_of[id(p)]["lr"] for name, p in model.named_parameters()}
    assert lr["mask_token"] == lr["head.weight"] == lr["encoder.norm.weight"] == 1e-3
    assert lr["encoder.pos_embed"] == pytest.approx(1e-3 * 0.5**4)


def test_a_layer_decay_outside_0_to_1_fails_naming_the_key() -> None:
    for value in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"optimizer.layer_decay must be in \(0, 1\], got {value}"):
            OptimizerConfig(name="sgd", lr=0.1, layer_decay=value)
    with pytest.raises(ValueError, match="layer_decay needs a module with a ViT `encoder`"):
        configure_optimizer(torch.nn.Linear(2, 2), OptimizerConfig(name="sgd", lr=0.1, layer_decay=0.5), 10)
