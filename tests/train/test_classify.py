"""The classifier: it takes exactly the pretrained encoder, starts from a zero head, interpolates
positions to a new image size, trains and reports per-class accuracy, and runs from its configs."""

from __future__ import annotations

import inspect
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from mpp import ImageClassifier, MaskedPatchPretraining, OptimizerConfig, ViTConfig
from mpp.model.checkpoint import load_encoder

TINY = ViTConfig(image_size=28, patch_size=4, channels=1, dim=32, depth=2, heads=2, mlp_dim=64)
SGD = OptimizerConfig(name="sgd", lr=0.03, warmup_steps=2)


def pretraining_checkpoint(path: Path, encoder: ViTConfig = TINY) -> dict[str, torch.Tensor]:
    """Write a pretraining checkpoint in Lightning's format with every weight perturbed away from
    its initial value (so a tensor left at init cannot pass as loaded); returns its state_dict."""
    torch.manual_seed(0)
    model = MaskedPatchPretraining(encoder=encoder, optimizer=OptimizerConfig(name="adamw", lr=1e-3))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return checkpoint["state_dict"]


def classifier(**overrides) -> ImageClassifier:
    return ImageClassifier(**{"encoder": TINY, "num_classes": 4, "optimizer": SGD, **overrides})


def test_pretrained_encoder_weights_move_exactly_and_nothing_else(tmp_path):
    saved = pretraining_checkpoint(tmp_path / "mpp.ckpt")
    model = classifier(pretrained=str(tmp_path / "mpp.ckpt"))
    state = model.state_dict()
    encoder_names = {name for name in saved if name.startswith("encoder.")}
    assert set(state) == encoder_names | {"head.weight", "head.bias"}
    for name in encoder_names:
        assert torch.equal(state[name], saved[name]), name
    assert state["head.weight"].shape == (4, 32) and not state["head.weight"].any() and not state["head.bias"].any()
    assert "mask_token" in saved and saved["head.weight"].shape[0] == 8  # the MPP head: 8 grey levels
    assert not any("mask_token" in name for name in state)


def test_hyperparameters_are_the_constructor_arguments_as_plain_data():
    model = classifier(class_names=["a", "b", "c", "d"], pixel_mean=(0.25,))
    assert list(model.hparams) == list(inspect.signature(ImageClassifier).parameters)
    assert model.hparams["encoder"] == asdict(TINY) and model.hparams["optimizer"] == asdict(SGD)
    assert model.hparams["pixel_mean"] == [0.25] and model.hparams["class_names"] == ["a", "b", "c", "d"]
    assert ImageClassifier(**model.hparams).hparams == model.hparams


def test_dropout_may_differ_from_the_pretraining_encoder(tmp_path):
    pretraining_checkpoint(tmp_path / "mpp.ckpt")
    model = classifier(encoder=replace(TINY, dropout=0.1, attention_dropout=0.05), pretrained=str(tmp_path / "mpp.ckpt"))
    assert model.encoder.config.dropout == 0.1 and model.encoder.config.attention_dropout == 0.05
    assert model.encoder.blocks[0].attn.attention_dropout == 0.05


@pytest.mark.parametrize("change, named", [({"dim": 48, "heads": 2}, "encoder.dim"), ({"depth": 3}, "encoder.depth"),
                                           ({"patch_size": 7}, "encoder.patch_size")])
def test_an_encoder_that_does_not_match_fails_naming_the_field(tmp_path, change, named):
    pretraining_checkpoint(tmp_path / "mpp.ckpt")
    with pytest.raises(ValueError, match=named) as error:
        classifier(encoder=replace(TINY, **change), pretrained=str(tmp_path / "mpp.ckpt"))
    assert str(tmp_path / "mpp.ckpt") in str(error.value)


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    path = tmp_path / "mpp.ckpt"
    pretraining_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["state_dict"]["encoder.blocks.1.mlp.fc1.weight"]
    checkpoint["state_dict"]["encoder.blocks.2.norm1.weight"] = torch.ones(32)
    checkpoint["state_dict"]["encoder.norm.bias"] = torch.zeros(33)
    torch.save(checkpoint, path)
    with pytest.raises(ValueError) as error:
        classifier(pretrained=str(path))
    message = str(error.value)
    assert str(path) in message
    for name in ("blocks.1.mlp.fc1.weight", "blocks.2.norm1.weight", "norm.bias (33,)"):
        assert name in message


