"""Exports read back: fine-tuning and continued pretraining start from a timm or Hugging Face export
as from a checkpoint, a folder either library wrote imports as our encoder, and a file or config that
does not fit is refused naming what.

timm needs torchvision and its matching torch: its tests are marked `bench` (`make test-bench`)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import REAL, SGD, TINY, TOLERANCE, WIDE, all_tokens, encoder, export, images
from workspace import mpp_command

from mpp import ImageClassifier, MaskedPatchPretraining, ViTConfig
from mpp.model.checkpoint import load_encoder, read_checkpoint
from mpp.model.export import hf_config


def copy_bare(folder: Path, to: Path) -> str:
    """The folder's model.safetensors alone, with no config.json beside it."""
    to.mkdir()
    return str(shutil.copy(folder / "model.safetensors", to / "encoder.safetensors"))


@pytest.mark.parametrize("source", ["hf", "timm", "bare hf file", "bare timm file"])
def test_fine_tuning_starts_from_an_export_at_another_image_size(tmp_path: Path, source: str) -> None:
    pretrained = encoder(replace(TINY, channels=1))
    path = str(export(pretrained, source.split()[-2] if "bare" in source else source, tmp_path / "export"))
    if "bare" in source:
        path = copy_bare(Path(path), tmp_path / "bare")
    config = replace(pretrained.config, image_size=48)  # a 6 x 6 grid for the 4 x 4 it was pretrained on
    model = ImageClassifier(encoder=config, num_classes=3, optimizer=SGD, pretrained=path)
    pretrained.resize_positions(48)  # what fine-tuning from an mpp checkpoint does
    assert model.encoder.pos_embed.shape == (1, 1 + 36, 32)
    for name, value in pretrained.state_dict().items():
        assert torch.equal(model.encoder.state_dict()[name], value), name


def test_continued_pretraining_starts_its_encoder_from_an_export_and_its_head_fresh(tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert mpp_command("export", str(REAL), "--format", "timm", "--out", str(out), "--with-head") == 0
    saved = read_checkpoint(str(REAL))["state_dict"]
    config = ViTConfig(**read_checkpoint(str(REAL))["encoder_config"])
    model = MaskedPatchPretraining(encoder=config, optimizer=SGD, pretrained=str(out))
    for name, value in model.encoder.state_dict().items():
        assert torch.equal(value, saved[f"encoder.{name}"]), name
    assert not torch.equal(model.mask_token, saved["mask_token"])
    assert not torch.equal(model.head.weight, saved["head.weight"])
    assert MaskedPatchPretraining(encoder=config, optimizer=SGD).hparams["pretrained"] is None


def test_a_folder_that_transformers_wrote_imports_as_our_encoder(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Its tensors under "vit.", a classifier beside them.
    theirs = transformers.ViTForImageClassification(transformers.ViTConfig(**hf_config(WIDE), num_labels=5))
    theirs.save_pretrained(tmp_path)
    ours = load_encoder(str(tmp_path)).eval()
    assert ours.config.heads == 3 and ours.grid == (6, 5)
    x = images(WIDE)
    with torch.no_grad():
        hidden = theirs.eval().vit(pixel_values=x).last_hidden_state
        assert (hidden - all_tokens(ours, x)).abs().max() <= TOLERANCE


def test_an_encoder_that_does_not_match_the_configured_one_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = str(export(encoder(TINY), "hf", tmp_path))
    with pytest.raises(ValueError, match="encoder.mlp_dim: configured 96, checkpoint 64") as error:
        ImageClassifier(encoder=replace(TINY, mlp_dim=96), num_classes=3, optimizer=SGD, pretrained=path)
    assert path in str(error.value)


def edit_file(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_named_as_the_file_names_them(tmp_path: Path) -> None:
    folder = export(encoder(TINY), "hf", tmp_path)

    def damage(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["encoder.layer.1.intermediate.dense.weight"]
        tensors["encoder.layer.0.attention.attention.q_norm.weight"] = torch.ones(16)
        tensors["layernorm.bias"] = torch.zeros(33)

    edit_file(folder, damage)
    with pytest.raises(ValueError, match="Hugging Face ViTModel export") as error:
        load_encoder(str(folder), expected=TINY)
    for named in ("missing ['encoder.layer.1.intermediate.dense.weight']",
                  "unexpected ['encoder.layer.0.attention.attention.q_norm.weight']", "layernorm.bias (33,)"):
        assert named in str(error.value)


def test_a_timm_vit_with_layer_scale_is_refused_naming_its_tensors(tmp_path: Path) -> None:
    folder = export(encoder(TINY), "timm", tmp_path)
    edit_file(folder, lambda tensors: tensors.update({"blocks.0.ls1.gamma": torch.ones(32)}))
    with pytest.raises(ValueError, match=r"timm VisionTransformer export .* unexpected \['blocks.0.ls1.gamma'\]"):
        load_encoder(str(folder))


@pytest.mark.parametrize("layout, change, named", [
    ("hf", {"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
    ("hf", {"layer_norm_eps": 1e-3}, "layer_norm_eps 0.001"),
    ("hf", {"model_type": "deit"}, "model_type 'deit'"),
    ("hf", {"num_attention_heads": None}, "num_attention_heads is missing"),
    ("timm", {"model_args": {"act_layer": "gelu_tanh"}}, "act_layer 'gelu_tanh'"),
    ("timm", {"architecture": "vit_so400m_patch14_siglip_224", "model_args": {}}, "model_args lack"),
])
def test_a_config_that_describes_another_model_is_refused_naming_the_field(tmp_path: Path, layout, change, named) -> None:
    folder = export(encoder(TINY), layout, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=str(folder)) as error:
        load_encoder(str(folder))
    assert named in str(error.value)


def test_transformers_own_layer_norm_eps_is_accepted(tmp_path: Path) -> None:
    folder = export(encoder(TINY), "hf", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-12}))
    assert load_encoder(str(folder)).config.heads == 2


def test_a_bare_file_needs_the_configured_heads(tmp_path: Path) -> None:
    path = copy_bare(export(encoder(TINY), "timm", tmp_path / "export"), tmp_path / "bare")
    with pytest.raises(ValueError, match="attention heads"):
        load_encoder(path)
    assert load_encoder(path, expected=TINY).config == replace(TINY, image_size=(32, 32))


def test_a_file_of_another_model_is_refused(tmp_path: Path) -> None:
    save_file({"conv1.weight": torch.zeros(8, 3, 3, 3)}, tmp_path / "resnet.safetensors")
    with pytest.raises(ValueError, match=r"neither a timm ViT .* \['conv1.weight'\]"):
        load_encoder(str(tmp_path / "resnet.safetensors"))
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_encoder(str(tmp_path))


# timm: in the bench environment only.


@pytest.mark.bench
def test_a_folder_that_timm_wrote_imports_as_our_encoder(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    theirs = timm.create_model("vit_base_patch16_224", img_size=(24, 40), patch_size=(4, 8), in_chans=1,
                               embed_dim=48, depth=2, num_heads=3, mlp_ratio=1.5, num_classes=5).eval()
    timm.models.save_for_hf(theirs, str(tmp_path), safe_serialization=True)
    ours = load_encoder(str(tmp_path)).eval()
    assert asdict(ours.config) == {**asdict(WIDE), "image_size": (24, 40), "patch_size": (4, 8)}
    x = images(WIDE)
    with torch.no_grad():
        assert (theirs.forward_features(x) - all_tokens(ours, x)).abs().max() <= TOLERANCE
