"""Parameter and FLOP counts of a model of any family, written once: the runtime (the trainer's MFU,
pipeline stage costs) and the planner call them on the same config, with the family's spec.

Why functions over a shape and a spec rather than methods: a count depends on the model's shape
(a `ModelConfig`) and on its family's traits (its `FamilySpec`, core/family.py), which the core
cannot look up by name (the registry, models/families.py, is a layer above). So a count that
depends on the family takes the spec, and reads its traits, never its name; the rest (widths, the
MoE layer, the attention scores) read the shape alone. `ModelCounts(model, spec)` holds the two for
the callers that count one model (`models.families.counts_of(cfg)` builds it).

A shape has: dim, n_layers, n_heads, n_kv_heads, head_size, ffn_dim, expert_ffn_dim, vocab_size,
max_seq_len, tie_embeddings, qkv_bias, qk_norm, n_experts, experts_per_token, shared_ffn_dim,
shared_expert_gate, norms_per_block and is_moe_layer(layer); and the fields the traits below make
it read (type_vocab_size, image and patch sizes, channels, n_classes, the decoder's layers,
relative buckets, gated_mlp).

Counts (h = dim, a = heads, k = kv heads, d = head width, f = FFN width, V = vocab, P = max_seq_len):

    attention  = h*(a*d + 2*k*d) + a*d*h   q, k, v, o
                 + a*d + 2*k*d + h          their biases (`linear_biases`; q/k/v only: model.qkv_bias)
                 + 2d                       q/k norms (model.qk_norm)
    dense MLP  = m*h*f (+ (m-1)*f + h)      m = 3 matrices gated (SwiGLU; T5's gated GELU),
                                            2 not (GELU; T5's ReLU) (`mlp`), biases (`linear_biases`)
    MoE MLP    = E*3*h*f_e + h*E (router) + 3*h*f_s (shared experts) (+ h shared-expert gate)
    norm       = h (RMSNorm), or 2h (`layer_norm`: weight and bias)
    block      = attention + MLP + norms_per_block * norm
    model      = sum(blocks) + norm (`final_norm`) + V*h (embedding) + V*h (head, unless tied)

Around the blocks, by trait (C = channels, p = patch side, n = patches, T = type_vocab_size,
K = n_classes, B = relative buckets; the examples are GPT-2, BERT, ViT and T5):

    position_table "sequence"  P*h (GPT-2, BERT)
    position_table "patches"   (n + 1)*h + h: a row per patch and for the class token, the class token (ViT)
    token_type_table           T*h (BERT)
    embedding_norm             norm (BERT: its blocks end normalised, `final_norm` is off)
    head_transform             h*h + h + norm (dense, norm) + V (output bias) (BERT)
    image_input                C*p*p*h + h (patch projection) instead of the token table, K*h + K
                               (classifier) instead of the output projection (ViT)
    relative_position_bias     B*a per stack (T5)
    encoder_decoder            decoder blocks: 2 * attention (self, cross) + MLP + 3 * norm; the
                               decoder stack's own final norm and relative bias (T5)

The lookups (token, position and type tables, the class token) are what `embedding=False` leaves
out (when tied, the token table is still counted once, as the output head); the embedding norm and
the patch projection compute on every token and stay in N.

Two FLOP conventions, both 6N + 12*L*a*d*s per token (PaLM appendix B, causal masking not
subtracted), differ in N:

    model_flops_per_token   N = every parameter but the input embedding lookup, norm weights
                            included: the trainer's MFU, `ModelCounts.flops_per_token`, and the
                            runtime's pipeline stage costs
    matmul_flops_per_token  N = the weights that take part in matmuls (norms do none): the
                            planner's time model and its MFU

An encoder-decoder trains on span corruption: its stacks run over the encoder's and the decoder's
tokens of a corrupted window (`encoder_decoder_flops_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.core.family import FamilySpec


def q_width(shape) -> int:
    return shape.n_heads * shape.head_size


def kv_width(shape) -> int:
    return shape.n_kv_heads * shape.head_size


def attention_params(shape, spec: FamilySpec) -> int:
    q, kv = q_width(shape), kv_width(shape)
    weights = shape.dim * (q + 2 * kv) + q * shape.dim
    qkv_biases = (q + 2 * kv) if spec.linear_biases or shape.qkv_bias else 0
    output_bias = shape.dim if spec.linear_biases else 0
    qk_norms = 2 * shape.head_size if shape.qk_norm else 0
    return weights + qkv_biases + output_bias + qk_norms


def mlp_matrices(shape, spec: FamilySpec) -> int:
    """3 for a gated MLP (gate, up, down), 2 for an ungated one (up, down)."""
    gated = spec.mlp == "swiglu" or (spec.mlp == "relu_or_gated_gelu" and shape.gated_mlp)
    return 3 if gated else 2


def dense_mlp_params(shape, spec: FamilySpec) -> int:
    matrices = mlp_matrices(shape, spec)
    biases = (matrices - 1) * shape.ffn_dim + shape.dim if spec.linear_biases else 0
    return matrices * shape.dim * shape.ffn_dim + biases


def expert_params(shape) -> int:
    """One routed expert's SwiGLU."""
    return 3 * shape.dim * shape.expert_ffn_dim


