"""Exports for timm and Hugging Face: transformers' ViTModel and timm's VisionTransformer compute what our
encoder does on the same images, every tensor comes back exactly, fine-tuning and continued pretraining
start from an export as from a checkpoint, and a file that does not fit is refused naming what.

timm needs torchvision and its matching torch: its tests are marked `bench` (`make test-bench`)."""

from __future__ import annotations

import io
import json
import random
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from export import main as export_main
from safetensors.torch import load_file, save_file
from workspace import TESTS

from mpp import ImageClassifier, MaskedPatchPretraining, OptimizerConfig, ViT, ViTConfig
from mpp.data.transforms import ImageTransform
from mpp.model import layouts
from mpp.model.checkpoint import encoder_and_normalisation, load_encoder, read_checkpoint, read_export
from mpp.model.export import hf_config, write_export
from mpp.model.pixels import Normalise, pair

TINY = ViTConfig(image_size=32, patch_size=8, channels=3, dim=32, depth=2, heads=2, mlp_dim=64)
# Non-square images and patches, one channel, three heads, an MLP of other than 4 D.
WIDE = ViTConfig(image_size=(24, 40), patch_size=(4, 8), channels=1, dim=48, depth=2, heads=3, mlp_dim=72)
MEAN, STD = [0.25], [0.4]
SGD = OptimizerConfig(name="sgd", lr=0.03, warmup_steps=2)
REAL = TESTS / "fixtures" / "before-layout" / "pretrain.ckpt"  # written by `mpp fit` (its README says how)
TOLERANCE = 1e-5


def encoder(config: ViTConfig, seed: int = 0) -> ViT:
    """An encoder with every weight moved off its initial value (zero biases, unit norms would hide a
    tensor that went to the wrong place)."""
    torch.manual_seed(seed)
    model = ViT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return model


def images(config: ViTConfig, count: int = 3) -> torch.Tensor:
    """Normalised float32 images, as the encoder sees them."""
    torch.manual_seed(1)
    return Normalise(mean=MEAN, std=STD)(torch.rand(count, config.channels, *pair(config.image_size)))


def export(model: ViT, layout: layouts.Layout, folder: Path) -> Path:
    write_export(folder, model.state_dict(), model.config, layout, mean=MEAN, std=STD)
    return folder


def all_tokens(model: ViT, x: torch.Tensor) -> torch.Tensor:
    """(B, 1 + N, D): LN of every token after the last block, the class token first."""
    cls, patches = model.encode(model.add_positions(model.embed_patches(x)))
    return torch.cat([cls[:, None], patches], dim=1)


