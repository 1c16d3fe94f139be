"""Parameter and FLOP counts of a model of any family, written once: the runtime's `ModelConfig`
(core/model.py) calls them from its count methods, and the planner calls them on the same config.

Why functions over a shape rather than methods: they read only the attributes below, so they
count any object that has them. A shape has: dim, n_layers, n_heads, n_kv_heads, head_size,
ffn_dim, expert_ffn_dim, vocab_size, tie_embeddings, qkv_bias, qk_norm, n_experts,
experts_per_token, shared_ffn_dim, shared_expert_gate, norms_per_block and is_moe_layer(layer);
the other families' also `family` and the fields their counts read (max_seq_len, type_vocab_size,
image and patch sizes, n_classes, T5's decoder layers, buckets and MLP kind); a shape without
`family` is a Llama-family one.

Counts (h = dim, a = heads, k = kv heads, d = head width, f = FFN width, V = vocab):

    attention  = h*(a*d + 2*k*d) + a*d*h  (+ a*d + 2*k*d q/k/v biases, + 2d q/k norms)
    dense MLP  = 3*h*f                    (SwiGLU: gate, up, down)
    MoE MLP    = E*3*h*f_e + h*E (router) + 3*h*f_s (shared experts) (+ h shared-expert gate)
    block      = attention + MLP + norms_per_block*h
    model      = sum(blocks) + h (final norm) + V*h (embedding) + V*h (head, unless tied)

GPT-2 (every linear layer and LayerNorm has a bias; P = max_seq_len):

    attention  = 4*h*a*d + 3*a*d + h      (q, k, v, o and their biases; a*d = h, k = a)
    MLP        = 2*h*f + f + h            (GELU: up, down and their biases)
    block      = attention + MLP + 2 * 2h (two LayerNorms, weight and bias)
    model      = sum(blocks) + 2h (final LayerNorm) + P*h (positions) + V*h (embedding) + V*h (head, unless tied)

The position table is an input lookup like the token table: `embedding=False` leaves both out.

T5 (no biases, RMSNorm, a = heads, d = head_dim, which need not be h / a): encoder blocks are
attention 4*h*a*d + MLP (2*h*f, or 3*h*f gated) + 2h; decoder blocks add a cross-attention and a
norm; plus 2 * buckets * a relative-bias entries, two final norms, the shared table and (v1.1) an
untied head.

BERT and ViT blocks are GPT-2's (biases everywhere, two LayerNorms, multi-head); around them
(T = type_vocab_size, K = n_classes, C = channels, p = patch side, n = patches):

    BERT input   V*h + P*h + T*h (tables) + 2h (embedding LayerNorm)
    BERT head    h*h + h + 2h (transform: dense, LayerNorm) + V (output bias) + V*h (unless tied)
    ViT input    (n + 1)*h + h (position table, class token) + C*p*p*h + h (patch projection)
    ViT head     2h (final LayerNorm) + K*h + K (classifier)

The lookups (tables, class token) are what `embedding=False` leaves out; BERT's embedding norm and
ViT's patch projection compute on every token and stay in N.

Two FLOP conventions, both 6N + 12*L*a*d*s per token (PaLM appendix B, causal masking not
subtracted), differ in N:

    model_flops_per_token   N = every parameter but the input embedding lookup, norm weights
                            included: the trainer's MFU, `ModelConfig.flops_per_token`, and the
                            runtime's pipeline stage costs
    matmul_flops_per_token  N = the weights that take part in matmuls (norms do none): the
                            planner's time model and its MFU
"""

from __future__ import annotations


def family(shape) -> str:
    return getattr(shape, "family", "llama")


def is_gpt2(shape) -> bool:
    """GPT-2's block and norm shapes (BERT and ViT share them): biases everywhere, LayerNorms."""
    return family(shape) in ("gpt2", "bert", "vit")


def q_width(shape) -> int:
    return shape.n_heads * shape.head_size


def kv_width(shape) -> int:
    return shape.n_kv_heads * shape.head_size


