"""The Llama family as data (Llama 2/3, Mistral, Qwen2/3, and the mixture-of-experts Mixtral and
Qwen2-MoE): a pre-norm causal decoder with RMSNorm, RoPE, a SwiGLU MLP (or MoE layers) and
grouped-query attention. The HF config mapping is hf_config.py; the torch side is family.py."""

from shardwise.core.family import ATTENTION_LORA_ROLES, FamilySpec

SPEC = FamilySpec(
    name="llama",
    objective="causal_lm",
    rotary_positions=True,
    chunked_loss=True,
    norm_saved_tensors=3,
    mlp_saved_per_ffn_dim=4,
    compiled_block_counted=True,
    lora_roles={**ATTENTION_LORA_ROLES, "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    own_fields={
        "rope_theta": "rotary positions",
        "rope_scaling_factor": "rotary positions",
        "parallel_block": "the PaLM-style parallel block",
        "qk_norm": "q/k norms",
        "sliding_window": "sliding-window attention",
        "n_experts": "mixture-of-experts layers",
        "dense_layers": "mixture-of-experts layers",
        "shared_expert_ffn_dim": "mixture-of-experts layers",
    },
    hf_model_types=("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe"),
    estimates_any_decoder=True,
)
