"""GPT-2 (Radford et al., 2019) for one device, in plain torch.nn.

Pre-norm blocks with LayerNorm (with bias), multi-head attention with biases on every
projection, a GELU (tanh) MLP with biases, learned absolute positions added to the token
embeddings, no RoPE. Module names follow the Llama family's (`embed_tokens`, `layers`,
`attn.q_proj`, `mlp.down_proj`, `norm`, `lm_head`) so that the two read alike; HF's names
(`wte`, `h`, `c_attn`, ...) are mapped in `hf_adapter`.

As for Llama: build on the meta device, `to_empty(device=...)`, then `init_weights(seed)`.
Nothing here knows about distribution.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.core.model import ModelConfig
from shardwise.models.common.attention import causal_attention
from shardwise.models.common.biased_blocks import BiasedSelfAttention, layer_norm_init
from shardwise.models.common.decoder import build_initialised, decoder_output, init_by_name, output_head
from shardwise.models.common.document_mask import packed_batch
from shardwise.models.common.mlp import GeluMLP
from shardwise.models.common.norm import LayerNorm
from shardwise.models.common.positions import LearnedPositions


class SelfAttention(BiasedSelfAttention):
    """Causal multi-head attention with biased q/k/v/o projections and no rotary embedding (the
    positions are already in the input). HF packs q/k/v as one `c_attn`; here they are separate."""

    core_attention = staticmethod(lambda q, k, v, **mask: causal_attention(q, k, v, **mask))
    """softmax(q k^T / sqrt(d) + causal mask) v (with `mask=`, a packed batch's document mask);
    context parallelism swaps it on an instance."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg)
        self.layer_idx = layer_idx

    def forward(self, x_BSD: torch.Tensor, kv_cache=None, document_mask=None) -> torch.Tensor:
        if kv_cache is not None:
            return self.attend(x_BSD, lambda q, k, v: kv_cache.attend(self.layer_idx, q, k, v))
        if document_mask is not None:
            return self.attend(x_BSD, lambda q, k, v: self.core_attention(q, k, v, mask=document_mask))
        return self.attend(x_BSD, self.core_attention)


class Block(nn.Module):
    """h = x + attn(ln(x)); out = h + mlp(ln(h))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.attn = SelfAttention(cfg, layer_idx)
        self.mlp_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GeluMLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x_BSD: torch.Tensor, kv_cache=None, document_mask=None) -> torch.Tensor:
        h = x_BSD + self.attn(self.attn_norm(x_BSD), kv_cache, document_mask)
        return h + self.mlp(self.mlp_norm(h))


class GPT2(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_positions = LearnedPositions(cfg.max_seq_len, cfg.dim)
        # Keyed by layer index: names stay stable when a pipeline stage removes some layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = output_head(self)

    def forward(self, tokens_BS: torch.Tensor, positions_S: torch.Tensor | None = None, kv_cache=None,
                targets_BS: torch.Tensor | None = None, document_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab]; with `targets_BS`, the mean cross-entropy (chunked, never holding the
        logits). `positions_S` ([S] or [B, S]) index the position table: by default 0..S-1, or the
        cache's positions; context parallelism passes each rank's global positions.
        `document_ids_BS` (a packed batch): each token attends only the earlier tokens of its own
        document, and the position table is read from 0 again at each document's start
        (models/common/document_mask.py); the mask is built here, once, for every block.

        A pipeline stage may lack parts: a floating-point input is the previous stage's hidden
        state (positions were added on the first stage); without `lm_head` the output is the
        hidden state."""
        mask = None
        if document_ids_BS is not None:
            positions_S, mask = packed_batch(document_ids_BS, window=0, positions=positions_S, kv_cache=kv_cache)
        if tokens_BS.is_floating_point():
            h = tokens_BS
        else:
            if positions_S is None:
                seq_len = tokens_BS.shape[1]
                positions_S = (kv_cache.positions(seq_len, tokens_BS.device) if kv_cache is not None
                               else torch.arange(seq_len, device=tokens_BS.device))
            h = self.embed_tokens(tokens_BS) + self.embed_positions(positions_S)
        for block in self.layers.values():
            h = block(h, kv_cache, mask)
        return decoder_output(self, h, targets_BS, kv_cache)

    def init_weights(self, seed: int) -> None:
        """Deterministic init of every parameter from `seed` (see `initial_value`)."""
        init_by_name(self, seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        """GPT-2's init: LayerNorm weights 1, biases 0, weights and both tables normal(0, init_std),
        the projections into the residual stream (o_proj, down_proj) init_std / sqrt(2 * n_layers).
        Each tensor draws from a generator seeded by (seed, name), so a sharded layout computes the
        same full tensor whichever parameters its rank holds, and keeps its part."""
        is_output_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
        std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers) if is_output_proj else self.cfg.init_std
        return layer_norm_init(name, shape, device, seed, std)


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0) -> GPT2:
    """Build on meta, materialise on `device`, initialise from `seed`."""
    return build_initialised(GPT2, cfg, device, seed)
