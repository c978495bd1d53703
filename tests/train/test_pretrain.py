"""The pretraining module: it learns, it trains under Lightning, and its checkpoint is portable."""

import inspect
from dataclasses import asdict

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from mpp import (
    CorruptionConfig,
    MaskedPatchPretraining,
    OptimizerConfig,
    TargetConfig,
    ViTConfig,
)
from mpp.train.optim import parameter_groups, warmup_cosine

TINY = ViTConfig(image_size=16, patch_size=4, dim=32, depth=2, heads=2, mlp_dim=64)


class BlockImages(Dataset):
    """Images made of coloured blocks (uint8), so mean colours are learnable from context."""

    def __init__(self, count: int, size: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        coarse = torch.randint(0, 256, (count, 3, size // 8, size // 8), generator=generator, dtype=torch.uint8)
        self.images = coarse.repeat_interleave(8, -1).repeat_interleave(8, -2)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": torch.tensor(-1)}


def module(**overrides) -> MaskedPatchPretraining:
    settings = {"encoder": TINY, "optimizer": OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, warmup_steps=2)}
    return MaskedPatchPretraining(**{**settings, **overrides})


def test_forward_predicts_the_targets_of_the_corrupted_patches():
    model = module()
    images = torch.rand(3, 3, 16, 16)
    out = model(images)
    assert out.predictions.shape == (3, 8, 512) and out.targets.shape == (3, 8)
    all_targets = model.targets(images)
    for b in range(3):
        assert out.targets[b].tolist() == all_targets[b, out.corrupted.positions[b]].tolist()


@pytest.mark.parametrize("target", [TargetConfig(), TargetConfig(kind="downsized_colour"), TargetConfig(kind="pixels")])
def test_loss_falls_on_a_fixed_batch(target):
    torch.manual_seed(0)
    model = module(target=target)
    images = BlockImages(16).images.float() / 255
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        torch.manual_seed(1)  # the same corruption every step: a fixed problem to fit
        loss = model.loss(images)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_weight_decay_only_on_weight_matrices():
    model = module()
    decayed, undecayed = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    assert "encoder.patch_embed.weight" in decayed_names and "head.weight" in decayed_names
    assert "encoder.blocks.0.attn.qkv.weight" in decayed_names
    assert not any(n.endswith("bias") or "norm" in n for n in decayed_names)
    assert {"encoder.pos_embed", "encoder.cls_token", "mask_token"} <= {names[id(p)] for p in undecayed["params"]}
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0


def test_warmup_then_cosine():
    lr = [warmup_cosine(s, warmup_steps=10, total_steps=110, final_ratio=0.0) for s in range(110)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[60] == pytest.approx(0.5, abs=0.02)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:])) and lr[-1] < 0.001


def test_lightning_fit_trains_logs_and_checkpoints(tmp_path):
    pl.seed_everything(0)
    model = module(corruption=CorruptionConfig(ratio=0.5))
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=pl.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1,
        gradient_clip_val=1.0,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(BlockImages(32), batch_size=8)
    before = model.encoder.blocks[0].attn.qkv.weight.detach().clone()
    trainer.fit(model, loader)
    assert trainer.global_step == 6
    assert not torch.equal(before, model.encoder.blocks[0].attn.qkv.weight)
    metrics = trainer.logged_metrics
    assert {"train/loss", "train/mpp_accuracy", "train/lr"} <= set(metrics)
    checkpoint_path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(checkpoint_path)
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    assert checkpoint["encoder_config"]["dim"] == 32
    restored = MaskedPatchPretraining.load_from_checkpoint(checkpoint_path, weights_only=True)
    assert restored.encoder_config == model.encoder_config
    for name, value in model.state_dict().items():
        assert torch.equal(value, restored.state_dict()[name]), name


def test_hyperparameters_are_the_constructor_arguments_as_plain_data():
    model = module(corruption=CorruptionConfig(ratio=0.25), pixel_std=(0.25,))
    assert list(model.hparams) == list(inspect.signature(MaskedPatchPretraining).parameters)
    assert model.hparams["encoder"] == asdict(TINY) and model.hparams["corruption"] == asdict(CorruptionConfig(ratio=0.25))
    assert model.hparams["target"] == asdict(TargetConfig()) and model.hparams["pixel_std"] == [0.25]
    assert MaskedPatchPretraining(**model.hparams).hparams == model.hparams


def test_normalisation_that_fits_no_channel_count_fails():
    with pytest.raises(ValueError, match="normalisation"):
        module(pixel_mean=(0.5, 0.5), pixel_std=(0.5, 0.5))


def test_validation_reports_the_majority_class_baseline(tmp_path):
    class Dark(BlockImages):
        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            image = torch.zeros_like(self.images[index])
            if index % 2:  # half the images white: the baseline is exactly one half
                image += 255
            return {"image": image, "label": torch.tensor(-1)}

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    (metrics,) = trainer.validate(module(), DataLoader(Dark(8), batch_size=4))
    assert metrics["val/majority_accuracy"] == pytest.approx(0.5)
    assert 0.0 <= metrics["val/mpp_accuracy"] <= 1.0
