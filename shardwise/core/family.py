"""What a model family is, as data: the traits the rest of shardwise reads instead of its name.

Each family states its `FamilySpec` in `models/<family>/spec.py`, and `models/families.py` lists
them. Config validation, layout rules, the planner, data, serving and conversion read these traits
(`spec.bidirectional`, `spec.objective`, ...); no code outside `models/` compares a family's name.
The type lives in the core so that core functions (layout rules) can take a spec as an argument
without importing the families. Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

OBJECTIVES = ("causal_lm", "masked_lm", "span_corruption", "image_classification")
"""What a family trains on: next tokens, masked tokens (BERT), corrupted spans (T5), image labels (ViT)."""
TEXT_GENERATING_OBJECTIVES = ("causal_lm", "span_corruption")
MLP_KINDS = ("swiglu", "gelu", "relu_or_gated_gelu")
"""A dense MLP: gate, up and down (SwiGLU); up and down (GELU); up and down with ReLU, or gate, up and down
with GELU where `model.gated_mlp` asks for it (T5 v1.0 and v1.1)."""
ATTENTION_LORA_ROLES = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.o_proj"}
"""LoRA roles of a pre-norm block's attention projections (llama, gpt2): role -> module name in a block."""
POSITION_TABLES = ("none", "sequence", "patches")
"""A learned position table: none (rotary or relative positions), a row per position up to
`model.max_seq_len`, or a row per image patch and one for the class token."""


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    name: str
    """The `model.family` value."""
    objective: str
    """One of OBJECTIVES: the loss it trains with, the data it reads, what `predict` does with it."""
    bidirectional: bool = False
    """Every query attends every key of its sequence (encoders): context parallelism, whose
    attention cores are causal, is refused."""
    encoder_decoder: bool = False
    """An encoder stack and a decoder stack whose blocks also read the encoder's output (T5):
    pipeline stages (which hand on one activation) are refused, the planner counts both stacks. The
    counts add model.n_decoder_layers decoder blocks (self- and cross-attention, MLP, three norms) and
    the decoder stack's final norm and relative position bias."""
    rotary_positions: bool = False
    """RoPE on queries and keys: heads must be of even width."""
    multi_head: bool = False
    """Plain multi-head attention: as many key/value heads as query heads."""
    heads_span_dim: bool = False
    """Heads are dim / n_heads wide (model.head_dim must stay 0)."""
    final_norm: bool = True
    """A norm after the last block of each stack (BERT's post-norm blocks end normalised and have none)."""
    chunked_loss: bool = False
    """The model takes the targets and returns the loss, chunked over tokens (`train.chunked_loss`);
    the others take their loss on the logits."""
    norm_saved_tensors: int = 3
    """Planner: tensors of width dim each norm saves for backward. RMSNorm (models/common/norm.py,
    eager): its input, the normalised x and the scaled output; torch's fused LayerNorm: its input and
    output (the per-token mean and rstd are not counted)."""
    mlp_saved_per_ffn_dim: int = 4
    """Planner: elements a dense MLP saves per token, in units of ffn_dim: SwiGLU's gate, up,
    silu(gate) and product (4); a GELU MLP's up output and GELU output (2)."""
    compiled_block_counted: bool = False
    """Planner: `train.compile` blocks are counted by the rewrite rules' compiled count (the SwiGLU
    rule recomputes silu(gate) * up in backward); other families' compiled blocks count as eager."""
    # -- what core/model_counts.py counts (its docstring has the formulas) --
    layer_norm: bool = False
    """Its norms are LayerNorms, a weight and a bias (2h each), not RMSNorms (a weight, h)."""
    linear_biases: bool = False
    """Every linear layer of a block has a bias of its output width: q, k, v and o (a*d + 2*k*d + h),
    each MLP matrix. Without it, `model.qkv_bias` adds the q/k/v biases alone."""
    mlp: str = "swiglu"
    """The dense MLP, one of MLP_KINDS: 3*h*f parameters when gated (gate, up, down), 2*h*f when not
    (up, down), plus a bias per matrix with `linear_biases`."""
    position_table: str = "none"
    """One of POSITION_TABLES: model.max_seq_len rows of h ("sequence"), or a row per patch and one for
    the class token, with the class token itself ("patches"). An input lookup, as the token table is."""
    token_type_table: bool = False
    """A token-type (segment) table of model.type_vocab_size rows, added to the token embeddings."""
    embedding_norm: bool = False
    """A norm of the summed input embeddings, computing on every token before the first block."""
    head_transform: bool = False
    """The masked-LM head: a dense layer (h*h + h) and a norm before the output projection, which has
    a bias of V."""
    relative_position_bias: bool = False
    """Each stack's attention adds a learned bias per relative-position bucket and head
    (model.relative_buckets * a parameters a stack)."""
    lora_roles: Mapping[str, str] = field(default_factory=dict)
    """LoRA: role name (`train.lora_targets`) -> the linear it names within a block, e.g. "q" ->
    "attn.q_proj". Empty: the family takes no adapters. Its plan (`ModelPlan.lora_roles`) reads it."""
    own_fields: Mapping[str, str] = field(default_factory=dict)
    """ModelConfig fields only this family computes, with what each sets. Any other family would
    silently ignore them, so there they must keep their defaults."""
    check: Callable[[Any], None] | None = None
    """The family's own validation of a ModelConfig (raises ValueError naming field, value, fix)."""
    hf_model_types: tuple[str, ...] = ()
    """Hugging Face `model_type`s its config.json mapping (`models/<family>/hf_config.py`) converts."""
    estimates_any_decoder: bool = False
    """The planner reads this family's own config.jsons, and those of a `model_type` no family converts
    (Qwen3-MoE, ...), with its lenient shape reader (`hf_config.estimate_config_from_hf`), which accepts
    shapes the converter refuses (a window on some layers only, dense `mlp_only_layers`, ...)."""

    def __post_init__(self):
        assert self.objective in OBJECTIVES, self.objective
        assert self.mlp in MLP_KINDS, self.mlp
        assert self.position_table in POSITION_TABLES, self.position_table

    @property
    def image_input(self) -> bool:
        """It reads images, not tokens: no tokenizer, no vocabulary. The counts: a patch projection
        (C*p*p*h + h) instead of a token table, a classifier (K*h + K) instead of the output projection."""
        return self.objective == "image_classification"

    @property
    def generates_text(self) -> bool:
        return self.objective in TEXT_GENERATING_OBJECTIVES
