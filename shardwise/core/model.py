"""The architecture of a model (the `model` config section). Its parameter and FLOP counts depend on
its family's traits too: `core/model_counts.ModelCounts(model, spec)`, which
`models.families.counts_of(cfg)` builds.

Pure Python (no torch): the planner and config validation use it without building a model."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.core.errors import invalid, require_positive, require_representable
from shardwise.core.family import FamilySpec

@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "demo"
    """Named shape to start from (debug, demo, llama3-1b, llama3-3b, llama3-8b, llama3-70b, llama3-405b,
    moe-debug, mixtral-8x7b, gpt2-debug, gpt2, bert-debug, bert-base, vit-debug, vit-base, t5-debug,
    t5-small);
    the other model fields override it."""
    family: str = "llama"
    """Architecture: llama (RMSNorm, RoPE, SwiGLU; also Mistral, Qwen2/3, Mixtral); gpt2 (LayerNorm
    with bias, learned positions of max_seq_len rows, GELU (tanh) MLP of ffn_dim, biases on every
    projection, multi-head attention); bert (a bidirectional post-norm encoder trained as a masked
    LM, exact GELU, token-type table); vit (a pre-norm encoder over image patches with a class token,
    trained as an image classifier); t5 (an encoder-decoder with RMSNorm, relative position biases,
    no biases; v1.0 ReLU or v1.1 gated-GELU MLP), trained on span corruption."""
    dim: int = 256
    """Hidden size (width of the residual stream)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Query heads."""
    n_kv_heads: int = 4
    """Key/value heads: n_heads = MHA, 1 = MQA, a divisor of n_heads = GQA."""
    head_dim: int = 0
    """Width of one head; 0 = dim / n_heads."""
    ffn_dim: int = 704
    """Hidden size of the MLP (SwiGLU for llama, GELU for gpt2)."""
    vocab_size: int = 4096
    """Vocabulary size (rows of the embedding)."""
    max_seq_len: int = 1024
    """Longest sequence the model is used with (training or generation)."""
    norm_eps: float = 1e-5
    """Norm epsilon (RMSNorm for llama, LayerNorm for gpt2)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling_factor: float = 0.0
    """Llama-3 RoPE frequency scaling factor; 0 = off."""
    rope_low_freq_factor: float = 1.0
    """Llama-3 RoPE scaling: low-frequency factor."""
    rope_high_freq_factor: float = 4.0
    """Llama-3 RoPE scaling: high-frequency factor."""
    rope_original_max_seq_len: int = 8192
    """Llama-3 RoPE scaling: context length of the unscaled model."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    parallel_block: bool = False
    """PaLM-style block: x + attn(norm(x)) + mlp(norm(x)) with one shared norm."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm of width head_dim on each head's queries and keys, before RoPE."""
    sliding_window: int = 0
    """Attention window in tokens (Mistral, Qwen2/3): position i attends i - window < j <= i;
    0 = full causal attention. Not with ring attention (parallel.cp_mode = "ring")."""
    type_vocab_size: int = 2
    """BERT: rows of the token-type (segment) table; every token shardwise trains is of type 0."""
    image_size: int = 0
    """ViT: side of the square input image in pixels (0 for the text families)."""
    patch_size: int = 0
    """ViT: side of a square patch; the image is cut into (image_size / patch_size)^2 of them, and
    max_seq_len must be that count + 1 (the class token)."""
    n_channels: int = 3
    """ViT: channels of the input image (3 = RGB, 1 = grey)."""
    n_classes: int = 0
    """ViT: classes of the classification head (0 for the text families)."""
    n_decoder_layers: int = 0
    """T5: decoder blocks; 0 = n_layers (n_layers is the encoder's)."""
    relative_buckets: int = 32
    """T5: relative-position buckets of each stack's attention bias."""
    relative_max_distance: int = 128
    """T5: the distance from which all positions share the last bucket."""
    gated_mlp: bool = False
    """T5 v1.1 / Flan-T5: the gated-GELU MLP (tanh GELU) instead of v1.0's ReLU."""
    init_std: float = 0.02
    """Std of the normal weight init; output projections get init_std / sqrt(2 * n_layers)."""
    # -- mixture of experts (shardwise.models.common.moe) --
    n_experts: int = 0
    """Routed experts per MoE layer; 0 = a dense model."""
    experts_per_token: int = 2
    """Experts each token is sent to (top-k): 1 = Switch, 2 = Mixtral."""
    n_shared_experts: int = 0
    """Experts every token also goes through (DeepSeek/Qwen2-MoE), each moe_ffn_dim wide."""
    moe_ffn_dim: int = 0
    """Hidden size of one expert's SwiGLU; 0 = ffn_dim."""
    moe_layer_step: int = 1
    """Every k-th block is MoE (block i when (i + 1) % k == 0, as Qwen2-MoE); 1 = all."""
    router_score: str = "softmax"
    """Router scores: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3)."""
    router_norm_topk: bool = True
    """Renormalise the top-k weights to sum 1 (Mixtral); false keeps the raw scores (Switch, Qwen2-MoE)."""
    router_bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): per-expert selection bias moved by this much per step
    against the load; 0 = off."""
    capacity_factor: float = 0.0
    """Slots per expert = ceil(factor * tokens * k / n_experts), assignments beyond are dropped; 0 = dropless."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch) added to the training loss; 0 = off."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE) added to the training loss; 0 = off."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . w), as Qwen2-MoE does."""
    shared_expert_ffn_dim: int = 0
    """Width of one shared expert's SwiGLU; 0 = the routed experts' width (Qwen2-MoE's
    shared_expert_intermediate_size need not be a multiple of it)."""
    dense_layers: list[int] = field(default_factory=list)
    """Blocks that keep a dense MLP though model.moe_layer_step makes them MoE (Qwen-MoE's mlp_only_layers)."""

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_experts > 0 and (layer_idx + 1) % self.moe_layer_step == 0
                and layer_idx not in self.dense_layers)

    def validate(self, spec: FamilySpec) -> None:
        """The checks of `spec`'s family and those every family shares. `models.families.validate_model`
        calls it with the family's spec after checking the name and the other families' fields."""
        require_representable("model", self)  # also reached without a Config: the planner, presets
        require_positive("model", self, "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
        self.validate_family(spec)  # after the counts: its checks compare them
        if self.n_heads % self.n_kv_heads:
            raise invalid("model.n_kv_heads", self.n_kv_heads, f"use a divisor of model.n_heads ({self.n_heads})")
        if not self.head_dim and self.dim % self.n_heads:
            raise invalid("model.n_heads", self.n_heads, f"use a divisor of model.dim ({self.dim}) or set model.head_dim")
        if self.head_size % 2 and spec.rotary_positions:
            raise invalid("model.head_dim", self.head_size, "RoPE needs an even head dimension")
        if self.head_dim < 0:
            raise invalid("model.head_dim", self.head_dim, "use 0 (dim / n_heads) or a positive even width")
        if self.sliding_window < 0:
            raise invalid("model.sliding_window", self.sliding_window, "use 0 (full causal attention) or a window >= 1")
        if self.rope_scaling_factor < 0:
            raise invalid("model.rope_scaling_factor", self.rope_scaling_factor, "use 0 (off) or a factor > 0")
        self.validate_scales()
        self.validate_moe()
        if self.rope_scaling_factor and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise invalid(
                "model.rope_high_freq_factor", self.rope_high_freq_factor,
                f"must exceed model.rope_low_freq_factor ({self.rope_low_freq_factor})",
            )

    def validate_family(self, spec: FamilySpec) -> None:
        if spec.multi_head and self.n_kv_heads != self.n_heads:
            raise invalid("model.n_kv_heads", self.n_kv_heads,
                          f"{self.family} attention is multi-head: use model.n_heads ({self.n_heads})")
        if spec.heads_span_dim and self.head_dim and self.head_dim * self.n_heads != self.dim:
            raise invalid("model.head_dim", self.head_dim, f"{self.family} heads are dim / n_heads wide: use 0")
        if spec.check:
            spec.check(self)

    @property
    def num_patches(self) -> int:
        """ViT: patches per image."""
        return (self.image_size // self.patch_size) ** 2 if self.patch_size else 0

    def validate_scales(self) -> None:
        """The floats every family reads as a divisor, a base or a scale: 0 or less takes no effect, or NaNs."""
        for name in ("norm_eps", "rope_theta", "rope_low_freq_factor", "rope_high_freq_factor", "init_std"):
            if not getattr(self, name) > 0:
                raise invalid(f"model.{name}", getattr(self, name), "use a positive value")
        require_positive("model", self, "rope_original_max_seq_len")

    def validate_moe(self) -> None:
        """The ranges hold on a dense model too (its presets keep the defaults), the rest only with experts."""
        if self.n_experts < 0 or self.n_experts == 1:
            raise invalid("model.n_experts", self.n_experts, "use 0 (dense) or at least 2 experts")
        require_positive("model", self, "experts_per_token", "moe_layer_step")
        for name in ("n_shared_experts", "moe_ffn_dim", "shared_expert_ffn_dim"):
            if getattr(self, name) < 0:
                raise invalid(f"model.{name}", getattr(self, name), "use 0 or a positive integer")
        for name in ("router_bias_update_rate", "capacity_factor", "aux_loss_coef", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise invalid(f"model.{name}", getattr(self, name), "use 0 (off) or a positive value")
        if not self.n_experts:
            return
        if self.experts_per_token > self.n_experts:
            raise invalid("model.experts_per_token", self.experts_per_token,
                          f"use at most model.n_experts ({self.n_experts})")
        if any(not 0 <= layer < self.n_layers for layer in self.dense_layers):
            raise invalid("model.dense_layers", self.dense_layers, f"use block indices below model.n_layers ({self.n_layers})")
        if self.router_score not in ("softmax", "sigmoid"):
            raise invalid("model.router_score", self.router_score, "use softmax or sigmoid")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise invalid("model.shared_expert_gate", True, "it gates shared experts: set model.n_shared_experts > 0")

    # -- what the counts read (shardwise/core/model_counts.py) ---------------------------

    @property
    def shared_ffn_dim(self) -> int:
        """Total width of the shared experts (each shared_expert_ffn_dim, or moe_ffn_dim, wide)."""
        return self.n_shared_experts * (self.shared_expert_ffn_dim or self.expert_ffn_dim)

    @property
    def norms_per_block(self) -> int:
        return 1 if self.parallel_block else 2
