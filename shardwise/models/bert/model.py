"""BERT (Devlin et al., 2019) as a masked language model for one device, in plain torch.nn: what HF
`transformers` calls `BertForMaskedLM`.

An encoder: every token attends every other (no causal mask; a padding mask keeps queries off
padding keys). The input is the sum of three lookups (token, learned absolute position, token
type) then a LayerNorm. Blocks are POST-norm, as in the paper: the LayerNorm comes after each
residual sum, not before each sublayer as in GPT-2. The masked-LM head is a transform (dense, exact
GELU, LayerNorm), the output projection (tied to the token table by default) and an output bias.
Module names follow the Llama/GPT-2 families' (`embed_tokens`, `layers`, `attn.q_proj`,
`mlp.down_proj`, `lm_head`); HF's (`word_embeddings`, `encoder.layer`, `attention.self.query`, ...)
are mapped in `hf_adapter`.

As for the other families: build on the meta device, `to_empty(device=...)`, then
`init_weights(seed)`. Nothing here knows about distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.core.model import ModelConfig
from shardwise.models.common.attention import bidirectional_attention
from shardwise.models.common.biased_blocks import BiasedSelfAttention, layer_norm_init
from shardwise.models.common.decoder import build_initialised, init_by_name, output_head
from shardwise.models.common.mlp import GeluMLP
from shardwise.models.common.norm import LayerNorm
from shardwise.models.common.positions import LearnedPositions


class SelfAttention(BiasedSelfAttention):
    """Bidirectional multi-head attention with biased q/k/v/o projections (HF's separate
    query/key/value)."""

    core_attention = staticmethod(lambda q, k, v, padding_mask_BS: bidirectional_attention(q, k, v, padding_mask_BS))
    """softmax(q k^T / sqrt(d), padding keys masked) v; a layout may swap it on an instance."""

    def forward(self, x_BSD: torch.Tensor, padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(x_BSD, lambda q, k, v: self.core_attention(q, k, v, padding_mask_BS))


class Block(nn.Module):
    """Post-norm: h = ln(x + attn(x)); out = ln(h + mlp(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GeluMLP(cfg.dim, cfg.ffn_dim, approximate="none")  # HF "gelu": exact erf
        self.mlp_norm = LayerNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x_BSD: torch.Tensor, padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attn_norm(x_BSD + self.attn(x_BSD, padding_mask_BS))
        return self.mlp_norm(h + self.mlp(h))


class MaskedLMTransform(nn.Module):
    """HF's `cls.predictions.transform`: a per-token dense layer, exact GELU and LayerNorm between
    the last block and the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.norm = LayerNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h_BSD)))


class VocabBias(nn.Module):
    """The output bias, one per vocabulary entry (HF's `cls.predictions.bias`). A module of its own,
    not a bias on `lm_head`: the head may be the tied token table, which has none, and tensor
    parallelism splits this bias like the vocabulary-parallel logits it is added to."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(vocab_size))

    def forward(self, logits_BSV: torch.Tensor) -> torch.Tensor:
        return logits_BSV + self.bias


class Bert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_positions = LearnedPositions(cfg.max_seq_len, cfg.dim)
        self.embed_types = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.embed_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        # Keyed by layer index: names stay stable when a pipeline stage removes some layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.head_transform = MaskedLMTransform(cfg)
        self.lm_head = output_head(self)
        self.lm_bias = VocabBias(cfg.vocab_size)

    def forward(self, tokens_BS: torch.Tensor, positions_S: torch.Tensor | None = None,
                targets_BS: torch.Tensor | None = None, padding_mask_BS: torch.Tensor | None = None,
                token_types_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab]; with `targets_BS`, the mean cross-entropy over the positions whose
        target is not -100 (the masked ones). `positions_S` ([S] or [B, S]) default to 0..S-1,
        `token_types_BS` to type 0; `padding_mask_BS` (True/1 = a real token) as HF's attention_mask.

        A pipeline stage may lack parts: a floating-point input is the previous stage's hidden
        state (the embeddings ran on the first stage); without `lm_head` the output is the hidden
        state."""
        if tokens_BS.is_floating_point():
            h = tokens_BS
        else:
            h = self.embed(tokens_BS, positions_S, token_types_BS)
        for block in self.layers.values():
            h = block(h, padding_mask_BS)
        if self.lm_head is None:
            return h
        logits = self.lm_bias(self.lm_head(self.head_transform(h)))
        if targets_BS is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets_BS.flatten())

    def embed(self, tokens_BS: torch.Tensor, positions_S: torch.Tensor | None,
              token_types_BS: torch.Tensor | None) -> torch.Tensor:
        """LayerNorm(token + type + position vectors), summed in HF's order. The type table is looked
        up with an index tensor (zeros by default), not added as its row 0: tensor parallelism
        splits every table here by rows and sums the partial lookups."""
        if positions_S is None:
            positions_S = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        if token_types_BS is None:
            token_types_BS = torch.zeros_like(tokens_BS)
        h = self.embed_tokens(tokens_BS) + self.embed_types(token_types_BS) + self.embed_positions(positions_S)
        return self.embed_norm(h)

    def init_weights(self, seed: int) -> None:
        """Deterministic init of every parameter from `seed` (see `initial_value`)."""
        init_by_name(self, seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        """BERT's init: LayerNorm weights 1, biases 0 (the output bias too), every weight and table
        normal(0, init_std); unlike GPT-2 the output projections are not scaled down."""
        return layer_norm_init(name, shape, device, seed, self.cfg.init_std)


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0) -> Bert:
    """Build on meta, materialise on `device`, initialise from `seed`."""
    return build_initialised(Bert, cfg, device, seed)
