"""The encoder: parameter counts, patchify, attention, positions and their resize."""

import math
from dataclasses import replace

import pytest
import torch
import yaml
from einops import rearrange
from workspace import ROOT

from mpp import ViT, ViTConfig, patchify
from mpp.model.attention import Attention, attend, attention_weights
from mpp.model.vit import DropPath

PRESETS = ROOT / "configs" / "model"


def preset(name: str, **overrides) -> ViTConfig:
    return ViTConfig(**{**yaml.safe_load((PRESETS / f"vit_{name}.yaml").read_text()), **overrides})


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_vit_b16_has_the_papers_parameter_count():
    assert count(ViT(preset("b", image_size=224, patch_size=16))) == 85_798_656


@pytest.mark.parametrize(
    "name, expected",
    # Expected counts from the architecture: per block 4D² + 4D (attention) + 2·D·F + D + F (MLP)
    # + 4D (two norms); plus the patch projection, class token, positions and final norm.
    [("ti", None), ("s", None), ("b", 85_798_656)],
)
def test_preset_parameter_count_matches_the_formula(name, expected):
    config = preset(name, image_size=224, patch_size=16)
    d, f, n = config.dim, config.mlp_dim, config.num_patches
    per_block = (4 * d * d + 4 * d) + (2 * d * f + d + f) + 4 * d
    formula = config.depth * per_block + (16 * 16 * 3 * d + d) + d + (n + 1) * d + 2 * d
    assert count(ViT(config)) == formula
    if expected is not None:
        assert formula == expected


def test_patchify_matches_explicit_slicing():
    images = torch.randn(2, 3, 12, 20)
    patches = patchify(images, (4, 5))
    assert patches.shape == (2, 3 * 4, 4 * 5 * 3)
    for row in range(3):
        for col in range(4):
            expected = images[:, :, row * 4 : (row + 1) * 4, col * 5 : (col + 1) * 5]
            expected = expected.permute(0, 2, 3, 1).reshape(2, -1)  # (p_h, p_w, c) order
            torch.testing.assert_close(patches[:, row * 4 + col], expected)


def test_patch_embedding_is_a_linear_projection_of_flattened_patches():
    model = ViT(ViTConfig(image_size=(8, 12), patch_size=4, dim=16, depth=1, heads=2, mlp_dim=32, channels=2))
    images = torch.randn(3, 2, 8, 12)
    weight = rearrange(model.patch_embed.weight, "d c ph pw -> d (ph pw c)")
    expected = patchify(images, 4) @ weight.T + model.patch_embed.bias
    torch.testing.assert_close(model.embed_patches(images), expected, rtol=1e-5, atol=1e-5)


def test_fused_attention_matches_the_textbook_formula():
    model = ViT(ViTConfig(image_size=8, patch_size=4, dim=32, depth=1, heads=4, mlp_dim=64))
    attention = model.blocks[0].attn
    x = torch.randn(2, 5, 32)
    q, k, v = attention.split_heads(x)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    expected = attention.proj(rearrange(weights @ v, "b h t d -> b t (h d)"))
    torch.testing.assert_close(attention(x), expected, rtol=1e-5, atol=1e-5)


