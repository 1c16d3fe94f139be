"""The architecture of a Llama-family decoder, with its parameter and FLOP counts."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.models.common.rope import RopeSpec


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "demo"
    """Named shape to start from (debug, demo, llama3-1b, llama3-3b, llama3-8b, llama3-70b, llama3-405b);
    the other model fields override it."""
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
    """Hidden size of the SwiGLU MLP."""
    vocab_size: int = 4096
    """Vocabulary size (rows of the embedding)."""
    max_seq_len: int = 1024
    """Longest sequence the model is used with (training or generation)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
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
    init_std: float = 0.02
    """Std of the normal weight init; output projections get init_std / sqrt(2 * n_layers)."""

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec(
            head_dim=self.head_size,
            theta=self.rope_theta,
            scaling_factor=self.rope_scaling_factor,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor,
            original_max_seq_len=self.rope_original_max_seq_len,
        )

    def validate(self) -> None:
        from shardwise.config.schema import invalid, require_positive
        from shardwise.models.llama.presets import PRESETS

        if self.preset not in PRESETS:
            raise invalid("model.preset", self.preset, f"use one of {', '.join(PRESETS)}")
        require_positive("model", self, "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
        if self.n_heads % self.n_kv_heads:
            raise invalid("model.n_kv_heads", self.n_kv_heads, f"use a divisor of model.n_heads ({self.n_heads})")
        if not self.head_dim and self.dim % self.n_heads:
            raise invalid("model.n_heads", self.n_heads, f"use a divisor of model.dim ({self.dim}) or set model.head_dim")
        if self.head_size % 2:
            raise invalid("model.head_dim", self.head_size, "RoPE needs an even head dimension")
        if self.head_dim < 0:
            raise invalid("model.head_dim", self.head_dim, "use 0 (dim / n_heads) or a positive even width")
        if self.rope_scaling_factor < 0:
            raise invalid("model.rope_scaling_factor", self.rope_scaling_factor, "use 0 (off) or a factor > 0")
        if self.rope_scaling_factor and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise invalid(
                "model.rope_high_freq_factor", self.rope_high_freq_factor,
                f"must exceed model.rope_low_freq_factor ({self.rope_low_freq_factor})",
            )

    # -- counts ------------------------------------------------------------------------

    def attention_params(self) -> int:
        q_width, kv_width = self.n_heads * self.head_size, self.n_kv_heads * self.head_size
        weights = self.dim * (q_width + 2 * kv_width) + q_width * self.dim
        return weights + ((q_width + 2 * kv_width) if self.qkv_bias else 0)

    def block_params(self) -> int:
        norms = 1 if self.parallel_block else 2
        return self.attention_params() + 3 * self.dim * self.ffn_dim + norms * self.dim

    def num_params(self, *, embedding: bool = True) -> int:
        """All parameters; `embedding=False` leaves out the input embedding table
        (when tied, the table is still counted once, as the output head)."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        table = self.vocab_size * self.dim
        total = self.n_layers * self.block_params() + self.dim + head
        if embedding or self.tie_embeddings:
            total += table
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, 6N + 12*L*h*s (PaLM appendix B): N counts the weights that
        take part in matmuls (all but the input embedding lookup), the second term the attention
        scores and weighted sum, h = n_heads * head_dim (causal masking is not subtracted, by convention)."""
        n_matmul = self.num_params(embedding=False)
        return 6 * n_matmul + 12 * self.n_layers * self.n_heads * self.head_size * seq_len