def moe_shared_params(shape) -> int:
    """Router, shared experts and their gate of one MoE layer: every token uses them, and every
    expert-parallel rank holds them."""
    gate = shape.dim if shape.shared_expert_gate else 0
    return shape.dim * shape.n_experts + 3 * shape.dim * shape.shared_ffn_dim + gate


def moe_mlp_params(shape, *, active: bool = False) -> int:
    """One MoE layer; `active`: only what one token uses (experts_per_token of the routed experts)."""
    routed = shape.experts_per_token if active else shape.n_experts
    return routed * expert_params(shape) + moe_shared_params(shape)


def mlp_params(shape, spec: FamilySpec, layer: int, *, active: bool = False) -> int:
    if shape.is_moe_layer(layer):
        return moe_mlp_params(shape, active=active)
    return dense_mlp_params(shape, spec)


def params_per_norm(shape, spec: FamilySpec) -> int:
    """RMSNorm's weight, or a LayerNorm's weight and bias."""
    return 2 * shape.dim if spec.layer_norm else shape.dim


def norm_params(shape, spec: FamilySpec) -> int:
    """The norms of one block."""
    return shape.norms_per_block * params_per_norm(shape, spec)


def block_params(shape, spec: FamilySpec, layer: int, *, active: bool = False) -> int:
    """Parameters of block `layer` (`active`: those one token uses)."""
    return attention_params(shape, spec) + mlp_params(shape, spec, layer, active=active) + norm_params(shape, spec)


def matmul_params(shape, spec: FamilySpec, layer: int) -> int:
    """Weights one token multiplies in block `layer` (the routed experts it is sent to; no norms)."""
    return attention_params(shape, spec) + mlp_params(shape, spec, layer, active=True)


