"""The hybrid encoder (a ResNet-v2 stem under the ViT): its size is timm's R50+ViT-B/16, its stem pads and
standardises as the paper's, a token stands for stride x patch pixels in the targets, positions, analyses
and pictures, it pretrains and fine-tunes, its checkpoint and timm export come back exactly, and
`corruption.mask_pixels` hides a masked token's pixels from the stem."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_export import encoder
from workspace import ROOT, mpp_command

from mpp import CorruptionConfig, ImageClassifier, MaskedPatchPretraining, OptimizerConfig, ViT, ViTConfig
from mpp.config import read_config
from mpp.eval.analyses import analyse
from mpp.model import layouts
from mpp.model.checkpoint import load_encoder, read_export
from mpp.model.corruption import MASKED, choose_corruption, mask_pixels
from mpp.model.export import write_export
from mpp.model.pixels import Normalise
from mpp.model.stem import StdConv2d, StemConfig, same_padding
from mpp.model.targets import quantise_colours
from mpp.outputs.prediction_pictures import prediction_panel
from mpp.summary import patches_of

# The demo's hybrid preset at 28 px: a stride-4 stem, 7 x 7 tokens of 4 x 4 pixels.
DEMO = ViTConfig(**read_config(ROOT / "configs/model/vit_demo_hybrid.yaml"), image_size=28, patch_size=1, channels=1)
# A quick stand-in: the same stem under a narrow ViT.
SMALL = replace(DEMO, dim=32, depth=2, heads=2, mlp_dim=64)
ADAM = OptimizerConfig(name="adamw", lr=1e-3, warmup_steps=2)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_r50_vit_b16_has_the_parameters_of_timms_vit_base_r50_s16_224_without_its_head():
    config = ViTConfig(**read_config(ROOT / "configs/model/vit_b_r50.yaml"), image_size=224, patch_size=1)
    model = ViT(config)
    assert count(model) == 97_890_112
    assert config.stem is not None and config.stem.stride == 16 and config.stem.out_channels == 1024
    assert model.patch_embed.weight.shape == (768, 1024, 1, 1)
    assert config.token_size == (16, 16) and config.grid == (14, 14) and config.num_patches == 196


def test_the_demo_hybrid_has_the_pure_demo_vits_token_grid():
    model = ViT(DEMO)
    images = torch.randn(2, 1, 28, 28)
    assert model.stem(images).shape == (2, 128, 7, 7)
    assert model.embed_patches(images).shape == (2, 49, 128)
    assert model(images).shape == (2, 128)
    assert DEMO.token_size == (4, 4) and DEMO.grid == (7, 7) and model.pos_embed.shape == (1, 50, 128)


def test_the_pure_vit_is_unchanged_without_a_stem():
    config = ViTConfig(image_size=28, patch_size=4, channels=1, dim=32, depth=1, heads=2, mlp_dim=64)
    assert config.token_size == (4, 4) and config.grid == (7, 7)
    assert not any(name.startswith("stem.") for name in ViT(config).state_dict())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"image_size": 30}, r"patch_size 1 times the stem's stride 4 must divide encoder.image_size 30"),
        ({"patch_size": 2}, r"height 28 is not a multiple of 8"),
        ({"stem": {"layers": [1], "width": 48}}, r"encoder.stem.width must be a multiple of 32"),
        ({"stem": {"layers": [2, 0], "width": 32}}, r"encoder.stem.layers must each be at least 1"),
    ],
)
def test_a_config_that_does_not_fit_fails_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        replace(DEMO, **change)


def test_a_stem_from_plain_data_is_the_stem_config():
    config = ViTConfig(**asdict(DEMO))
    assert config == DEMO and config.stem == StemConfig(layers=(1,), width=32)
    assert StemConfig(layers=[3, 4, 9], width=64).stride == 16 and StemConfig(layers=(), width=64).stride == 4


def test_stdconv_standardises_each_filter_and_pads_same():
    torch.manual_seed(0)
    conv = StdConv2d(3, 8, 3, stride=2)
    weight = conv.standardised_weight()
    torch.testing.assert_close(weight.mean((1, 2, 3)), torch.zeros(8), atol=1e-6, rtol=0)
    torch.testing.assert_close(weight.var((1, 2, 3), unbiased=False), torch.ones(8), atol=1e-4, rtol=0)
    x = torch.randn(2, 3, 8, 8)
    # SAME at stride 2 on an even size pads one cell, after: the bottom row and right column.
    assert same_padding(8, 3, 2) == (0, 1) and same_padding(224, 7, 2) == (2, 3) and same_padding(7, 3, 1) == (1, 1)
    expected = F.conv2d(F.pad(x, (0, 1, 0, 1)), weight, stride=2)
    torch.testing.assert_close(conv(x), expected)


def test_each_tokens_target_is_the_mean_colour_of_its_own_pixels():
    model = MaskedPatchPretraining(encoder=SMALL, optimizer=ADAM)
    images = torch.rand(2, 1, 28, 28)
    targets = model.targets(images)
    assert targets.shape == (2, 49)
    for row in range(7):
        for col in range(7):
            mean = images[:, :, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4].mean((-2, -1))  # (B, C)
            assert torch.equal(targets[:, row * 7 + col], quantise_colours(mean, 3)), (row, col)


def test_pretraining_the_demo_hybrid_lowers_its_loss():
    torch.manual_seed(0)
    model = MaskedPatchPretraining(encoder=SMALL, optimizer=ADAM)
    coarse = torch.randint(0, 256, (8, 1, 7, 7), dtype=torch.uint8)
    images = coarse.repeat_interleave(4, -1).repeat_interleave(4, -2)  # one grey level per token
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(20):
        torch.manual_seed(1)  # the same corruption every step: the batch can be learnt by heart
        loss = model.loss(images)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def pretraining_checkpoint(path: Path, encoder: ViTConfig = SMALL) -> dict[str, torch.Tensor]:
    """A pretraining checkpoint in Lightning's format, every weight moved off its initial value."""
    torch.manual_seed(0)
    model = MaskedPatchPretraining(encoder=encoder, optimizer=ADAM)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return checkpoint["state_dict"]


