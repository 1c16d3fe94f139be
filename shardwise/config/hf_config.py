"""One reader of a Hugging Face config.json's shape, in shardwise's field names.

Two callers build on it: the converter (`models/llama/hf_config.config_from_hf`), which adds
RoPE, router and init settings and refuses what it cannot convert exactly, and the planner
(`planner/model_shape.shape_from_hf`), which estimates any decoder of these kinds, converted or
not (Qwen3's q/k norms, MoE models with dense `mlp_only_layers`). Pure Python: the planner reads
configs without torch. A key config.json leaves out takes the default of the HF config class.
"""

from __future__ import annotations

from shardwise.config.errors import invalid

QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
"""HF types whose attention always has q/k/v biases (Qwen2-MoE's `qkv_bias` may turn them off)."""
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632),
}
"""The MoE fields' defaults of transformers' MixtralConfig and Qwen2MoeConfig."""


def required(hf: dict, key: str, where: str = "config.json"):
    if hf.get(key) is None:
        raise invalid(f"{where} {key}", None, "set it; a HF config of this kind always has it")
    return hf[key]


def hf_value(hf: dict, key: str):
    """hf[key], or the HF config class's default for this model_type when it is absent or null."""
    value = hf.get(key)
    if value is not None:
        return value
    return MOE_DEFAULTS.get(hf.get("model_type"), {}).get(key)


def hf_shape(hf: dict) -> dict:
    """The shape of a Llama-family config.json (Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE) as
    shardwise fields: dim, n_layers, n_heads, n_kv_heads, head_dim (0: dim / n_heads), ffn_dim,
    vocab_size, tie_embeddings, qkv_bias, qk_norm, and for MoE n_experts, experts_per_token,
    moe_ffn_dim, shared_ffn_dim, moe_layer_step and dense_layers (`mlp_only_layers`)."""
    model_type = str(hf.get("model_type") or "")
    dim, n_heads = int(required(hf, "hidden_size")), int(required(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or 0)
    n_experts = int(hf_value(hf, "num_local_experts") or hf_value(hf, "num_experts") or 0)
    moe_ffn = int(hf_value(hf, "moe_intermediate_size") or 0) if n_experts else 0
    ffn = hf.get("intermediate_size") or moe_ffn or required(hf, "intermediate_size")
    if model_type in QKV_BIAS_TYPES:
        qkv_bias = model_type == "qwen2" or bool(hf.get("qkv_bias", True))
    else:
        qkv_bias = bool(hf.get("attention_bias"))
    return dict(
        dim=dim, n_layers=int(required(hf, "num_hidden_layers")), n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=0 if head_dim * n_heads == dim else head_dim,
        ffn_dim=int(ffn), vocab_size=int(required(hf, "vocab_size")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=model_type.startswith("qwen3"),
        n_experts=n_experts,
        experts_per_token=int(hf_value(hf, "num_experts_per_tok") or 2) if n_experts else 0,
        moe_ffn_dim=moe_ffn,
        shared_ffn_dim=int(hf_value(hf, "shared_expert_intermediate_size") or 0) if n_experts else 0,
        moe_layer_step=int(hf_value(hf, "decoder_sparse_step") or 1),
        dense_layers=tuple(hf.get("mlp_only_layers") or ()),
    )
