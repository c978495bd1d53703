"""Corruption: how many patches, in which proportions, and that each kind means what it says."""

import pytest
import torch

from mpp import CorruptionConfig, corrupt_patches
from mpp.model.corruption import KEPT, MASKED, REPLACED


def distinct_patches(batch: int, n: int, dim: int) -> torch.Tensor:
    """Patch embeddings that are all different, so each token can be traced to its source."""
    return torch.randn(batch, n, dim, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("n, ratio, expected", [(196, 0.5, 98), (49, 0.5, 24), (16, 0.15, 2), (4, 1.0, 4)])
def test_a_fixed_number_of_distinct_patches_is_corrupted(n, ratio, expected):
    patches = distinct_patches(8, n, 4)
    out = corrupt_patches(patches, mask_token=torch.zeros(4), config=CorruptionConfig(ratio=ratio))
    assert out.positions.shape == out.kinds.shape == (8, expected)
    assert out.tokens.shape == patches.shape
    for row in out.positions:
        assert len(set(row.tolist())) == expected  # no patch chosen twice


def test_proportions_over_many_draws():
    generator = torch.Generator().manual_seed(1)
    patches = distinct_patches(256, 196, 4)
    kinds = torch.cat(
        [corrupt_patches(patches, mask_token=torch.zeros(4), generator=generator).kinds for _ in range(20)]
    )
    total = kinds.numel()  # 20 · 256 · 98 = 501,760 draws: the shares are within ±0.3% of the truth
    assert kinds.shape[1] == 98
    assert abs((kinds == MASKED).sum().item() / total - 0.8) < 0.003
    assert abs((kinds == REPLACED).sum().item() / total - 0.1) < 0.003
    assert abs((kinds == KEPT).sum().item() / total - 0.1) < 0.003


def test_every_patch_is_equally_likely_to_be_chosen():
    generator = torch.Generator().manual_seed(2)
    patches = distinct_patches(512, 16, 2)
    out = corrupt_patches(patches, mask_token=torch.zeros(2), generator=generator)
    hits = torch.bincount(out.positions.flatten(), minlength=16).float() / 512
    torch.testing.assert_close(hits, torch.full((16,), 0.5), atol=0.07, rtol=0)


def test_each_kind_does_what_it_says_and_unselected_patches_are_untouched():
    n, dim = 64, 8
    patches = distinct_patches(32, n, dim)
    mask_token = torch.full((dim,), 7.0)
    out = corrupt_patches(patches, mask_token=mask_token, generator=torch.Generator().manual_seed(3))
    seen = {MASKED: 0, REPLACED: 0, KEPT: 0}
    for b in range(32):
        chosen = set(out.positions[b].tolist())
        for i in range(n):
            if i not in chosen:
                assert torch.equal(out.tokens[b, i], patches[b, i])
        for position, kind in zip(out.positions[b].tolist(), out.kinds[b].tolist()):
            token = out.tokens[b, position]
            seen[kind] += 1
            if kind == MASKED:
                assert torch.equal(token, mask_token)
            elif kind == KEPT:
                assert torch.equal(token, patches[b, position])  # bit-identical
            else:
                matches = [j for j in range(n) if torch.equal(token, patches[b, j])]
                assert len(matches) == 1 and matches[0] != position  # another patch, never itself
                assert out.sources[b, out.positions[b].tolist().index(position)] == matches[0]
    assert all(count > 0 for count in seen.values())


def test_random_replacements_come_from_every_other_patch():
    n = 5
    patches = torch.arange(n, dtype=torch.float32).view(1, n, 1).expand(4000, n, 1).contiguous()
    config = CorruptionConfig(ratio=0.2, mask=0.0, random=1.0, keep=0.0)
    out = corrupt_patches(patches, mask_token=torch.zeros(1), config=config, generator=torch.Generator().manual_seed(4))
    source = out.tokens[torch.arange(4000), out.positions[:, 0], 0].long()
    assert (source != out.positions[:, 0]).all()
    # Given the position, the source is uniform over the four others.
    for position in range(n):
        sources = source[out.positions[:, 0] == position]
        share = torch.bincount(sources, minlength=n).float() / len(sources)
        expected = torch.full((n,), 0.25)
        expected[position] = 0.0
        torch.testing.assert_close(share, expected, atol=0.08, rtol=0)


def test_reproducible_under_a_seed_and_different_without():
    patches = distinct_patches(4, 49, 8)
    token = torch.zeros(8)
    a = corrupt_patches(patches, mask_token=token, generator=torch.Generator().manual_seed(5))
    b = corrupt_patches(patches, mask_token=token, generator=torch.Generator().manual_seed(5))
    c = corrupt_patches(patches, mask_token=token, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.positions, b.positions)
    assert not torch.equal(a.positions, c.positions)


def test_gradients_reach_the_mask_token_and_the_patches():
    patches = distinct_patches(2, 16, 4).requires_grad_()
    token = torch.zeros(4, requires_grad=True)
    corrupt_patches(patches, mask_token=token).tokens.sum().backward()
    assert token.grad.abs().sum() > 0 and patches.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "settings, key",
    [({"ratio": 1.5}, "ratio"), ({"ratio": 0.0}, "ratio"), ({"mask": 0.7}, "sum to 1"), ({"keep": -0.1}, "keep")],
)
def test_impossible_settings_fail_naming_them(settings, key):
    with pytest.raises(ValueError, match=key):
        CorruptionConfig(**settings)


