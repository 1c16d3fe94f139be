"""T5 (Raffel et al., 2020) for one device, in plain torch.nn: what HF `transformers` calls
`T5ForConditionalGeneration`, v1.0 (ReLU MLP, output head tied to the token table) and v1.1 /
Flan-T5 (gated-GELU MLP, untied head).

An encoder-decoder. Both stacks are pre-norm with T5's RMSNorm (no mean, no bias, variance in
fp32: shardwise's `RMSNorm` computes the same), read one shared token table, and have no
absolute positions: each stack adds a learned per-head bias, looked up by the bucketed distance
between query and key, to its self-attention scores (`RelativePositionBias`, in
`models/common/relative_position.py`). HF keeps that table in block 0 and hands its output to the
later blocks; here it is a top-level module per stack (`encoder_rel_bias`, `decoder_rel_bias`)
computed once per forward and passed to every block, so a layout can treat it apart from the
blocks. Attention, self and cross alike, is `models/common/cross_attention.py`'s `CrossAttention`
with scale 1.0: NOT scaled by 1/sqrt(head_dim) (T5 folds that into the init of q). The decoder's
blocks also attend the encoder output (cross-attention, no position bias, padding keys masked).
Tied (v1.0), the decoder output is scaled by dim**-0.5 before the head, as HF does.

The config is read in one place, `t5_fields`. As for the other families: build on the meta device, `to_empty(device=...)`, then `init_weights(seed)`. Nothing
here knows about distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.common.cross_attention import CrossAttention, key_mask
from shardwise.models.common.decoder import build_initialised, init_by_name, output_head, seeded_normal
from shardwise.models.common.norm import RMSNorm
from shardwise.models.common.relative_position import RelativePositionBias

DECODER_START_ID = 0
"""The decoder's first input token, and what -100 targets become in its inputs: T5's pad token."""


@dataclass(frozen=True)
class T5Fields:
    """The shape of a T5 model, from its config (see `t5_fields`)."""

    dim: int
    n_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_encoder_layers: int
    n_decoder_layers: int
    relative_buckets: int
    relative_max_distance: int
    gated_mlp: bool
    norm_eps: float
    tie_embeddings: bool
    init_factor: float


def t5_fields(cfg) -> T5Fields:
    """The T5 shape of a ModelConfig (family t5): n_layers is the encoder's depth, init_std HF's
    initializer_factor, head_dim T5's d_kv (0: dim / n_heads)."""
    return T5Fields(
        dim=cfg.dim, n_heads=cfg.n_heads, head_dim=cfg.head_dim or cfg.dim // cfg.n_heads,
        ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, n_encoder_layers=cfg.n_layers,
        n_decoder_layers=cfg.n_decoder_layers or cfg.n_layers, relative_buckets=cfg.relative_buckets,
        relative_max_distance=cfg.relative_max_distance, gated_mlp=cfg.gated_mlp, norm_eps=cfg.norm_eps,
        tie_embeddings=cfg.tie_embeddings, init_factor=cfg.init_std,
    )


def t5_attention(f: T5Fields) -> CrossAttention:
    """T5's self- or cross-attention: no projection biases, no 1/sqrt(head_dim) scaling."""
    return CrossAttention(f.dim, f.n_heads, f.head_dim, bias=False, scale=1.0)


def t5_position_bias(f: T5Fields, *, bidirectional: bool) -> RelativePositionBias:
    """One stack's relative position bias: the encoder's bidirectional, the decoder's causal."""
    return RelativePositionBias(f.relative_buckets, f.n_heads, bidirectional=bidirectional,
                                max_distance=f.relative_max_distance)


