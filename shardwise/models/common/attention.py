"""Causal self-attention with multi-head, grouped-query and multi-query variants, optional
per-head q/k norms (Qwen3) and an optional sliding window (Mistral, Qwen2/3).

`n_kv_heads` = `n_heads` is MHA, 1 is MQA, anything dividing `n_heads` is GQA. The kernel is
`F.scaled_dot_product_attention` (flash/memory-efficient on accelerators, fused on CPU).

Sliding window `w` (0 = off): the query at position i attends the keys at positions j with
i - w < j <= i, that is itself and the w - 1 before it, as HF transformers' `sliding_window`
masks do (`masking_utils.sliding_window_overlay`: kv_idx > q_idx - sliding_window). It is
applied as an explicit boolean mask, built per call: SDPA's `is_causal` has no window, and a
mask costs S x S bytes per call next to the S x S scores the kernel computes anyway.

The attention core and a KV cache receive the window as a keyword (`window=w`) only when there
is one: a core or cache that does not know windows then fails on a windowed model instead of
silently attending the whole past.

A packed batch (several documents per row) gives the core a `DocumentMask`
(models/common/document_mask.py) as `mask=` instead: the model builds it once per forward from
its document ids, sliding window included, and every layer attends through it. A core that does
not know masks (context parallelism's) fails on it instead of attending across documents.

A KV cache, when given, is any object with `attend(layer_idx, q, k, v[, window=w])`: it stores
the new positions' keys and values and attends the queries over every cached position it allows
(the inference engine's `shardwise.generation.slot_cache.SlotKVCache`: a batch of sequences,
each at its own position).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.common.norm import RMSNorm
from shardwise.models.common.rope import apply_rope


class Attention(nn.Module):
    core_attention = staticmethod(lambda q, k, v, **mask: causal_attention(q, k, v, **mask))
    """softmax(q k^T / sqrt(d) + causal mask) v on [batch, heads, seq, head_dim] tensors (with
    `window=w`, the sliding-window mask; with `mask=`, a packed batch's document mask). A layout
    may replace it on an instance (context parallelism attends across ranks' sequence shares);
    generation with a KV cache attends through the cache."""

    def __init__(self, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool, layer_idx: int,
                 qk_norm: bool = False, norm_eps: float = 1e-5, sliding_window: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        # Qwen3: one RMSNorm of width head_dim shared by all heads, on q and k before RoPE.
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x_BSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, kv_cache=None,
                document_mask=None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BSHD = self.q_proj(x_BSD).view(B, S, -1, self.head_dim)
        k_BSHD = self.k_proj(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q_BSHD, k_BSHD = self.q_norm(q_BSHD), self.k_norm(k_BSHD)
        q, k = q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2)
        v = self.v_proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos_SD, sin_SD), apply_rope(k, cos_SD, sin_SD)
        window = {"window": self.sliding_window} if self.sliding_window else {}
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v, **window)
        elif document_mask is not None:  # the window is part of the mask
            out = self.core_attention(q, k, v, mask=document_mask)
        else:
            out = self.core_attention(q, k, v, **window)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def causal_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, window: int = 0,
                     mask=None) -> torch.Tensor:
    """Causal attention of a whole sequence (queries and keys at positions 0..S-1); `window` > 0
    limits each query to the `window` latest keys (itself included). With `mask` (a packed batch's
    `DocumentMask`, its window included), each query attends only its own document's keys."""
    if mask is not None:
        return mask.attend(q_BHSD, k_BHSD, v_BHSD)
    seq_len = q_BHSD.shape[2]
    if not window or window >= seq_len:  # a window as long as the sequence cuts nothing
        return sdpa(q_BHSD, k_BHSD, v_BHSD, is_causal=True)
    positions = torch.arange(seq_len, device=q_BHSD.device)
    return sdpa(q_BHSD, k_BHSD, v_BHSD, attn_mask=sliding_window_mask(positions, positions, window))


def bidirectional_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                            padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Encoder attention (BERT, ViT): every query attends every key. `padding_mask_BS` (bool or
    0/1, True = a real token) keeps the queries off padding keys, as HF's `attention_mask`; the
    outputs at padding positions are computed but meaningless, as in HF."""
    if padding_mask_BS is None:
        return sdpa(q_BHSD, k_BHSD, v_BHSD)
    keep_B11T = padding_mask_BS.bool()[:, None, None, :]
    return sdpa(q_BHSD, k_BHSD, v_BHSD, attn_mask=keep_B11T)


def sliding_window_mask(query_pos: torch.Tensor, key_pos_T: torch.Tensor, window: int) -> torch.Tensor:
    """[..., S, T] bool, True where the query at `query_pos[..., s]` attends the key at position
    `key_pos_T[t]`: causal, and (window > 0) i - window < j, HF's convention."""
    query = query_pos[..., None]
    allowed = key_pos_T <= query
    if window:
        allowed = allowed & (key_pos_T > query - window)
    return allowed


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


HOPPER_KERNEL_ORDER = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
"""SDPA's kernel preference on Hopper GPUs: cuDNN's fused attention first, then torch's own order."""


def attention_kernel_order(device: torch.device):
    """A context that sets SDPA's kernel preference for a run on `device` (the order is
    process-global state, restored on exit). torch tries flash attention first on every GPU; on
    Hopper (compute capability 9.x) cuDNN's attention is faster for training shapes at the same
    accuracy (1.6-1.9x flash's speed on an H100: benchmarks/attention_kernels.py, docs/benchmarks.md), so it goes first
    there, and a call it cannot take falls back in torch's order. Elsewhere nothing changes."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in HOPPER_KERNEL_ORDER], set_priority=True)


def native_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA's fused kernel takes fewer kv heads than query heads itself (`enable_gqa`),
    so the kv heads are not repeated: backward then keeps k and v at n_kv_heads width (GQA's
    memory saving, 1.5h of 16h per token for Llama 3 8B). CPU's kernel does at every dtype,
    CUDA's flash kernel in bf16/fp16; elsewhere (CUDA fp32: the memory-efficient kernel)
    enable_gqa would fall back to the O(S^2) math kernel, so kv heads are repeated there."""
    return q.device.type == "cpu" or q.dtype in (torch.bfloat16, torch.float16)