BLOCKS = CorruptionConfig(layout="blocks")


def corrupted_neighbours(positions: torch.Tensor, grid: tuple[int, int]) -> float:
    """The mean number of a corrupted patch's 4 neighbours that are corrupted too."""
    height, width = grid
    chosen = torch.zeros(positions.shape[0], height * width).scatter(1, positions, 1.0).view(-1, height, width)
    neighbours = torch.zeros_like(chosen)
    neighbours[:, 1:] += chosen[:, :-1]
    neighbours[:, :-1] += chosen[:, 1:]
    neighbours[:, :, 1:] += chosen[:, :, :-1]
    neighbours[:, :, :-1] += chosen[:, :, 1:]
    return float((neighbours * chosen).sum() / chosen.sum())


@pytest.mark.parametrize("grid, ratio, expected", [((7, 7), 0.5, 24), ((7, 7), 0.75, 37), ((14, 14), 0.5, 98),
                                                   ((5, 9), 0.3, 14), ((1, 6), 0.5, 3), ((3, 4), 1.0, 12)])
def test_blocks_corrupt_the_same_fixed_number_of_distinct_patches(grid, ratio, expected):
    n = grid[0] * grid[1]
    config = CorruptionConfig(ratio=ratio, layout="blocks")
    out = corrupt_patches(distinct_patches(64, n, 4), mask_token=torch.zeros(4), config=config, grid=grid,
                          generator=torch.Generator().manual_seed(7))
    assert out.positions.shape == out.kinds.shape == (64, expected)
    for row in out.positions:
        assert len(set(row.tolist())) == expected and 0 <= min(row) and max(row) < n


@pytest.mark.parametrize("grid, ratio", [((7, 7), 0.5), ((7, 7), 0.75), ((14, 14), 0.5), ((5, 9), 0.3)])
def test_blocks_corrupt_neighbouring_patches_where_scattered_ones_are_apart(grid, ratio):
    n = grid[0] * grid[1]
    patches, token = distinct_patches(2000, n, 1), torch.zeros(1)
    draws = {layout: corrupt_patches(patches, mask_token=token, config=CorruptionConfig(ratio=ratio, layout=layout),
                                     grid=grid, generator=torch.Generator().manual_seed(8)).positions
             for layout in ("scattered", "blocks")}
    # A scattered patch has on average ~4 x ratio corrupted neighbours (fewer at the edges); one in a block more.
    scattered, blocks = (corrupted_neighbours(draws[layout], grid) for layout in ("scattered", "blocks"))
    assert scattered < 4 * ratio
    assert blocks > scattered + 0.4, (blocks, scattered)


def test_blocks_are_drawn_the_same_from_the_same_generator_and_split_as_the_paper():
    patches, token = distinct_patches(256, 196, 4), torch.zeros(4)

    def draw(seed: int):
        return corrupt_patches(patches, mask_token=token, config=BLOCKS, grid=(14, 14),
                               generator=torch.Generator().manual_seed(seed))

    first, again, other = draw(9), draw(9), draw(10)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first.positions, other.positions)
    kinds = torch.cat([draw(seed).kinds for seed in range(11, 31)])  # 501,760 draws, as above
    for kind, share in ((MASKED, 0.8), (REPLACED, 0.1), (KEPT, 0.1)):
        assert abs((kinds == kind).sum().item() / kinds.numel() - share) < 0.003


def test_blocks_need_the_grid_and_a_layout_must_be_known():
    with pytest.raises(ValueError, match="the blocks layout needs the grid of the 49 patches, got None"):
        corrupt_patches(distinct_patches(2, 49, 4), mask_token=torch.zeros(4), config=BLOCKS)
    with pytest.raises(ValueError, match="corruption.layout must be scattered or blocks, got 'stripes'"):
        CorruptionConfig(layout="stripes")  # type: ignore[arg-type]