def attention_params(shape) -> int:
    q, kv = q_width(shape), kv_width(shape)
    weights = shape.dim * (q + 2 * kv) + q * shape.dim
    if is_gpt2(shape):
        return weights + q + 2 * kv + shape.dim
    biases = (q + 2 * kv) if shape.qkv_bias else 0
    return weights + biases + (2 * shape.head_size if shape.qk_norm else 0)


def dense_mlp_params(shape) -> int:
    if family(shape) == "t5":  # v1.0: wi, wo; v1.1 gated: wi_0, wi_1, wo; no biases
        return (3 if shape.gated_mlp else 2) * shape.dim * shape.ffn_dim
    if is_gpt2(shape):
        return 2 * shape.dim * shape.ffn_dim + shape.ffn_dim + shape.dim
    return 3 * shape.dim * shape.ffn_dim


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


def mlp_params(shape, layer: int, *, active: bool = False) -> int:
    return moe_mlp_params(shape, active=active) if shape.is_moe_layer(layer) else dense_mlp_params(shape)


def norm_params(shape) -> int:
    """The norm weights (and GPT-2's LayerNorm biases) of one block."""
    return shape.norms_per_block * params_per_norm(shape)


def params_per_norm(shape) -> int:
    """RMSNorm's weight, or GPT-2's LayerNorm weight and bias."""
    return 2 * shape.dim if is_gpt2(shape) else shape.dim


def block_params(shape, layer: int, *, active: bool = False) -> int:
    """Parameters of block `layer` (`active`: those one token uses)."""
    return attention_params(shape) + mlp_params(shape, layer, active=active) + norm_params(shape)


def matmul_params(shape, layer: int) -> int:
    """Weights one token multiplies in block `layer` (the routed experts it is sent to; no norms)."""
    return attention_params(shape) + mlp_params(shape, layer, active=True)


def embedding_params(shape) -> int:
    """The input lookup tables (and ViT's class token), which do no matmul."""
    dim, kind = shape.dim, family(shape)
    if kind == "vit":
        return (num_patches(shape) + 1) * dim + dim
    tables = shape.vocab_size
    if kind in ("gpt2", "bert"):
        tables += shape.max_seq_len
    if kind == "bert":
        tables += shape.type_vocab_size
    return tables * dim


