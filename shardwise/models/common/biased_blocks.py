"""What the families with biased linears and LayerNorm (GPT-2, BERT, ViT) share inside their blocks:
the attention projections around a swappable core, and the init rule for LayerNorm / bias / weight.
Each family keeps its own `SelfAttention` subclass (its `core_attention` and `forward`) and its
own `initial_value` (GPT-2 scales its residual projections down).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.core.model import ModelConfig
from shardwise.models.common.decoder import seeded_normal


class BiasedSelfAttention(nn.Module):
    """Multi-head attention with biased q/k/v/o projections and no rotary embedding (the positions are
    already in the input). Separate q/k/v let tensor parallelism split each by heads like Llama's.
    A subclass sets `core_attention` (a staticmethod, which a layout may swap on an instance) and
    calls `attend` with it from `forward`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_size
        width = cfg.n_heads * cfg.head_size
        self.q_proj = nn.Linear(cfg.dim, width)
        self.k_proj = nn.Linear(cfg.dim, width)
        self.v_proj = nn.Linear(cfg.dim, width)
        self.o_proj = nn.Linear(width, cfg.dim)

    def attend(self, x_BSD: torch.Tensor, attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        """o_proj(attention(q, k, v)), q/k/v [B, heads, S, head_dim] projected from `x_BSD`."""
        B, S, _ = x_BSD.shape
        # -1 heads: all of them in one process, 1/tp of them on a tensor-parallel rank
        q, k, v = (proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def layer_norm_init(name: str, shape, device, seed: int, std: float) -> torch.Tensor:
    """LayerNorm weights 1, biases 0, every other weight (and table) normal(0, std). Each tensor draws
    from a generator seeded by (seed, name), so a sharded layout computes the same full tensor
    whichever parameters its rank holds, and keeps its part."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    return seeded_normal(name, shape, device, seed, std)