class T5MLP(nn.Module):
    """v1.0: down(relu(up(x))) (HF `wi`, `wo`); v1.1 gated: down(gelu_tanh(gate(x)) * up(x))
    (HF `wi_0` is the gate, `wi_1` the linear half). No biases."""

    def __init__(self, f: T5Fields):
        super().__init__()
        self.up_proj = nn.Linear(f.dim, f.ffn_dim, bias=False)
        self.gate_proj = nn.Linear(f.dim, f.ffn_dim, bias=False) if f.gated_mlp else None
        self.down_proj = nn.Linear(f.ffn_dim, f.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.relu(self.up_proj(x)))
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class EncoderBlock(nn.Module):
    """h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, f: T5Fields):
        super().__init__()
        self.attn_norm = RMSNorm(f.dim, f.norm_eps)
        self.attn = t5_attention(f)
        self.mlp_norm = RMSNorm(f.dim, f.norm_eps)
        self.mlp = T5MLP(f)

    def forward(self, x_BSD: torch.Tensor, bias_1HSS: torch.Tensor, keep_B11S: torch.Tensor | None) -> torch.Tensor:
        # Every input positional, the source too: tensor parallelism's "block_input" style counts them.
        h = x_BSD + self.attn(self.attn_norm(x_BSD), bias_1HSS, keep_B11S, None)
        return h + self.mlp(self.mlp_norm(h))


class DecoderBlock(nn.Module):
    """Causal self-attention, then attention over the encoder output, then the MLP; each pre-norm."""

    def __init__(self, f: T5Fields):
        super().__init__()
        self.attn_norm = RMSNorm(f.dim, f.norm_eps)
        self.attn = t5_attention(f)
        self.cross_norm = RMSNorm(f.dim, f.norm_eps)
        self.cross_attn = t5_attention(f)
        self.mlp_norm = RMSNorm(f.dim, f.norm_eps)
        self.mlp = T5MLP(f)

    def forward(self, x_BTD: torch.Tensor, encoder_out_BSD: torch.Tensor, bias_1HTT: torch.Tensor,
                causal_TT: torch.Tensor, keep_B11S: torch.Tensor | None) -> torch.Tensor:
        h = x_BTD + self.attn(self.attn_norm(x_BTD), bias_1HTT, causal_TT, None)
        h = h + self.cross_attn(self.cross_norm(h), None, keep_B11S, encoder_out_BSD)
        return h + self.mlp(self.mlp_norm(h))

    def forward_cached(self, x_BTD: torch.Tensor, layer: int, bias_BHTK: torch.Tensor, cache) -> torch.Tensor:
        """The same over an inference cache (`generation/encoder_decoder_cache.py`): this step's keys
        and values join the cached ones; cross-attention reads the encoder output's, stored once."""
        attn, cross = self.attn, self.cross_attn

        def self_attend(q):
            return cache.self_attend(layer, q, *attn.source_kv(normed), bias_BHTK, attn.scale)

        normed = self.attn_norm(x_BTD)
        h = x_BTD + attn.attend_with(normed, self_attend)
        h = h + cross.attend_with(self.cross_norm(h), lambda q: cache.cross_attend(layer, q, cross.scale))
        return h + self.mlp(self.mlp_norm(h))