def num_patches(shape) -> int:
    return (shape.image_size // shape.patch_size) ** 2


def input_compute_params(shape) -> int:
    """Parameters before the first block that compute on every token: BERT's embedding
    LayerNorm, ViT's patch projection."""
    kind = family(shape)
    if kind == "bert":
        return 2 * shape.dim
    if kind == "vit":
        return shape.n_channels * shape.patch_size ** 2 * shape.dim + shape.dim
    return 0


def output_head_params(shape) -> int:
    """The output projection's own parameters: none when tied to the embedding table; BERT's
    masked-LM transform and output bias, ViT's classifier."""
    kind, dim = family(shape), shape.dim
    if kind == "vit":
        return shape.n_classes * dim + shape.n_classes
    head = 0 if shape.tie_embeddings else shape.vocab_size * dim
    if kind == "bert":
        head += dim * dim + dim + params_per_norm(shape) + shape.vocab_size
    return head


def decoder_layers(shape) -> int:
    """T5's decoder blocks (n_layers counts the encoder's)."""
    return (shape.n_decoder_layers or shape.n_layers) if family(shape) == "t5" else 0


def t5_extra_params(shape) -> int:
    """T5 besides its encoder blocks: the decoder blocks (self- and cross-attention, MLP, three RMSNorms),
    the two relative-position bias tables (buckets x heads) and the second final norm."""
    decoder_block = 2 * attention_params(shape) + dense_mlp_params(shape) + 3 * shape.dim
    return decoder_layers(shape) * decoder_block + 2 * shape.relative_buckets * shape.n_heads + shape.dim


def num_params(shape, *, embedding: bool = True, active: bool = False) -> int:
    """All parameters; `embedding=False` leaves out the input lookup tables (when tied, the token
    table is still counted once, as the output head); `active=True` counts only the routed
    experts a token uses."""
    total = sum(block_params(shape, i, active=active) for i in range(shape.n_layers))
    if family(shape) == "t5":
        total += t5_extra_params(shape)
    total += output_head_params(shape) + input_compute_params(shape)
    if family(shape) != "bert":  # BERT's blocks end in their own LayerNorm: no final norm
        total += params_per_norm(shape)
    if embedding:
        total += embedding_params(shape)
    elif shape.tie_embeddings and family(shape) != "vit":
        total += shape.vocab_size * shape.dim
    return total


def attention_flops_per_token(shape, seq_len: int) -> int:
    """Attention scores and weighted sum of one block, forward and backward: 12*a*d*s."""
    return 12 * q_width(shape) * seq_len


SPAN_LENGTH = 3
"""Tokens per span T5's span corruption hides (data/objectives.py uses this one)."""
T5_MASK_FRACTION = 0.15
"""The span-corruption fraction FLOP and memory counts assume: data.mask_fraction's default (a model
shape carries no data config; tests/planner/test_family_memory.py checks the two agree)."""


def span_corruption_lengths(seq_len: int, mask_fraction: float = T5_MASK_FRACTION) -> tuple[int, int]:
    """(encoder, decoder) tokens of one T5 training sequence of seq_len tokens, as data/objectives.py's
    SpanCorruption makes them (data.length_multiple 1): n = max(1, round(fraction x seq_len / 3)) spans
    become n sentinels plus end-of-text in the inputs (S - 3n + n + 1), and the targets are each
    sentinel and its span plus end-of-text (4n + 1)."""
    spans = max(1, round(mask_fraction * seq_len / SPAN_LENGTH))
    return seq_len - (SPAN_LENGTH - 1) * spans + 1, (SPAN_LENGTH + 1) * spans + 1


def t5_flops_per_token(shape, seq_len: int, *, norms: bool) -> float:
    """T5's training FLOPs for one span-corrupted window of seq_len tokens, per window token (what the
    trainer's tokens/s counts): the encoder blocks over the encoder's tokens, the decoder blocks and
    the head over the decoder's, each decoder block's cross-attention keys and values projected from
    the encoder's tokens; attention 12*a*d per (query, key) pair, self and cross. `norms`: count
    the norm weights as 6 FLOPs per token each (the trainer's convention), or not (the planner's)."""
    encoder_len, decoder_len = span_corruption_lengths(seq_len)
    width, norm = q_width(shape), (shape.dim if norms else 0)
    mlp, attention = dense_mlp_params(shape), attention_params(shape)
    encoder_block = 6 * (attention + mlp + 2 * norm) + 12 * width * encoder_len
    decoder_block = (6 * (attention + 2 * shape.dim * width + mlp + 3 * norm)
                     + 12 * width * (decoder_len + encoder_len))  # self-attention, then the encoder output
    cross_keys_values = 6 * 2 * shape.dim * width  # per encoder token, in every decoder block
    head = 6 * (shape.vocab_size * shape.dim + norm)
    encoder = encoder_len * (shape.n_layers * encoder_block + decoder_layers(shape) * cross_keys_values
                             + 6 * norm)
    decoder = decoder_len * (decoder_layers(shape) * decoder_block + head)
    return (encoder + decoder) / seq_len


def model_flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token with N = all parameters but the embedding lookup (norms included)."""
    if family(shape) == "t5":
        return t5_flops_per_token(shape, seq_len, norms=True)
    n = num_params(shape, embedding=False, active=True)
    return 6 * n + shape.n_layers * attention_flops_per_token(shape, seq_len)


def block_matmul_flops_per_token(shape, layer: int, seq_len: int) -> float:
    """Training FLOPs of block `layer` per token, norms excluded (the planner's convention)."""
    return 6.0 * matmul_params(shape, layer) + 12.0 * q_width(shape) * seq_len


def head_flops_per_token(shape) -> float:
    return 6.0 * shape.vocab_size * shape.dim


def matmul_flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token with N = the matmul weights (norms excluded)."""
    if family(shape) == "t5":
        return t5_flops_per_token(shape, seq_len, norms=False)
    blocks = sum(block_matmul_flops_per_token(shape, i, seq_len) for i in range(shape.n_layers))
    return blocks + head_flops_per_token(shape)