def test_bf16_attention_on_the_cpu_matches_the_fused_kernel_and_drops_weights():
    q, k, v = (torch.randn(3, 4, 17, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    explicit = attend(q.bfloat16(), k.bfloat16(), v.bfloat16())  # the explicit product, not the fused kernel
    assert explicit.dtype == torch.bfloat16
    torch.testing.assert_close(explicit.float(), fused, rtol=0.02, atol=0.02)
    # Dropout zeroes attention weights: with p near 1 almost every output is 0; gradients flow.
    qb = q.bfloat16().requires_grad_()
    dropped = attend(qb, k.bfloat16(), v.bfloat16(), dropout=0.999)
    assert (dropped == 0).float().mean() > 0.9
    attend(qb, k.bfloat16(), v.bfloat16()).float().sum().backward()
    assert qb.grad is not None and qb.grad.abs().sum() > 0


def test_attention_weights_are_dropped_by_attention_dropout_alone(monkeypatch):
    """As the reference ViT: `dropout` (0.1 from scratch) after the position embeddings, in the MLP and on
    the attention's output; `attention_dropout` (0 in every recipe) on the attention weights."""
    config = ViTConfig(image_size=8, patch_size=4, dim=16, depth=2, heads=2, mlp_dim=32, dropout=0.1)
    model = ViT(config)
    assert config.attention_dropout == 0.0
    for block in model.blocks:
        assert block.attn.attention_dropout == 0.0 and block.attn.proj_drop.p == 0.1 and block.mlp.drop.p == 0.1
    asked = []

    def recording(q, k, v, dropout=0.0):
        asked.append(dropout)
        return attend(q, k, v, dropout)

    monkeypatch.setattr("mpp.model.attention.attend", recording)
    images = torch.randn(2, 3, 8, 8)
    model.train()(images)
    assert asked == [0.0, 0.0]
    asked.clear()
    ViT(replace(config, attention_dropout=0.2)).train()(images)
    assert asked == [0.2, 0.2]
    asked.clear()
    ViT(replace(config, attention_dropout=0.2)).eval()(images)
    assert asked == [0.0, 0.0]
    # Without any dropout, training and evaluation compute the same; with the weights' alone, not.
    torch.manual_seed(0)
    attention = Attention(dim=16, heads=2, dropout=0.0, attention_dropout=0.0)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(attention.train()(x), attention.eval()(x))
    attention.attention_dropout = 0.5
    assert not torch.allclose(attention.train()(x), attention.eval()(x))
    with pytest.raises(ValueError, match=r"encoder.attention_dropout must be in \[0, 1\), got 1.0"):
        replace(config, attention_dropout=1.0)


def test_blocks_asked_for_their_attention_give_the_fused_output_and_the_textbook_weights():
    config = ViTConfig(image_size=(8, 12), patch_size=(4, 2), dim=16, depth=3, heads=2, mlp_dim=32, channels=1,
                       dropout=0.1)
    model = ViT(config).eval()  # dropout off: the fused kernel draws its own
    tokens = model.add_positions(model.embed_patches(torch.randn(3, 1, 8, 12)))
    queries = torch.tensor([[0, 2], [0, 5], [0, 1]])
    for block in model.blocks:
        q, k, _ = block.attn.split_heads(block.norm1(tokens))
        textbook = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        for kept, expected in ((None, textbook), (queries, textbook.gather(2, queries[:, None, :, None].expand(
                -1, config.heads, -1, tokens.shape[1])))):
            explicit, weights = block(tokens, kept, return_attention=True)
            torch.testing.assert_close(explicit, block(tokens, kept), atol=1e-5, rtol=1e-5)
            assert weights.dtype == torch.float32
            torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
        tokens = block(tokens)


def test_attention_weights_are_computed_in_float32_from_bf16():
    q, k = (torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(2))
    weights = attention_weights(q.bfloat16(), k.bfloat16())
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5))
    torch.testing.assert_close(weights, attention_weights(q, k), atol=0.02, rtol=0.02)


def test_block_is_pre_norm_residual():
    model = ViT(ViTConfig(image_size=8, patch_size=4, dim=16, depth=1, heads=2, mlp_dim=32))
    block = model.blocks[0]
    x = torch.randn(2, 5, 16)
    z = x + block.attn(block.norm1(x))
    torch.testing.assert_close(block(x), z + block.mlp(block.norm2(z)))


def test_representation_is_the_normed_class_token_and_non_square_inputs_work():
    config = ViTConfig(image_size=(16, 24), patch_size=(8, 4), dim=24, depth=2, heads=3, mlp_dim=48, channels=5)
    model = ViT(config).eval()
    images = torch.randn(2, 5, 16, 24)
    tokens = model.add_positions(model.embed_patches(images))
    assert tokens.shape == (2, 1 + 2 * 6, 24)
    cls, patches = model.encode(tokens)
    assert patches.shape == (2, 12, 24)
    torch.testing.assert_close(model(images), cls)
    # The final LayerNorm: zero mean, unit variance per token (its affine is the identity at init).
    torch.testing.assert_close(cls.mean(-1), torch.zeros(2), atol=1e-5, rtol=0)


def test_position_embeddings_are_initialised_with_std_002():
    model = ViT(preset("b", image_size=224, patch_size=16))
    assert abs(model.pos_embed.std().item() - 0.02) < 0.001


def test_resize_to_the_same_grid_is_the_identity():
    model = ViT(ViTConfig(image_size=28, patch_size=4, dim=16, depth=1, heads=2, mlp_dim=32))
    before = model.pos_embed.detach().clone()
    model.resize_positions(28)
    torch.testing.assert_close(model.pos_embed, before)


def test_resize_interpolates_the_grid_and_keeps_the_class_embedding():
    model = ViT(ViTConfig(image_size=28, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=16))
    # A position embedding that is a smooth (linear) function of the grid coordinates.
    rows, cols = torch.meshgrid(torch.arange(7.0), torch.arange(7.0), indexing="ij")
    with torch.no_grad():
        model.pos_embed[0, 1:] = (rows + 2 * cols).flatten().unsqueeze(-1).expand(-1, 8)
    cls_before = model.pos_embed[0, 0].detach().clone()
    model.resize_positions((32, 28))  # 7x7 -> 8x7
    assert model.pos_embed.shape == (1, 1 + 8 * 7, 8)
    assert model.grid == (8, 7) and model.config.image_size == (32, 28)
    torch.testing.assert_close(model.pos_embed[0, 0], cls_before)
    grid = model.pos_embed[0, 1:, 0].reshape(8, 7)
    # Columns are untouched in width; rows are stretched: still increasing, same range ends.
    torch.testing.assert_close(grid[:, 1] - grid[:, 0], torch.full((8,), 2.0), atol=1e-4, rtol=0)
    assert (grid[1:, 0] > grid[:-1, 0]).all()
    assert model(torch.randn(1, 3, 32, 28)).shape == (1, 8)