class T5(nn.Module):
    is_encoder_decoder = True
    """The engine (`shardwise/generation/`) sends a prompt to the encoder, as HF's config flag says."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        f = self.fields = t5_fields(cfg)
        self.embed_tokens = nn.Embedding(f.vocab_size, f.dim)
        self.encoder_rel_bias = t5_position_bias(f, bidirectional=True)
        # Keyed by layer index, as the other families' blocks.
        self.encoder_layers = nn.ModuleDict({str(i): EncoderBlock(f) for i in range(f.n_encoder_layers)})
        self.encoder_norm = RMSNorm(f.dim, f.norm_eps)
        self.decoder_rel_bias = t5_position_bias(f, bidirectional=False)
        self.decoder_layers = nn.ModuleDict({str(i): DecoderBlock(f) for i in range(f.n_decoder_layers)})
        self.decoder_norm = RMSNorm(f.dim, f.norm_eps)
        self.lm_head = output_head(self)

    def forward(self, input_ids_BS: torch.Tensor, decoder_input_ids_BT: torch.Tensor | None = None,
                targets_BT: torch.Tensor | None = None, padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of the decoder inputs, or with `targets_BT` the mean cross-entropy
        over the targets that are not -100. `decoder_input_ids_BT` default to the targets shifted
        right (`shift_right`); `padding_mask_BS` (True/1 = a real token) masks the encoder's padding
        for the encoder's and the decoder's attention, as HF's attention_mask."""
        if decoder_input_ids_BT is None:
            if targets_BT is None:
                raise ValueError("T5 needs decoder_input_ids_BT or targets_BT: the decoder has no input otherwise")
            decoder_input_ids_BT = shift_right(targets_BT)
        logits = self.decode(decoder_input_ids_BT, self.encode(input_ids_BS, padding_mask_BS), padding_mask_BS)
        if targets_BT is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets_BT.flatten())

    def encode(self, input_ids_BS: torch.Tensor, padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder output [B, S, dim] (after its final norm)."""
        h = self.embed_tokens(input_ids_BS)
        S = input_ids_BS.shape[1]  # not h's: under sequence parallelism h holds a rank's slice
        bias = self.encoder_rel_bias.scores_bias(S, S)
        keep = key_mask(padding_mask_BS)
        for block in self.encoder_layers.values():
            h = block(h, bias, keep)
        return self.encoder_norm(h)

    def decode(self, decoder_input_ids_BT: torch.Tensor, encoder_out_BSD: torch.Tensor,
               padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of each decoder position (causal), attending `encoder_out_BSD`."""
        h = self.embed_tokens(decoder_input_ids_BT)
        T = decoder_input_ids_BT.shape[1]
        bias = self.decoder_rel_bias.scores_bias(T, T)
        positions = torch.arange(T, device=h.device)
        causal = positions[None, :] <= positions[:, None]
        keep = key_mask(padding_mask_BS)
        for block in self.decoder_layers.values():
            h = block(h, encoder_out_BSD, bias, causal, keep)
        return self.decoder_head(h)

    def decoder_head(self, h_BTD: torch.Tensor) -> torch.Tensor:
        h = self.decoder_norm(h_BTD)
        if self.fields.tie_embeddings:
            h = h * self.fields.dim ** -0.5  # T5 v1.0: scaled before the tied head, as HF does
        return self.lm_head(h)

    # ---- inference over a cache: the engine's (`shardwise/generation/`) ----
    def encode_into(self, input_ids_BS: torch.Tensor, padding_mask_BS: torch.Tensor | None, cache) -> None:
        """Encode the step's prompts and store every decoder block's cross-attention keys and
        values of the encoder output in `cache`: the encoder runs once per sequence."""
        encoder_out = self.encode(input_ids_BS, padding_mask_BS)
        for layer, block in enumerate(self.decoder_layers.values()):
            cache.store_source(layer, *block.cross_attn.source_kv(encoder_out))

    def decode_cached(self, tokens_BT: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, T, vocab] of the step's decoder tokens, at `cache.positions_BS`, attending the
        cached decoder keys and the stored encoder output: the same as `decode` over the prefix."""
        h = self.embed_tokens(tokens_BT)
        bias = self.decoder_rel_bias.bias_at(cache.positions(tokens_BT.shape[1], h.device), cache.key_positions_T)
        for layer, block in enumerate(self.decoder_layers.values()):
            h = block.forward_cached(h, layer, bias, cache)
        return self.decoder_head(h)

    @torch.no_grad()
    def greedy_generate(self, input_ids_BS: torch.Tensor, max_new_tokens: int, eos_id: int = 1,
                        padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 1 + n] decoder tokens, the start token first, as HF's generate(do_sample=False,
        num_beams=1) returns them: the argmax each step, a finished row (after `eos_id`) padded
        with the pad token, stopping when every row is finished or after `max_new_tokens`. The
        encoder runs once; the decoder reruns over the whole prefix each step (no KV cache)."""
        encoder_out = self.encode(input_ids_BS, padding_mask_BS)
        out = torch.full((input_ids_BS.shape[0], 1), DECODER_START_ID, dtype=torch.long, device=input_ids_BS.device)
        running = torch.ones(input_ids_BS.shape[0], dtype=torch.bool, device=input_ids_BS.device)
        for _ in range(max_new_tokens):
            next_B = self.decode(out, encoder_out, padding_mask_BS)[:, -1].argmax(-1)
            next_B = torch.where(running, next_B, DECODER_START_ID)
            out = torch.cat([out, next_B[:, None]], dim=1)
            running &= next_B != eos_id
            if not running.any():
                break
        return out

    def init_weights(self, seed: int) -> None:
        """Deterministic init of every parameter from `seed` (see `initial_value`)."""
        init_by_name(self, seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        """HF T5's init, times `init_factor` (HF's initializer_factor): norms at the factor, tables
        and the untied head normal(0, 1), q normal(0, (dim * head_dim)^-1/2) (the folded attention
        scale), k / v / the relative-bias tables / MLP inputs normal(0, dim^-1/2), o
        (heads * head_dim)^-1/2, MLP output ffn_dim^-1/2. Drawn per name (`seeded_normal`)."""
        f = self.fields
        if name.endswith("norm.weight"):
            return torch.full(shape, f.init_factor, device=device)
        if name.endswith("q_proj.weight"):
            std = (f.dim * f.head_dim) ** -0.5
        elif name.endswith("o_proj.weight"):
            std = (f.n_heads * f.head_dim) ** -0.5
        elif name.endswith("down_proj.weight"):
            std = f.ffn_dim ** -0.5
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            std = 1.0
        else:  # k, v, up, gate, relative-bias tables
            std = f.dim ** -0.5
        return seeded_normal(name, shape, device, seed, f.init_factor * std)


def shift_right(targets_BT: torch.Tensor) -> torch.Tensor:
    """The decoder's inputs for `targets_BT`, as HF's `_shift_right`: the start token, then the
    targets but the last, ignored targets (-100) replaced by the pad token."""
    shifted = targets_BT.new_zeros(targets_BT.shape)
    shifted[..., 1:] = targets_BT[..., :-1]
    shifted[..., 0] = DECODER_START_ID
    return shifted.masked_fill(shifted == -100, DECODER_START_ID)


def build_model(cfg, *, device: torch.device | str = "cpu", seed: int = 0) -> T5:
    """Build on meta, materialise on `device`, initialise from `seed`."""
    return build_initialised(T5, cfg, device, seed)