def hf_model(folder: Path):
    """transformers' ViTModel of the folder, after checking that it loaded every weight and no other."""
    transformers = pytest.importorskip("transformers")
    model, info = transformers.ViTModel.from_pretrained(folder, add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("config", [TINY, WIDE], ids=["square", "wide"])
def test_transformers_vit_model_computes_our_encoder(tmp_path: Path, config: ViTConfig) -> None:
    ours = encoder(config)
    theirs = hf_model(export(ours, "hf", tmp_path))
    x = images(config)
    with torch.no_grad():
        hidden = theirs(pixel_values=x).last_hidden_state
        assert (hidden[:, 0] - ours(x)).abs().max() <= TOLERANCE
        assert (hidden - all_tokens(ours, x)).abs().max() <= TOLERANCE


def test_the_hf_preprocessor_normalises_as_the_checkpoint(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    export(encoder(TINY), "hf", tmp_path)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    pixels = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8)
    processed = processor(Image.fromarray(pixels.numpy()), return_tensors="pt")["pixel_values"]
    expected = Normalise(mean=MEAN, std=STD)(pixels.permute(2, 0, 1)[None].float() / 255)
    torch.testing.assert_close(processed, expected, atol=1e-6, rtol=0)


def with_crop(tmp_path: Path, crop_fraction: float) -> str:
    """The real checkpoint, its data module's evaluation crop set to `crop_fraction`."""
    checkpoint = torch.load(REAL, weights_only=False, map_location="cpu")
    checkpoint["datamodule_hyper_parameters"]["eval_crop_fraction"] = crop_fraction
    torch.save(checkpoint, tmp_path / "crop.ckpt")
    return str(tmp_path / "crop.ckpt")


def raw_image() -> bytes:
    """A 96 x 64 grey PNG: not the encoder's size nor its shape, so that resize and crop both matter."""
    from PIL import Image

    buffer = io.BytesIO()
    torch.manual_seed(2)
    Image.fromarray(torch.randint(0, 256, (64, 96), dtype=torch.uint8).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def mpp_representation(path: str, image: bytes) -> torch.Tensor:
    """The class token mpp computes for an image file, through the shard pipeline's evaluation transform."""
    ours, normalise = encoder_and_normalisation(path)
    crop_fraction = read_checkpoint(path)["datamodule_hyper_parameters"]["eval_crop_fraction"]
    transform = ImageTransform(size=pair(ours.config.image_size), channels=ours.config.channels, train=False,
                               crop_fraction=crop_fraction)
    pixels = torch.from_numpy(transform(image, random.Random(0)).copy()).permute(2, 0, 1)[None].float() / 255
    with torch.no_grad():
        return ours.eval()(normalise(pixels))


@pytest.mark.parametrize("crop_fraction", [1.0, 0.875])
def test_transformers_own_preprocessing_of_an_image_gives_mpps_representation(tmp_path: Path,
                                                                              crop_fraction: float) -> None:
    # The export's ViTImageProcessor squashed the whole image to the encoder's size where mpp crops its centre.
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    path = with_crop(tmp_path, crop_fraction)
    assert export_main([path, "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    pixels = processor(Image.open(io.BytesIO(raw_image())), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = hf_model(tmp_path / "hf")(pixel_values=pixels).last_hidden_state[:, 0]
    torch.testing.assert_close(theirs, mpp_representation(path, raw_image()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["timm", "hf"])
@pytest.mark.parametrize("config", [TINY, WIDE], ids=["square", "wide"])
def test_a_round_trip_reproduces_every_tensor(tmp_path: Path, layout: layouts.Layout, config: ViTConfig) -> None:
    ours = encoder(config)
    config_back, weights = read_export(str(export(ours, layout, tmp_path)))
    assert weights.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(weights[name], value), name
    assert asdict(config_back) == {**asdict(config), "image_size": pair(config.image_size),
                                   "patch_size": pair(config.patch_size)}


def test_the_fused_qkv_splits_into_query_key_value_in_order(tmp_path: Path) -> None:
    ours = encoder(TINY)
    tensors = load_file(export(ours, "hf", tmp_path) / "model.safetensors")
    qkv = ours.blocks[1].attn.qkv.weight.detach()
    for index, part in enumerate(("query", "key", "value")):
        assert torch.equal(tensors[f"encoder.layer.1.attention.attention.{part}.weight"], qkv[32 * index: 32 * (index + 1)])


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
    assert export_main([str(REAL), "--format", "timm", "--out", str(out), "--with-head"]) == 0
    saved = read_checkpoint(str(REAL))["state_dict"]
    config = ViTConfig(**read_checkpoint(str(REAL))["encoder_config"])
    model = MaskedPatchPretraining(encoder=config, optimizer=SGD, pretrained=str(out))
    for name, value in model.encoder.state_dict().items():
        assert torch.equal(value, saved[f"encoder.{name}"]), name
    assert not torch.equal(model.mask_token, saved["mask_token"])
    assert not torch.equal(model.head.weight, saved["head.weight"])
    assert MaskedPatchPretraining(encoder=config, optimizer=SGD).hparams["pretrained"] is None


@pytest.mark.parametrize("with_head", [False, True])
def test_the_export_tool_writes_a_real_checkpoint_that_transformers_runs(tmp_path: Path, with_head: bool) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert export_main([str(REAL), "--format", "hf", "--out", str(out), *(["--with-head"] * with_head)]) == 0
    checkpoint = read_checkpoint(str(REAL))
    extras = {"mpp.head.weight", "mpp.head.bias", "mpp.mask_token"}
    tensors = load_file(out / "model.safetensors")
    assert (extras <= tensors.keys()) == with_head and not (extras & tensors.keys()) == (not with_head)
    for name in extras & tensors.keys():
        assert torch.equal(tensors[name], checkpoint["state_dict"][name.removeprefix("mpp.")])
    config = json.loads((out / "config.json").read_text())
    assert ("mpp" in config) == with_head
    if with_head:
        assert config["mpp"]["target"] == checkpoint["hyper_parameters"]["target"]
    preprocessor = json.loads((out / "preprocessor_config.json").read_text())
    assert preprocessor["image_mean"] == checkpoint["hyper_parameters"]["pixel_mean"]
    assert preprocessor["image_std"] == checkpoint["hyper_parameters"]["pixel_std"]
    # The extras are the only tensors transformers does not take, as tools/export.py says.
    theirs, info = transformers.ViTModel.from_pretrained(out, add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert set(info["unexpected_keys"]) == (extras if with_head else set())
    ours = load_encoder(str(REAL)).eval()
    x = Normalise(mean=[0.5], std=[0.5])(torch.rand(4, 1, 28, 28))
    with torch.no_grad():
        hidden = theirs.eval()(pixel_values=x).last_hidden_state
        assert (hidden[:, 0] - ours(x)).abs().max() <= TOLERANCE
        assert (hidden - all_tokens(ours, x)).abs().max() <= TOLERANCE


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
@pytest.mark.parametrize("config", [TINY, WIDE], ids=["square", "wide"])
def test_timm_loads_the_export_and_computes_our_encoder(tmp_path: Path, config: ViTConfig) -> None:
    timm = pytest.importorskip("timm")
    ours = encoder(config)
    folder = export(ours, "timm", tmp_path)
    x = images(config)
    saved = json.loads((folder / "config.json").read_text())
    loaded = {
        "local-dir": timm.create_model(f"local-dir:{folder}", pretrained=True),
        "file": timm.create_model(saved["architecture"], pretrained=True, **saved["model_args"],
                                  pretrained_cfg_overlay={**saved["pretrained_cfg"], "file": str(folder / "model.safetensors")}),
    }
    for route, theirs in loaded.items():
        with torch.no_grad():
            features = theirs.eval().forward_features(x)
            assert (features[:, 0] - ours(x)).abs().max() <= TOLERANCE, route
            assert (features - all_tokens(ours, x)).abs().max() <= TOLERANCE, route
            assert (theirs(x) - ours(x)).abs().max() <= TOLERANCE, route  # num_classes 0: the pooled class token
    data = timm.data.resolve_data_config(model=loaded["local-dir"])
    assert list(data["mean"]) == MEAN * config.channels and list(data["std"]) == STD * config.channels
    assert tuple(data["input_size"]) == (config.channels, *pair(config.image_size))


@pytest.mark.bench
@pytest.mark.parametrize("crop_fraction", [1.0, 0.875])
def test_timms_own_transform_of_an_image_gives_mpps_representation(tmp_path: Path, crop_fraction: float) -> None:
    # Without crop_pct in the export, timm cropped 0.875 of every image, where mpp evaluated the whole of it.
    timm = pytest.importorskip("timm")
    from PIL import Image

    path = with_crop(tmp_path, crop_fraction)
    assert export_main([path, "--format", "timm", "--out", str(tmp_path / "timm")]) == 0
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=theirs))
    with torch.no_grad():
        token = theirs(transform(Image.open(io.BytesIO(raw_image())))[None])
    torch.testing.assert_close(token, mpp_representation(path, raw_image()), atol=1e-5, rtol=0)


def test_a_timm_sized_encoder_is_exported_under_its_timm_name(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    config = ViTConfig(image_size=224, patch_size=16, channels=3, dim=192, depth=12, heads=3, mlp_dim=768)
    ours = encoder(config)
    folder = export(ours, "timm", tmp_path)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architecture"] == "vit_tiny_patch16_224" and "model_args" not in saved
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    x = images(config, count=2)
    with torch.no_grad():
        assert (theirs.forward_features(x)[:, 0] - ours(x)).abs().max() <= TOLERANCE


@pytest.mark.bench
@pytest.mark.parametrize("name", sorted(layouts.TIMM_MODELS))
def test_every_timm_name_mpp_knows_builds_the_sizes_it_stands_for(name: str) -> None:
    timm = pytest.importorskip("timm")
    dim, depth, heads, patch, image = layouts.TIMM_MODELS[name]
    with torch.device("meta"):
        model = timm.create_model(name, num_classes=0)
    assert (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == (dim, depth, heads)
    assert model.patch_embed.patch_size == (patch, patch) and model.patch_embed.img_size == (image, image)
    assert model.blocks[0].mlp.fc1.out_features == 4 * dim and model.patch_embed.proj.in_channels == 3


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


@pytest.mark.bench
def test_timm_loads_an_export_with_the_head_only_when_not_strict(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    out = tmp_path / "timm"
    assert export_main([str(REAL), "--format", "timm", "--out", str(out), "--with-head"]) == 0
    with pytest.raises(RuntimeError, match="mpp.mask_token"):
        timm.create_model(f"local-dir:{out}", pretrained=True)
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True, pretrained_strict=False).eval()
    ours = load_encoder(str(REAL)).eval()
    x = Normalise(mean=[0.5], std=[0.5])(torch.rand(4, 1, 28, 28))
    with torch.no_grad():
        assert (theirs(x) - ours(x)).abs().max() <= TOLERANCE
