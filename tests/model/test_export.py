"""Exports for timm and Hugging Face: transformers' ViTModel and timm's VisionTransformer compute what our
encoder does on the same images, with each library's own preprocessing, and every tensor comes back
exactly (reading exports back: test_export_reading.py).

timm needs torchvision and its matching torch: its tests are marked `bench` (`make test-bench`)."""

from __future__ import annotations

import io
import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from workspace import TESTS, mpp_command

from mpp import OptimizerConfig, ViT, ViTConfig
from mpp.data.transforms import ImageTransform
from mpp.model import layouts
from mpp.model.checkpoint import encoder_and_normalisation, load_encoder, read_checkpoint, read_export
from mpp.model.export import write_export
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
    assert mpp_command("export", path, "--format", "hf", "--out", str(tmp_path / "hf")) == 0
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


@pytest.mark.parametrize("with_head", [False, True])
def test_the_export_tool_writes_a_real_checkpoint_that_transformers_runs(tmp_path: Path, with_head: bool) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert mpp_command("export", str(REAL), "--format", "hf", "--out", str(out), *(["--with-head"] * with_head)) == 0
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
    # The extras are the only tensors transformers does not take, as `mpp export --help` says.
    theirs, info = transformers.ViTModel.from_pretrained(out, add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert set(info["unexpected_keys"]) == (extras if with_head else set())
    ours = load_encoder(str(REAL)).eval()
    x = Normalise(mean=[0.5], std=[0.5])(torch.rand(4, 1, 28, 28))
    with torch.no_grad():
        hidden = theirs.eval()(pixel_values=x).last_hidden_state
        assert (hidden[:, 0] - ours(x)).abs().max() <= TOLERANCE
        assert (hidden - all_tokens(ours, x)).abs().max() <= TOLERANCE


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
    assert mpp_command("export", path, "--format", "timm", "--out", str(tmp_path / "timm")) == 0
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
def test_timm_loads_an_export_with_the_head_only_when_not_strict(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    out = tmp_path / "timm"
    assert mpp_command("export", str(REAL), "--format", "timm", "--out", str(out), "--with-head") == 0
    with pytest.raises(RuntimeError, match="mpp.mask_token"):
        timm.create_model(f"local-dir:{out}", pretrained=True)
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True, pretrained_strict=False).eval()
    ours = load_encoder(str(REAL)).eval()
    x = Normalise(mean=[0.5], std=[0.5])(torch.rand(4, 1, 28, 28))
    with torch.no_grad():
        assert (theirs(x) - ours(x)).abs().max() <= TOLERANCE