@pytest.mark.parametrize(
    "overrides, key",
    [({"patch_size": 5}, "patch_size"), ({"heads": 5}, "heads"), ({"dropout": 1.5}, "dropout"), ({"depth": 0}, "depth"),
     ({"drop_path": 1.0}, "drop_path")],
)
def test_bad_configs_fail_naming_the_key(overrides, key):
    settings = {"image_size": 28, "patch_size": 4, "dim": 16, "depth": 1, "heads": 2, "mlp_dim": 32, **overrides}
    with pytest.raises(ValueError, match=key):
        ViTConfig(**settings)


def test_wrong_image_size_fails_clearly():
    model = ViT(ViTConfig(image_size=28, patch_size=4, dim=16, depth=1, heads=2, mlp_dim=32))
    with pytest.raises(ValueError, match="do not fit"):
        model(torch.randn(1, 3, 32, 32))


def test_encoding_only_the_kept_patches_gives_the_same_representations():
    model = ViT(ViTConfig(image_size=(8, 12), patch_size=4, dim=16, depth=3, heads=2, mlp_dim=32)).eval()
    tokens = model.add_positions(model.embed_patches(torch.randn(3, 3, 8, 12)))
    cls, patches = model.encode(tokens)
    keep = torch.tensor([[5, 0, 2], [1, 1, 4], [3, 2, 0]])
    cls_kept, kept = model.encode(tokens, keep=keep)
    torch.testing.assert_close(cls_kept, cls, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept, patches.gather(1, keep.unsqueeze(-1).expand(-1, -1, 16)), rtol=1e-5, atol=1e-5)
    nothing = model.encode(tokens, keep=torch.empty(3, 0, dtype=torch.long))
    assert nothing[1].shape == (3, 0, 16)
    torch.testing.assert_close(nothing[0], cls, rtol=1e-5, atol=1e-5)


def test_gradients_through_kept_patches_match_the_full_encoding():
    # In float64: the class token's gradient here is ~1e-4, a sum of far larger terms, and float32's rounding
    # of them differed by up to 2e-5 between the two ways for some random weights (seeds 113, 145, 186 of 200).
    model = ViT(ViTConfig(image_size=8, patch_size=4, dim=16, depth=2, heads=2, mlp_dim=32)).double()
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    keep = torch.tensor([[3, 1], [0, 2]])

    def gradients(**kwargs) -> dict[str, torch.Tensor]:
        model.zero_grad()
        _, patches = model.encode(model.add_positions(model.embed_patches(images)), **kwargs)
        if not kwargs:
            patches = patches.gather(1, keep.unsqueeze(-1).expand(-1, -1, 16))
        patches.square().sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    full, kept = gradients(), gradients(keep=keep)
    for name in full:
        torch.testing.assert_close(kept[name], full[name], rtol=1e-9, atol=1e-12, msg=name)


def test_drop_path_rises_linearly_over_depth_from_zero():
    config = ViTConfig(image_size=8, patch_size=4, dim=8, depth=4, heads=2, mlp_dim=16, drop_path=0.3)
    assert config.drop_path_rates() == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert replace(config, depth=1).drop_path_rates() == [0.0]
    rates = [getattr(block.drop_path, "rate", 0.0) for block in ViT(config).blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])


def test_drop_path_drops_whole_images_and_keeps_the_expected_output_in_training():
    x = torch.randn(40_000, 3, 2, generator=torch.Generator().manual_seed(0)).abs() + 1
    torch.manual_seed(1)
    out = DropPath(0.25).train()(x)
    dropped = (out == 0).flatten(1)
    assert (dropped.all(1) | ~dropped.any(1)).all(), "an image's branch is dropped whole or not at all"
    assert dropped.all(1).float().mean().item() == pytest.approx(0.25, abs=0.01)
    kept = ~dropped.all(1)
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    assert out.mean().item() == pytest.approx(x.mean().item(), rel=0.01)
    assert DropPath(0.25).eval()(x) is x


def test_an_encoder_with_drop_path_is_the_same_encoder_in_eval():
    config = ViTConfig(image_size=8, patch_size=4, dim=8, depth=3, heads=2, mlp_dim=16)
    plain, dropping = ViT(config), ViT(replace(config, drop_path=0.5))
    assert plain.state_dict().keys() == dropping.state_dict().keys()
    dropping.load_state_dict(plain.state_dict())
    images = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(dropping.eval()(images), plain.eval()(images), rtol=0, atol=0)
    torch.manual_seed(2)
    assert not torch.equal(dropping.train()(images), plain.eval()(images))