def test_a_file_that_is_not_an_mpp_checkpoint_fails_clearly(tmp_path):
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="encoder_config"):
        classifier(pretrained=str(tmp_path / "other.ckpt"))
    torch.save(torch.zeros(1), tmp_path / "tensor.ckpt")
    with pytest.raises(ValueError, match=r"tensor.ckpt is not an mpp checkpoint \(it holds a Tensor, not a dict\)"):
        classifier(pretrained=str(tmp_path / "tensor.ckpt"))
    for name, content in (("notes.md", b"# notes\n"), ("empty.ckpt", b""), ("noise.ckpt", bytes(range(256)))):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{tmp_path / name} is not an mpp checkpoint \(torch cannot read"):
            classifier(pretrained=str(tmp_path / name))


def test_the_zero_head_predicts_uniformly_at_init(tmp_path):
    pretraining_checkpoint(tmp_path / "mpp.ckpt")
    logits = classifier(pretrained=str(tmp_path / "mpp.ckpt"))(torch.rand(3, 1, 28, 28))
    assert torch.equal(logits, torch.zeros(3, 4))
    torch.testing.assert_close(logits.softmax(-1), torch.full((3, 4), 0.25))


@pytest.mark.parametrize("pretrain_size, finetune_size", [(28, 32), (32, 28)])
def test_position_embeddings_are_interpolated_to_the_fine_tuning_size(tmp_path, pretrain_size, finetune_size):
    saved = pretraining_checkpoint(tmp_path / "mpp.ckpt", replace(TINY, image_size=pretrain_size))
    model = classifier(encoder=replace(TINY, image_size=finetune_size), pretrained=str(tmp_path / "mpp.ckpt"))
    new_grid = finetune_size // 4
    positions = model.encoder.pos_embed.detach()
    assert positions.shape == (1, 1 + new_grid**2, 32) and model.encoder.grid == (new_grid, new_grid)
    assert torch.equal(positions[0, 0], saved["encoder.pos_embed"][0, 0])
    # The grid is resampled, not re-initialised: each channel keeps its level over the image.
    old_levels, new_levels = saved["encoder.pos_embed"][0, 1:].mean(0), positions[0, 1:].mean(0)
    assert torch.corrcoef(torch.stack([old_levels, new_levels]))[0, 1] > 0.9
    for name, value in model.encoder.state_dict().items():
        if name != "pos_embed":
            assert torch.equal(value, saved[f"encoder.{name}"]), name
    assert model(torch.rand(2, 1, finetune_size, finetune_size)).shape == (2, 4)
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    assert checkpoint["encoder_config"]["image_size"] == finetune_size


class Quadrants(Dataset):
    """Labelled uint8 images: class k is a bright 14 x 14 quadrant k on noise."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(count) % 4
        self.images = torch.randint(0, 80, (count, 1, 28, 28), generator=generator, dtype=torch.uint8)
        for image, label in zip(self.images, self.labels.tolist()):
            row, col = divmod(label, 2)
            image[:, row * 14 : (row + 1) * 14, col * 14 : (col + 1) * 14] += 150

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}


def test_fit_learns_and_logs_accuracy_overall_and_per_class(tmp_path):
    pl.seed_everything(0)
    names = ["top-left", "top-right", "bottom-left", "bottom-right"]
    model = classifier(encoder=replace(TINY, depth=1), class_names=names,
                       optimizer=OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=2))
    train, test = Quadrants(64, seed=0), Quadrants(32, seed=1)
    fixed = {"image": train.images[:32], "label": train.labels[:32]}

    def loss() -> float:
        model.eval()
        with torch.no_grad():
            value = torch.nn.functional.cross_entropy(model(fixed["image"].float() / 255), fixed["label"]).item()
        model.train()
        return value

    before = loss()
    trainer = pl.Trainer(max_steps=16, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         val_check_interval=8, check_val_every_n_epoch=None, default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(test, batch_size=16))
    assert loss() < 0.5 * before
    assert {"train/loss", "train/accuracy", "train/lr", "val/loss", "val/accuracy"} <= set(trainer.logged_metrics)
    (metrics,) = trainer.test(model, DataLoader(test, batch_size=10))
    with torch.no_grad():
        predictions = model(test.images.float() / 255).argmax(-1)
    for k, name in enumerate(names):
        members = test.labels == k
        expected = (predictions[members] == k).float().mean().item()
        assert metrics[f"test/accuracy/{name}"] == pytest.approx(expected)
    assert metrics["test/accuracy"] == pytest.approx((predictions == test.labels).float().mean().item())
    assert metrics["test/accuracy"] > 0.5


def test_unlabelled_batches_fail_asking_for_labels():
    model = classifier()
    with pytest.raises(ValueError, match=r"\.cls"):
        model.check_labels(torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="num_classes=4"):
        model.check_labels(torch.tensor([0, 4]))


def test_a_fit_on_unlabelled_batches_stops_before_the_first_step(tmp_path):
    data = Quadrants(8, seed=0)
    data.labels[3] = -1  # a sample whose shard had no `.cls`
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"\.cls"):
        trainer.fit(classifier(), DataLoader(data, batch_size=4))
    assert trainer.global_step == 0


class _RunsCode:
    """Unpickling this object would create the marker file: what a hostile checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "hostile.ckpt"
    torch.save({"encoder_config": {}, "state_dict": {}, "payload": _RunsCode(marker)}, path)
    with pytest.raises(ValueError, match=f"checkpoint {path} holds objects other than tensors and plain data"):
        load_encoder(str(path))
    assert not marker.exists()
