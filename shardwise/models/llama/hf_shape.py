"""One reader of a Hugging Face config.json's shape, in shardwise's field names.

Two callers build on it: the converter (`models/llama/hf_config.config_from_hf`), which adds
RoPE, router and init settings and refuses what it cannot convert exactly, and the planner
(`models/llama/hf_config.estimate_config_from_hf`), which estimates any decoder of these kinds,
converted or not (Qwen3-MoE, MoE models with dense `mlp_only_layers`). Pure Python: the planner
reads configs without torch. A key config.json leaves out takes the default of the HF config class.
`layer_windows` reads each layer's sliding attention window, whose rules differ by model type.
"""

from __future__ import annotations

from shardwise.core.errors import invalid

QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
"""HF types whose attention always has q/k/v biases (Qwen2-MoE's `qkv_bias` may turn them off)."""
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632),
}
"""The MoE fields' defaults of transformers' MixtralConfig and Qwen2MoeConfig."""
HEAD_DIM_DEFAULTS = {"qwen3": 128}
"""HF config classes whose head_dim, when config.json leaves it out, is a constant (Qwen3Config: 128),
not hidden_size / num_attention_heads."""
SLIDING_WINDOW_DEFAULTS = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "qwen2_moe": 4096, "qwen3_moe": 4096}
"""`sliding_window` when config.json leaves the key out (an explicit null means no window)."""
MAX_WINDOW_LAYERS_DEFAULT = 28
"""`max_window_layers` of Qwen2Config, Qwen3Config and Qwen2MoeConfig."""


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
    head_dim = int(hf.get("head_dim") or HEAD_DIM_DEFAULTS.get(model_type, 0))
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


def layer_windows(hf: dict) -> list[int]:
    """The attention window of each layer as HF transformers applies it (0: full causal attention).

    Mistral, Mixtral: `sliding_window` on every layer (null: none). Qwen2/Qwen3 and their MoE
    kin: only with `use_sliding_window`, then on the layers `layer_types` marks
    "sliding_attention", or without that list: Qwen2/Qwen3 the layers >= `max_window_layers`,
    Qwen2-MoE the even layers below it, Qwen3-MoE every layer. Llama: none."""
    model_type = str(hf.get("model_type") or "")
    n_layers = int(required(hf, "num_hidden_layers"))
    window = int((hf["sliding_window"] if "sliding_window" in hf else SLIDING_WINDOW_DEFAULTS.get(model_type)) or 0)
    if model_type in ("mistral", "mixtral"):
        return [window] * n_layers
    if not model_type.startswith("qwen") or not hf.get("use_sliding_window") or not window:
        return [0] * n_layers
    types = hf.get("layer_types") or _default_layer_types(hf, model_type, n_layers)
    return [window if kind == "sliding_attention" else 0 for kind in types]


def _default_layer_types(hf: dict, model_type: str, n_layers: int) -> list[str]:
    """The `layer_types` HF derives when config.json has none (use_sliding_window set)."""
    max_window_layers = hf.get("max_window_layers")
    max_window_layers = MAX_WINDOW_LAYERS_DEFAULT if max_window_layers is None else int(max_window_layers)
    if model_type == "qwen2_moe":
        sliding = [i % 2 == 0 and i < max_window_layers for i in range(n_layers)]
    elif model_type == "qwen3_moe":
        sliding = [True] * n_layers
    else:
        sliding = [i >= max_window_layers for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]
