"""The Vision Transformer encoder of Dosovitskiy et al. (2021): pre-LN blocks, a class token,
learned 1-D position embeddings, and a final LayerNorm; with `stem`, the paper's hybrid, whose
patches are cut from a ResNet's feature map (mpp.model.stem).

The encoder exposes the steps the pretraining and fine-tuning modules compose
(`embed_patches`, `add_positions`, `encode`) so that masked patch prediction can corrupt
patch embeddings between the projection and the position embeddings without reaching
into the encoder's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mpp.model.attention import Attention
from mpp.model.pixels import Size2d, pair
from mpp.model.stem import ResNetStem, StemConfig


@dataclass(frozen=True)
class ViTConfig:
    """The architecture of a ViT encoder; presets Ti/S/B/L/H live in `configs/model/`.

    Args:
        image_size: input height and width in pixels (an int for square images).
        patch_size: patch height and width, in pixels, or with a stem in cells of its feature map
            (1 for the paper's hybrids); `token_size` must divide `image_size`.
        dim: token width D.
        depth: number of transformer blocks L.
        heads: attention heads; must divide `dim`.
        mlp_dim: hidden width of each block's MLP.
        channels: input channels C.
        dropout: dropout after the position embeddings, in the MLP and on the attention's output
            (the reference ViT's `dropout_rate`: 0.1 when training from scratch).
        attention_dropout: dropout of the attention weights (the reference ViT's
            `attention_dropout_rate`, 0 in every recipe of the paper).
        drop_path: stochastic depth: the rate at which the last block's attention and MLP branches
            are skipped for a whole image in training, rising linearly from 0 at the first block
            (MAE and BEiT fine-tune ViT-B with 0.1; the paper uses none).
        stem: a ResNet-v2 stem (layers, width) whose features the patches are cut from; null: the
            pure ViT, patches of pixels.
    """

    image_size: int | tuple[int, int]
    patch_size: int | tuple[int, int]
    dim: int
    depth: int
    heads: int
    mlp_dim: int
    channels: int = 3
    dropout: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    stem: StemConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stem, Mapping):  # as checkpoints and hyperparameters store it
            object.__setattr__(self, "stem", StemConfig(**self.stem))
        for name in ("dim", "depth", "heads", "mlp_dim", "channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"encoder.{name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"encoder.dim ({self.dim}) must be divisible by encoder.heads ({self.heads})")
        for name in ("dropout", "attention_dropout", "drop_path"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"encoder.{name} must be in [0, 1), got {getattr(self, name)}")
        if min(pair(self.patch_size)) < 1:
            raise ValueError(f"encoder.patch_size must be at least 1, got {self.patch_size}")
        stride = "" if self.stem is None else f" times the stem's stride {self.stem.stride}"
        for image, token, axis in zip(pair(self.image_size), self.token_size, ("height", "width")):
            if image < 1 or image % token:
                raise ValueError(
                    f"encoder.patch_size {self.patch_size}{stride} must divide encoder.image_size "
                    f"{self.image_size} ({axis} {image} is not a multiple of {token})"
                )

    @property
    def token_size(self) -> Size2d:
        """(height, width) in pixels of the image region one token stands for: the patch size, times
        the stem's stride for a hybrid."""
        stride = 1 if self.stem is None else self.stem.stride
        patch_h, patch_w = pair(self.patch_size)
        return (patch_h * stride, patch_w * stride)

    def drop_path_rates(self) -> list[float]:
        """Each block's drop-path rate: `drop_path` x i / (depth - 1) for block i (0 where depth is 1)."""
        return [self.drop_path * i / max(1, self.depth - 1) for i in range(self.depth)]

    @property
    def grid(self) -> Size2d:
        """Tokens along (height, width)."""
        (image_h, image_w), (token_h, token_w) = pair(self.image_size), self.token_size
        return (image_h // token_h, image_w // token_w)

    @property
    def num_patches(self) -> int:
        """N = HW / P² (P the token size)."""
        grid_h, grid_w = self.grid
        return grid_h * grid_w


def pick(values: Tensor, positions: Tensor) -> Tensor:
    """(B, N, ...) values, (B, M) positions -> (B, M, ...) the values at those positions."""
    index = positions.view(*positions.shape, *([1] * (values.dim() - 2)))
    return values.gather(1, index.expand(-1, -1, *values.shape[2:]))


class MLP(nn.Module):
    """Linear-GELU-Linear, the position-wise feed-forward of each block."""

    def __init__(self, *, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: in training, each image's branch output is zeroed with probability `rate`
    and the others scaled by 1 / (1 - rate), so its expected value is unchanged; identity in eval."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:
        """(B, ...) -> (B, ...)."""
        if not self.training or self.rate == 0.0:
            return x
        keep = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), device=x.device) >= self.rate
        return x * keep.to(x.dtype) / (1.0 - self.rate)


class Block(nn.Module):
    """Pre-LN transformer block: z' = MSA(LN(z)) + z; z = MLP(LN(z')) + z' (each branch under `drop_path`)."""

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        mlp_dim: int,
        dropout: float,
        attention_dropout: float = 0.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        # eps 1e-6 as in the reference JAX implementation.
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim=dim, heads=heads, dropout=dropout, attention_dropout=attention_dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim=dim, hidden=mlp_dim, dropout=dropout)
        self.drop_path = DropPath(drop_path) if drop_path else nn.Identity()

    def forward(
        self, x: Tensor, queries: Tensor | None = None, *, return_attention: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(B, T, D) -> (B, T, D); with `queries` (B, Q) token indices, only those outputs (B, Q, D).
        With `return_attention`, also the attention weights (B, heads, T or Q, T) in float32."""
        shortcut = x if queries is None else pick(x, queries)
        attended = self.attn(self.norm1(x), queries, return_weights=return_attention)
        mixed, weights = attended if return_attention else (attended, None)
        x = shortcut + self.drop_path(mixed)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x if weights is None else (x, weights)


class ViT(nn.Module):
    """The ViT encoder; `forward(images)` is the image representation y = LN(z_L^0).

    Args:
        config: the architecture (see `ViTConfig`).
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.grid = config.grid
        self.stem = nn.Identity() if config.stem is None else ResNetStem(config.stem, channels=config.channels)
        features = config.channels if config.stem is None else config.stem.out_channels
        self.patch_embed = nn.Conv2d(
            features, config.dim, kernel_size=pair(config.patch_size), stride=pair(config.patch_size)
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, 1 + config.num_patches, config.dim))
        self.pos_drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(
                dim=config.dim,
                heads=config.heads,
                mlp_dim=config.mlp_dim,
                dropout=config.dropout,
                attention_dropout=config.attention_dropout,
                drop_path=rate,
            )
            for rate in config.drop_path_rates()
        )
        self.norm = nn.LayerNorm(config.dim, eps=1e-6)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise as the reference implementation: Xavier-uniform weights, zero biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # The patch projection is a linear map of the flattened patch: initialise it as one.
        nn.init.xavier_uniform_(self.patch_embed.weight.view(self.config.dim, -1))
        nn.init.zeros_(self.patch_embed.bias)  # type: ignore[arg-type]  # made with bias=True
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.zeros_(self.cls_token)

    def parameter_depths(self) -> dict[str, int]:
        """Each parameter's depth, by name: 0 for the embeddings (the stem, the patch projection, the class
        token, the positions), i + 1 for block i, depth + 1 for the final norm (layer-wise lr decay)."""
        depths = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                depths[name] = int(name.split(".")[1]) + 1
            else:
                depths[name] = self.config.depth + 1 if name.startswith("norm.") else 0
        return depths

    def embed_patches(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, N, D): the linear projection of every patch (of the stem's features, for a hybrid)."""
        if images.shape[-2:] != tuple(dim * token for dim, token in zip(self.grid, self.config.token_size)):
            raise ValueError(
                f"images of size {tuple(images.shape[-2:])} do not fit the encoder's "
                f"{self.grid} grid of tokens of {self.config.token_size} pixels"
            )
        return rearrange(self.patch_embed(self.stem(images)), "b d gh gw -> b (gh gw) d")

    def add_positions(self, patches: Tensor) -> Tensor:
        """(B, N, D) -> (B, 1 + N, D): prepend the class token, add position embeddings."""
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        return self.pos_drop(torch.cat([cls, patches], dim=1) + self.pos_embed)

    def encode(self, tokens: Tensor, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, 1 + N, D) -> class-token representation (B, D), patch representations (B, N, D).

        With `keep`, (B, M) patch indices, only those patches' representations (B, M, D) are
        returned, and the last block computes no others: their outputs feed nothing.
        """
        queries = None
        if keep is not None:
            cls = keep.new_zeros(keep.shape[0], 1)
            queries = torch.cat([cls, keep + 1], dim=1)  # token 0 is the class token
        for index, block in enumerate(self.blocks):
            tokens = block(tokens, queries if index == len(self.blocks) - 1 else None)
        tokens = self.norm(tokens)
        return tokens[:, 0], tokens[:, 1:]

    def forward(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, D), the image representation y = LN(z_L^0)."""
        tokens = self.add_positions(self.embed_patches(images))
        no_patches = torch.empty(tokens.shape[0], 0, dtype=torch.long, device=tokens.device)
        representation, _ = self.encode(tokens, keep=no_patches)
        return representation

    def pixel_filters(self) -> Tensor:
        """(K, C, k_h, k_w) the filters that see the pixels: the patch projection's, or for a hybrid
        the stem's first convolution, standardised as it is applied."""
        if isinstance(self.stem, ResNetStem):
            return self.stem.conv.standardised_weight()
        return self.patch_embed.weight

    @torch.no_grad()
    def resize_positions(self, image_size: int | tuple[int, int]) -> None:
        """Adapt the encoder to a new image size: 2-D interpolation of the patch position
        embeddings onto the new token grid; the class-token embedding is kept as it is."""
        config = ViTConfig(**{**self.config.__dict__, "image_size": pair(image_size)})
        if config.grid != self.grid:
            patch_pos = rearrange(self.pos_embed[:, 1:], "1 (gh gw) d -> 1 d gh gw", gh=self.grid[0])
            # Bicubic in float32: interpolating in bf16 loses the small std-0.02 values.
            patch_pos = F.interpolate(patch_pos.float(), size=config.grid, mode="bicubic", align_corners=False)
            patch_pos = rearrange(patch_pos, "1 d gh gw -> 1 (gh gw) d").to(self.pos_embed.dtype)
            self.pos_embed = nn.Parameter(torch.cat([self.pos_embed[:, :1], patch_pos], dim=1))
        self.config, self.grid = config, config.grid
