"""A Llama-family decoder for one device, in plain torch.nn: Llama, Mistral (sliding-window
attention: `model.sliding_window`), Qwen2 (q/k/v biases: `model.qkv_bias`), Qwen3 (per-head
q/k RMSNorms: `model.qk_norm`), and their mixture-of-experts kin (Mixtral, Qwen2-MoE).

Build it on the meta device, move it with `to_empty(device=...)`, then `init_weights(seed)`:
no memory is touched before the layout (applied from outside, see DESIGN.md) decides where
each parameter lives. Nothing here knows about distribution.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.models.common.attention import Attention
from shardwise.models.common.decoder import build_initialised, decoder_output, init_by_name, output_head, seeded_normal
from shardwise.models.common.document_mask import packed_batch
from shardwise.models.common.mlp import SwiGLU
from shardwise.models.common.moe import MoE
from shardwise.models.common.norm import RMSNorm
from shardwise.models.common.rope import RopeSpec, rope_cos_sin
from shardwise.core.model import ModelConfig


class Block(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)).
    PaLM-style parallel block: out = x + attn(norm(x)) + mlp(norm(x)), one norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.parallel = cfg.parallel_block
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(
            dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_size,
            qkv_bias=cfg.qkv_bias, layer_idx=layer_idx, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
            sliding_window=cfg.sliding_window,
        )
        self.mlp_norm = None if cfg.parallel_block else RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x_BSD, cos_SD, sin_SD, kv_cache=None, document_mask=None):
        normed = self.attn_norm(x_BSD)
        attn_out = self.attn(normed, cos_SD, sin_SD, kv_cache, document_mask)
        if self.parallel:
            return x_BSD + attn_out + self.mlp(normed)
        h = x_BSD + attn_out
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when a layout
        # later removes some layers from a rank (pipeline stages).
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = output_head(self)

    def forward(self, tokens_BS: torch.Tensor, positions_S: torch.Tensor | None = None, kv_cache=None,
                targets_BS: torch.Tensor | None = None, document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab]; with `targets_BS`, the mean cross-entropy instead, taken by the
        chunked linear-cross-entropy that never holds the full logits (models/common/chunked_loss.py).
        `positions_S` default to 0..S-1, or the cache's positions; [B, S] positions place each
        sequence of a batch on its own (the inference engine's decode step). `document_ids_BS`
        (a packed batch): each token attends only the earlier tokens of its own document, and
        RoPE's positions restart at 0 per document (models/common/document_mask.py); the mask
        is built here, once, and every block attends through it.

        A layout may remove parts (a pipeline stage keeps some blocks): a floating-point input
        is the previous part's hidden state [B, S, dim], not tokens (the last stage of a tied
        model keeps the table for its head, and does not embed); without `norm` and `lm_head`
        the output is the hidden state."""
        # The input's sequence length, not h's: a sequence-parallel layout shards h by sequence.
        seq_len = tokens_BS.shape[1]
        h = tokens_BS if tokens_BS.is_floating_point() else self.embed_tokens(tokens_BS)
        mask = None
        if document_ids_BS is not None:
            positions_S, mask = packed_batch(document_ids_BS, window=self.cfg.sliding_window, positions=positions_S,
                                             kv_cache=kv_cache)
        elif positions_S is None:
            positions_S = (kv_cache.positions(seq_len, tokens_BS.device) if kv_cache is not None
                           else torch.arange(seq_len, device=tokens_BS.device))
        cos, sin = rope_cos_sin(RopeSpec.of(self.cfg), positions_S, h.dtype)
        if cos.dim() == 3:  # positions [B, S]: each sequence of a batch at its own place (serving, packing)
            cos, sin = cos[:, None], sin[:, None]
        for block in self.layers.values():
            h = block(h, cos, sin, kv_cache, mask)
        return decoder_output(self, h, targets_BS, kv_cache)

    def init_weights(self, seed: int) -> None:
        """Deterministic init of every parameter and buffer from `seed` (see `initial_value`)."""
        init_by_name(self, seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        """The initial value of parameter `name`: norms 1, biases 0, weights normal(0, std) with
        std / sqrt(2 * n_layers) for the projections into the residual stream. Each tensor draws
        from its own generator seeded by (seed, name), so its value does not depend on which
        other parameters exist on a rank or in which order they are initialised; a sharded
        layout computes the same full tensor and keeps its part."""
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device)
        if name.endswith((".bias", "score_bias")):
            return torch.zeros(shape, device=device)
        is_output_proj = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
        std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers) if is_output_proj else self.cfg.init_std
        return seeded_normal(name, shape, device, seed, std)


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0) -> Llama:
    """Build on meta, materialise on `device`, initialise from `seed`."""
    return build_initialised(Llama, cfg, device, seed)
