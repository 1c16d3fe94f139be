"""Causal self-attention with multi-head, grouped-query and multi-query variants.

`n_kv_heads` = `n_heads` is MHA, 1 is MQA, anything dividing `n_heads` is GQA. The kernel is
`F.scaled_dot_product_attention` (flash/memory-efficient on accelerators, fused on CPU).

A KV cache, when given, is any object with `attend(layer_idx, q, k, v)`: it stores the new
positions' keys and values and attends the queries over every cached position it allows
(the inference engine's `shardwise.generation.slot_cache.SlotKVCache`: a batch of sequences,
each at its own position).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.common.rope import apply_rope


class Attention(nn.Module):
    core_attention = staticmethod(lambda q, k, v: causal_attention(q, k, v))
    """softmax(q k^T / sqrt(d) + causal mask) v on [batch, heads, seq, head_dim] tensors. A layout
    may replace it on an instance (context parallelism attends across ranks' sequence shares);
    generation with a KV cache attends through the cache."""

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool, layer_idx: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, kv_cache=None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos_SD, sin_SD), apply_rope(k, cos_SD, sin_SD)
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def causal_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> torch.Tensor:
    return sdpa(q_BHSD, k_BHSD, v_BHSD, is_causal=True)


def sdpa(q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with fewer kv heads than query heads (GQA/MQA: each kv
    head serves n_heads / n_kv_heads query heads), natively where the kernel allows it."""
    if q_BHSD.shape[1] != k_BHTD.shape[1]:
        if native_gqa(q_BHSD):
            kwargs["enable_gqa"] = True
        else:
            repeats = q_BHSD.shape[1] // k_BHTD.shape[1]
            k_BHTD = k_BHTD.repeat_interleave(repeats, dim=1)
            v_BHTD = v_BHTD.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q_BHSD, k_BHTD, v_BHTD, **kwargs)


def native_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA's fused kernel takes fewer kv heads than query heads itself (`enable_gqa`),
    so the kv heads are not repeated: backward then keeps k and v at n_kv_heads width (GQA's
    memory saving, 1.5h of 16h per token for Llama 3 8B). CPU's kernel does at every dtype,
    CUDA's flash kernel in bf16/fp16; elsewhere (CUDA fp32: the memory-efficient kernel)
    enable_gqa would fall back to the O(S^2) math kernel, so kv heads are repeated there."""
    return q.device.type == "cpu" or q.dtype in (torch.bfloat16, torch.float16)
