"""Targets against hand-computed colours of synthetic images with known patch colours."""

import pytest
import torch

from mpp import (
    TargetConfig,
    downsized_colour_targets,
    mean_colour_targets,
    pixel_targets,
)
from mpp.model.pixels import Normalise
from mpp.model.targets import prediction_loss


def painted(colours: list[list[tuple[float, float, float]]], patch: int = 4) -> torch.Tensor:
    """An image whose patch (i, j) is filled with colours[i][j]: (1, 3, rows·patch, cols·patch)."""
    rows = torch.stack([torch.stack([torch.tensor(c).view(3, 1, 1).expand(3, patch, patch) for c in row], -1) for row in colours])
    # rows: (R, 3, patch, patch, C) -> image (3, R·patch, C·patch)
    return torch.cat([torch.cat(list(r.unbind(-1)), dim=-1) for r in rows.unbind(0)], dim=-2).unsqueeze(0)


def test_known_colours_give_the_hand_computed_classes():
    colours = [
        [(0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (1.0, 0.0, 0.0)],
        [(0.125, 0.0, 0.0), (0.0, 0.124, 0.0), (0.3, 0.6, 0.9)],
    ]
    images = painted(colours)
    # level = min(floor(8·v), 7); class = r·64 + g·8 + b
    expected = [
        0,  # black
        7 * 64 + 7 * 8 + 7,  # white: floor(8·1.0) = 8 is clamped to 7 -> 511
        7 * 64,  # red
        1 * 64,  # exactly 1/8 is level 1
        0,  # just below 1/8 is level 0
        2 * 64 + 4 * 8 + 7,  # 0.3 -> 2, 0.6 -> 4, 0.9 -> 7
    ]
    assert mean_colour_targets(images, patch_size=4).tolist() == [expected]


def test_the_mean_is_over_the_whole_patch():
    image = torch.zeros(1, 3, 4, 8)
    image[:, :, :2, :4] = 1.0  # top half of the first patch white: mean 0.5 -> level 4
    image[:, 0, :, 4:] = torch.linspace(0, 0.5, 16).view(4, 4)  # mean red 0.25 -> level 2
    assert mean_colour_targets(image, patch_size=4).tolist() == [[4 * 64 + 4 * 8 + 4, 2 * 64]]


def test_normalised_inputs_give_the_same_targets():
    images = torch.rand(2, 3, 16, 16)
    normalise = Normalise(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    direct = mean_colour_targets(images, patch_size=4)
    undone = mean_colour_targets(normalise(images), patch_size=4, mean=normalise.mean.flatten().tolist(), std=normalise.std.flatten().tolist())
    # Identical but for patches whose mean lies within float rounding of a level boundary.
    assert (direct == undone).float().mean() > 0.99


def test_grayscale_gives_eight_classes_and_non_square_patches_work():
    image = torch.tensor([0.0, 0.2, 0.5, 1.0]).view(1, 1, 1, 4).expand(1, 1, 3, 4).repeat_interleave(2, -1)
    assert mean_colour_targets(image, patch_size=(3, 2)).tolist() == [[0, 1, 4, 7]]


def test_downsized_colour_targets_are_per_cell():
    # One 8x8 patch downsized to 4x4: each 2x2 cell has its own colour.
    cells = torch.rand(1, 3, 4, 4)
    image = cells.repeat_interleave(2, -1).repeat_interleave(2, -2)
    targets = downsized_colour_targets(image, patch_size=8, cells=4)
    assert targets.shape == (1, 1, 16)
    levels = (cells * 8).floor().clamp(max=7).long()
    expected = (levels[:, 0] * 64 + levels[:, 1] * 8 + levels[:, 2]).flatten()
    assert targets[0, 0].tolist() == expected.tolist()


def test_pixel_targets_raw_and_normalised():
    images = torch.rand(2, 3, 8, 8)
    raw = pixel_targets(images, patch_size=4, normalise=False)
    assert raw.shape == (2, 4, 48)
    torch.testing.assert_close(raw[0, 1], images[0, :, :4, 4:].permute(1, 2, 0).flatten())
    normed = pixel_targets(images, patch_size=4)
    torch.testing.assert_close(normed.mean(-1), torch.zeros(2, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(normed.std(-1, unbiased=False), torch.ones(2, 4), atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "kind, channels, per_patch, outputs",
    [("mean_colour", 3, 1, 512), ("mean_colour", 1, 1, 8), ("downsized_colour", 3, 16, 512), ("pixels", 3, 1, 16 * 16 * 3)],
)
def test_head_sizes(kind, channels, per_patch, outputs):
    config = TargetConfig(kind=kind)
    assert config.predictions_per_patch() == per_patch
    assert config.outputs_per_prediction(channels=channels, patch_size=16) == outputs


def test_loss_is_cross_entropy_for_classes_and_l2_for_pixels():
    logits = torch.randn(2, 3, 512)
    targets = torch.randint(0, 512, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.reshape(6, 512), targets.reshape(6))
    torch.testing.assert_close(prediction_loss(logits, targets), expected)
    values, pixels = torch.randn(2, 3, 12), torch.randn(2, 3, 12)
    torch.testing.assert_close(prediction_loss(values, pixels), ((values - pixels) ** 2).mean())


def test_unknown_target_kind_fails_naming_it():
    with pytest.raises(ValueError, match="target.kind"):
        TargetConfig(kind="colour")
