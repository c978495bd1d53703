"""Multi-head self-attention of the ViT's blocks (mpp.model.vit): the fused kernels where they are the
faster, the explicit product where they are not, and the attention weights on request (Figure 7's
analyses, mpp.eval.analyses)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn


def attention_weights(q: Tensor, k: Tensor) -> Tensor:
    """q (B, heads, Q, d), k (B, heads, T, d) -> softmax(q kᵀ / √d) (B, heads, Q, T), in float32 as
    the fused kernels accumulate it."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    return scores.softmax(-1, dtype=torch.float32)


def mix(weights: Tensor, v: Tensor, dropout: float = 0.0) -> Tensor:
    """(B, heads, Q, T) attention weights, (B, heads, T, d) values -> (B, heads, Q, d), with dropout on
    the weights."""
    weights = weights.to(v.dtype)
    return (F.dropout(weights, dropout) if dropout else weights) @ v


def attend(q: Tensor, k: Tensor, v: Tensor, dropout: float = 0.0) -> Tensor:
    """softmax(q kᵀ / √d) v for (B, heads, Q or T, d) inputs, with dropout on the weights.

    The fused `scaled_dot_product_attention` kernels everywhere but in bf16 on the CPU, where the
    explicit product is faster: PyTorch's fused CPU kernel took 2.5x (ViT-B/16) to 7x (the demo's
    ViT) longer for forward and backward there (torch 2.13 and 2.14; benchmarks/bench_step.py).
    """
    if q.device.type != "cpu" or q.dtype != torch.bfloat16:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
    return mix(attention_weights(q, k), v, dropout)


class Attention(nn.Module):
    """Multi-head self-attention (`attend`: the fused kernels where they are the faster); dropout of
    its weights (`attention_dropout`) and of its output (`dropout`)."""

    def __init__(self, *, dim: int, heads: int, dropout: float, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(dropout)

    def split_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, D) -> q, k, v each (B, heads, T, D / heads)."""
        qkv = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        return qkv[0], qkv[1], qkv[2]

    def forward(
        self, x: Tensor, queries: Tensor | None = None, *, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(B, T, D) -> (B, T, D); with `queries` (B, Q) token indices, (B, Q, D) for those tokens,
        which still attend to all T. With `return_weights`, also the attention weights
        (B, heads, T or Q, T) in float32, which the fused kernels never form: the explicit product."""
        q, k, v = self.split_heads(x)
        if queries is not None:
            q = q.gather(2, queries[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
        dropout = self.attention_dropout if self.training else 0.0
        if return_weights:
            weights = attention_weights(q, k)
            out = mix(weights, v, dropout)
        else:
            out = attend(q, k, v, dropout)
        out = self.proj_drop(self.proj(rearrange(out, "b h t d -> b t (h d)")))
        return (out, weights) if return_weights else out