def num_patches(shape) -> int:
    return (shape.image_size // shape.patch_size) ** 2


def position_rows(shape, spec: FamilySpec) -> int:
    """Rows of the learned position table."""
    if spec.position_table == "sequence":
        return shape.max_seq_len
    if spec.position_table == "patches":
        return num_patches(shape) + 1  # and the class token's
    return 0


def embedding_params(shape, spec: FamilySpec) -> int:
    """The input lookup tables (and the class token), which do no matmul."""
    rows = (0 if spec.image_input else shape.vocab_size) + position_rows(shape, spec)
    if spec.token_type_table:
        rows += shape.type_vocab_size
    if spec.position_table == "patches":
        rows += 1  # the class token
    return rows * shape.dim


def input_compute_params(shape, spec: FamilySpec) -> int:
    """Parameters before the first block that compute on every token: the embedding norm, the
    patch projection (and its bias)."""
    norm = params_per_norm(shape, spec) if spec.embedding_norm else 0
    patches = shape.n_channels * shape.patch_size ** 2 * shape.dim + shape.dim if spec.image_input else 0
    return norm + patches


def output_head_params(shape, spec: FamilySpec) -> int:
    """The output projection's own parameters: none when tied to the embedding table; the
    masked-LM head transform and output bias; an image classifier instead."""
    if spec.image_input:
        return shape.n_classes * shape.dim + shape.n_classes
    head = 0 if shape.tie_embeddings else shape.vocab_size * shape.dim
    if spec.head_transform:
        head += shape.dim * shape.dim + shape.dim + params_per_norm(shape, spec) + shape.vocab_size
    return head


def num_stacks(spec: FamilySpec) -> int:
    return 2 if spec.encoder_decoder else 1


def decoder_layers(shape, spec: FamilySpec) -> int:
    """An encoder-decoder's decoder blocks (n_layers counts the encoder's); 0 for one stack."""
    return (shape.n_decoder_layers or shape.n_layers) if spec.encoder_decoder else 0


def decoder_block_params(shape, spec: FamilySpec) -> int:
    """One decoder block: self- and cross-attention, the MLP and three norms."""
    return 2 * attention_params(shape, spec) + dense_mlp_params(shape, spec) + 3 * params_per_norm(shape, spec)


def relative_bias_params(shape, spec: FamilySpec) -> int:
    """The relative-position bias tables of every stack (buckets x heads each)."""
    return num_stacks(spec) * shape.relative_buckets * shape.n_heads if spec.relative_position_bias else 0


def final_norm_params(shape, spec: FamilySpec) -> int:
    return num_stacks(spec) * params_per_norm(shape, spec) if spec.final_norm else 0


def num_params(shape, spec: FamilySpec, *, embedding: bool = True, active: bool = False) -> int:
    """All parameters; `embedding=False` leaves out the input lookup tables (when tied, the token
    table is still counted once, as the output head); `active=True` counts only the routed
    experts a token uses."""
    total = sum(block_params(shape, spec, i, active=active) for i in range(shape.n_layers))
    total += decoder_layers(shape, spec) * decoder_block_params(shape, spec) + relative_bias_params(shape, spec)
    total += output_head_params(shape, spec) + input_compute_params(shape, spec) + final_norm_params(shape, spec)
    if embedding:
        total += embedding_params(shape, spec)
    elif shape.tie_embeddings and not spec.image_input:
        total += shape.vocab_size * shape.dim
    return total


def attention_flops_per_token(shape, seq_len: int) -> int:
    """Attention scores and weighted sum of one block, forward and backward: 12*a*d*s."""
    return 12 * q_width(shape) * seq_len


SPAN_LENGTH = 3
"""Tokens per span the span corruption hides (data/objectives.py uses this one)."""
SPAN_MASK_FRACTION = 0.15
"""The span-corruption fraction FLOP and memory counts assume: data.mask_fraction's default (a model
shape carries no data config; tests/planner/test_family_memory.py checks the two agree)."""


def span_corruption_lengths(seq_len: int, mask_fraction: float = SPAN_MASK_FRACTION) -> tuple[int, int]:
    """(encoder, decoder) tokens of one span-corrupted training sequence of seq_len tokens, as
    data/objectives.py's SpanCorruption makes them (data.length_multiple 1): n = max(1, round(fraction
    x seq_len / 3)) spans become n sentinels plus end-of-text in the inputs (S - 3n + n + 1), and the
    targets are each sentinel and its span plus end-of-text (4n + 1)."""
    spans = max(1, round(mask_fraction * seq_len / SPAN_LENGTH))
    return seq_len - (SPAN_LENGTH - 1) * spans + 1, (SPAN_LENGTH + 1) * spans + 1


def encoder_decoder_flops_per_token(shape, spec: FamilySpec, seq_len: int, *, norms: bool) -> float:
    """An encoder-decoder's training FLOPs for one span-corrupted window of seq_len tokens, per window
    token (what the trainer's tokens/s counts): the encoder blocks over the encoder's tokens, the
    decoder blocks and the head over the decoder's, each decoder block's cross-attention keys and
    values projected from the encoder's tokens; attention 12*a*d per (query, key) pair, self and
    cross. `norms`: count the norm weights as 6 FLOPs per token each (the trainer's convention), or
    not (the planner's)."""
    encoder_len, decoder_len = span_corruption_lengths(seq_len)
    width, norm = q_width(shape), (params_per_norm(shape, spec) if norms else 0)
    mlp, attention = dense_mlp_params(shape, spec), attention_params(shape, spec)
    encoder_block = 6 * (attention + mlp + 2 * norm) + 12 * width * encoder_len
    decoder_block = (6 * (attention + 2 * shape.dim * width + mlp + 3 * norm)
                     + 12 * width * (decoder_len + encoder_len))  # self-attention, then the encoder output
    cross_keys_values = 6 * 2 * shape.dim * width  # per encoder token, in every decoder block
    head = 6 * (shape.vocab_size * shape.dim + norm)
    decoders = decoder_layers(shape, spec)
    encoder = encoder_len * (shape.n_layers * encoder_block + decoders * cross_keys_values + 6 * norm)
    decoder = decoder_len * (decoders * decoder_block + head)
    return (encoder + decoder) / seq_len


def model_flops_per_token(shape, spec: FamilySpec, seq_len: int) -> float:
    """Training FLOPs per token with N = all parameters but the embedding lookup (norms included)."""
    if spec.encoder_decoder:
        return encoder_decoder_flops_per_token(shape, spec, seq_len, norms=True)
    n = num_params(shape, spec, embedding=False, active=True)
    return 6 * n + shape.n_layers * attention_flops_per_token(shape, seq_len)


def block_matmul_flops_per_token(shape, spec: FamilySpec, layer: int, seq_len: int) -> float:
    """Training FLOPs of block `layer` per token, norms excluded (the planner's convention)."""
    return 6.0 * matmul_params(shape, spec, layer) + 12.0 * q_width(shape) * seq_len


def head_flops_per_token(shape) -> float:
    return 6.0 * shape.vocab_size * shape.dim


def matmul_flops_per_token(shape, spec: FamilySpec, seq_len: int) -> float:
    """Training FLOPs per token with N = the matmul weights (norms excluded)."""
    if spec.encoder_decoder:
        return encoder_decoder_flops_per_token(shape, spec, seq_len, norms=False)
    blocks = sum(block_matmul_flops_per_token(shape, spec, i, seq_len) for i in range(shape.n_layers))
    return blocks + head_flops_per_token(shape)


@dataclass(frozen=True)
class ModelCounts:
    """One model's counts, as its family's traits make them: `models.families.counts_of(cfg)`."""

    model: Any
    """The shape: a `ModelConfig`."""
    spec: FamilySpec

    def attention_params(self) -> int:
        return attention_params(self.model, self.spec)

    def block_params(self) -> int:
        """Parameters of a dense block."""
        return attention_params(self.model, self.spec) + dense_mlp_params(self.model, self.spec) \
            + norm_params(self.model, self.spec)

    def moe_mlp_params(self, *, active: bool = False) -> int:
        """Parameters of one MoE layer (router, experts, shared experts and gate); `active`: only
        those one token uses (experts_per_token of the routed experts)."""
        return moe_mlp_params(self.model, active=active)

    def layer_params(self, layer_idx: int, *, active: bool = False) -> int:
        """Parameters of block `layer_idx` (`active`: those one token uses)."""
        return block_params(self.model, self.spec, layer_idx, active=active)

    def num_params(self, *, embedding: bool = True, active: bool = False) -> int:
        """All parameters; `embedding=False` leaves out the input lookup tables (when tied, the
        token table is still counted once, as the output head); `active=True` counts only the
        experts a token uses (experts_per_token of n_experts per MoE layer)."""
        return num_params(self.model, self.spec, embedding=embedding, active=active)

    def num_active_params(self, *, embedding: bool = True) -> int:
        return self.num_params(embedding=embedding, active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6N + 12*L*h*s (PaLM appendix B): N counts every weight but
        the input embedding lookup (norms included; of a MoE layer, the router, the token's top-k
        experts and the shared experts), the second term the attention scores and weighted sum,
        h = n_heads * head_dim (causal masking is not subtracted, by convention); an
        encoder-decoder's, per token of its span-corrupted window."""
        return model_flops_per_token(self.model, self.spec, seq_len)