def test_a_checkpoints_hybrid_encoder_comes_back_exactly(tmp_path: Path):
    saved = pretraining_checkpoint(tmp_path / "mpp.ckpt")
    encoder = load_encoder(str(tmp_path / "mpp.ckpt"), expected=SMALL)
    assert encoder.config == SMALL
    for name, value in encoder.state_dict().items():
        assert torch.equal(value, saved[f"encoder.{name}"]), name
    with pytest.raises(ValueError, match=r"encoder.stem: configured .*checkpoint"):
        load_encoder(str(tmp_path / "mpp.ckpt"), expected=replace(SMALL, stem=StemConfig(layers=(2,), width=32)))


def test_fine_tuning_at_another_size_resizes_the_positions_on_the_feature_grid(tmp_path: Path):
    saved = pretraining_checkpoint(tmp_path / "mpp.ckpt")
    model = ImageClassifier(
        encoder=replace(SMALL, image_size=56), num_classes=3, optimizer=ADAM, pretrained=str(tmp_path / "mpp.ckpt")
    )
    positions = model.encoder.pos_embed.detach()
    assert model.encoder.grid == (14, 14) and positions.shape == (1, 1 + 14 * 14, 32)  # 56 px / stride 4
    assert torch.equal(positions[0, 0], saved["encoder.pos_embed"][0, 0])
    old = saved["encoder.pos_embed"][0, 1:].T.reshape(1, 32, 7, 7)
    expected = F.interpolate(old, size=(14, 14), mode="bicubic", align_corners=False).reshape(32, -1).T
    torch.testing.assert_close(positions[0, 1:], expected)
    for name, value in model.encoder.state_dict().items():
        if name != "pos_embed":
            assert torch.equal(value, saved[f"encoder.{name}"]), name
    # One fine-tuning step moves the stem too.
    images, labels = torch.rand(4, 1, 56, 56), torch.tensor([0, 1, 2, 0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # the zero head gives the encoder no gradient in the first step
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    assert not torch.equal(model.encoder.stem.conv.weight, saved["encoder.stem.conv.weight"])


def masked_regions(choice, index: int) -> list[tuple[int, int]]:
    """(row, col) of image `index`'s masked tokens."""
    positions = choice.positions[index][choice.kinds[index] == MASKED]
    return [divmod(int(p), 7) for p in positions]


def test_mask_pixels_zeroes_exactly_the_masked_tokens_regions():
    torch.manual_seed(0)
    choice = choose_corruption(2, 49)
    images = torch.randn(2, 1, 28, 28)
    blanked = mask_pixels(images, choice, (7, 7))
    expected = images.clone()
    for index in range(2):
        for row, col in masked_regions(choice, index):
            expected[index, :, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4] = 0
    assert torch.equal(blanked, expected) and masked_regions(choice, 0)


@pytest.mark.parametrize("hidden", [True, False])
def test_with_mask_pixels_the_pixels_of_a_masked_token_reach_no_prediction(hidden: bool):
    model = MaskedPatchPretraining(
        encoder=SMALL, optimizer=ADAM, corruption=CorruptionConfig(mask_pixels=hidden)
    ).eval()
    images = torch.rand(2, 1, 28, 28)
    torch.manual_seed(3)
    first = model(images)
    changed = images.clone()
    for index in range(2):
        for row, col in masked_regions(first.corrupted, index):
            changed[index, :, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4] = torch.rand(1, 4, 4)
    torch.manual_seed(3)
    second = model(changed)
    assert torch.equal(first.corrupted.positions, second.corrupted.positions)
    # Without the option the stem's receptive field carries the masked pixels into the neighbours.
    assert torch.equal(first.predictions, second.predictions) == hidden


def test_mask_pixels_is_refused_for_a_pure_vit():
    pure = ViTConfig(image_size=28, patch_size=4, channels=1, dim=32, depth=1, heads=2, mlp_dim=64)
    with pytest.raises(ValueError, match="corruption.mask_pixels is for a hybrid encoder"):
        MaskedPatchPretraining(encoder=pure, optimizer=ADAM, corruption=CorruptionConfig(mask_pixels=True))


def test_analyses_and_pictures_measure_a_token_by_its_pixels():
    model = MaskedPatchPretraining(encoder=SMALL, optimizer=ADAM)
    images = torch.rand(3, 1, 28, 28)
    analysis = analyse(model.encoder, images, normalise=Normalise(mean=[0.5], std=[0.5]), components=5)
    assert analysis.components.shape == (5, 1, 7, 7)  # the stem's 7 x 7 root filters
    assert analysis.numbers()["patch_size"] == [4, 4] and analysis.similarity.shape == (7, 7, 7, 7)
    # Mean attention distances in pixels: at most the diagonal of the image between token centres.
    assert (analysis.distances >= 0).all() and (analysis.distances <= 24 * 2**0.5).all()
    output = model(images)
    picture = prediction_panel(images, output.corrupted, output.predictions, target=model.target,
                               patch_size=SMALL.token_size, min_height=28)
    assert picture.shape == (3 * 28 + 3, 4 * 28 + 3, 3)


def test_the_run_summary_names_the_stem():
    assert patches_of(DEMO) == "1 patches of a ResNet stem (layers [1], width 32, stride 4): tokens of [4, 4] px"


# Exports: Hugging Face has no hybrid; timm builds the stems of its registered hybrids.

R50_TINY = ViTConfig(image_size=32, patch_size=1, channels=3, dim=32, depth=1, heads=2, mlp_dim=128,
                     stem=StemConfig(layers=(3, 4, 9), width=64))


def test_hugging_face_export_refuses_a_hybrid(tmp_path: Path):
    model = ViT(SMALL)
    with pytest.raises(ValueError, match="ViTModel has no ResNet stem"):
        write_export(tmp_path, model.state_dict(), SMALL, "hf", mean=[0.5], std=[0.5])


def test_the_export_tool_refuses_a_hybrid_for_hugging_face_naming_the_way_out(tmp_path: Path, capsys):
    pretraining_checkpoint(tmp_path / "mpp.ckpt")
    assert mpp_command("export", str(tmp_path / "mpp.ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpp: error: ") and "has no ResNet stem" in err and not (tmp_path / "hf").exists()


def test_timm_export_refuses_a_stem_timm_does_not_build(tmp_path: Path):
    with pytest.raises(ValueError, match=r"encoder.stem has layers \[1\] and width 32"):
        write_export(tmp_path, ViT(SMALL).state_dict(), SMALL, "timm", mean=[0.5], std=[0.5])


def test_a_timm_export_of_an_r50_hybrid_comes_back_exactly(tmp_path: Path):
    model = encoder(R50_TINY)
    write_export(tmp_path, model.state_dict(), R50_TINY, "timm", mean=[0.5], std=[0.5])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architecture"] == "vit_base_r50_s16_224" and saved["model_args"]["embed_dim"] == 32
    config, weights = read_export(str(tmp_path))
    assert config == replace(R50_TINY, image_size=(32, 32), patch_size=(1, 1))
    assert weights.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value), name


def same_outputs(theirs: torch.nn.Module, ours: ViT) -> None:
    """timm's class-token features and our representation agree: to rounding in float32 (sixteen
    GroupNorm-ed blocks amplify it), to 1e-9 in float64, where the two compute the same function."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (theirs.forward_features(x)[:, 0] - ours(x)).abs().max() <= 1e-4
        x, theirs, ours = x.double(), theirs.double(), ours.double()
        assert (theirs.forward_features(x)[:, 0] - ours(x)).abs().max() <= 1e-9


@pytest.mark.bench
def test_timm_loads_the_hybrid_export_and_computes_our_encoder(tmp_path: Path):
    timm = pytest.importorskip("timm")
    ours = encoder(R50_TINY)
    write_export(tmp_path, ours.state_dict(), R50_TINY, "timm", mean=[0.5], std=[0.5])
    same_outputs(timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval(), ours)


@pytest.mark.bench
def test_a_hybrid_that_timm_wrote_imports_as_our_encoder(tmp_path: Path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    theirs = timm.create_model("vit_base_r50_s16_224", img_size=32, embed_dim=32, depth=1, num_heads=2,
                               num_classes=5).eval()
    timm.models.save_for_hf(theirs, str(tmp_path), safe_serialization=True)
    ours = load_encoder(str(tmp_path)).eval()
    assert ours.config == replace(R50_TINY, image_size=(32, 32), patch_size=(1, 1))
    same_outputs(theirs, ours)


@pytest.mark.bench
@pytest.mark.parametrize("name", sorted(layouts.TIMM_HYBRIDS))
def test_every_timm_hybrid_mpp_knows_builds_the_sizes_it_stands_for(name: str):
    timm = pytest.importorskip("timm")
    layers, dim, depth, heads, image = layouts.TIMM_HYBRIDS[name]
    with torch.device("meta"):
        theirs = timm.create_model(name, num_classes=0)
        ours = ViT(ViTConfig(image_size=image, patch_size=1, dim=dim, depth=depth, heads=heads, mlp_dim=4 * dim,
                             stem=StemConfig(layers=layers, width=layouts.TIMM_STEM_WIDTH)))
    theirs_shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    ours_shapes = {k: tuple(v.shape) for k, v in layouts.to_layout(ours.state_dict(), "timm").items()}
    assert theirs_shapes == ours_shapes
