"""config.json of HF `transformers` Llama / Mistral / Qwen2 (and, via `hf_moe`, Mixtral / Qwen2-MoE) <-> shardwise ModelConfig.

Field by field; what has no shardwise equivalent (sliding-window attention, o_proj or MLP
biases, YaRN and other RoPE variants, parallel blocks) is refused with an error naming the key
rather than converted approximately. Used by `hf_adapter`, which adds the weights.
"""

from __future__ import annotations

from shardwise.config.errors import invalid
from shardwise.config.hf_config import QKV_BIAS_TYPES, hf_shape, required
from shardwise.config.model import ModelConfig
from shardwise.models.llama.hf_moe import MOE_ARCHITECTURES, check_moe_exportable, moe_fields_from_hf, moe_fields_to_hf

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 **MOE_ARCHITECTURES}
QKV_BIAS_ARCHS = QKV_BIAS_TYPES
CONVERTED_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                          "tie_embeddings", "qkv_bias")
"""The fields of `config/hf_config.hf_shape` a Llama-family ModelConfig takes as they are (MoE ones via hf_moe)."""
# Used when config.json leaves a field out: the defaults of the HF config classes.
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "mixtral": 4096 * 32, "qwen2_moe": 32768}
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0


# -- config.json -> ModelConfig --------------------------------------------------------------


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a HF config.json dict (Llama, Mistral or Qwen2), validated."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise invalid("config.json model_type", model_type, f"use one of {', '.join(ARCHITECTURES)}")
    max_positions = hf.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS[model_type]
    _refuse_unsupported_features(hf, model_type, max_positions)
    shape = hf_shape(hf)
    cfg = ModelConfig(
        # Every shape field is set explicitly; "demo" only satisfies ModelConfig.validate.
        preset="demo",
        **{key: shape[key] for key in CONVERTED_SHAPE_FIELDS},
        max_seq_len=max_positions,
        norm_eps=hf.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS),
        init_std=hf.get("initializer_range", 0.02),
        **_rope_fields_from_hf(hf, max_positions),
        **moe_fields_from_hf(hf, model_type, shape),
    )
    cfg.validate()
    return cfg


def _refuse_unsupported_features(hf: dict, model_type: str, max_positions: int) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise invalid("config.json hidden_act", hf["hidden_act"], "shardwise's MLP is SwiGLU: only 'silu' converts")
    if hf.get("mlp_bias"):
        raise invalid("config.json mlp_bias", True, "shardwise's MLP has no biases: only mlp_bias false converts")
    if hf.get("attention_bias"):
        # HF Llama puts the bias on o_proj too; shardwise has q/k/v biases only (the Qwen2 layout).
        raise invalid("config.json attention_bias", True, "o_proj biases are unsupported: use false")
    _refuse_sliding_window(hf, model_type, max_positions)


def _refuse_sliding_window(hf: dict, model_type: str, max_positions: int) -> None:
    """shardwise attention is full causal: refuse a window that would actually cut attention short."""
    window = hf.get("sliding_window")
    window_limits = window is not None and window < max_positions
    if model_type in ("mistral", "mixtral") and window_limits:
        raise invalid("config.json sliding_window", window, "shardwise attention is full causal: use null")
    if model_type in QKV_BIAS_ARCHS and hf.get("use_sliding_window") and window_limits:
        raise invalid("config.json use_sliding_window", True, "shardwise attention is full causal: use false")
    if "sliding_attention" in (hf.get("layer_types") or []) and window_limits:
        raise invalid(
            "config.json layer_types", "sliding_attention", "shardwise attention is full causal: use full_attention",
        )


def _rope_fields_from_hf(hf: dict, max_positions: int) -> dict:
    """RoPE settings from either spelling: 4.x (`rope_theta` + `rope_scaling`) or 5.x (`rope_parameters`)."""
    # transformers 5.x reads `rope_scaling` first when both are present; so do we.
    params = _single_rope_dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise invalid("config.json partial_rotary_factor", partial, "shardwise rotates whole heads: only 1.0 converts")
    fields = dict(rope_theta=float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))))
    if rope_type == "default":
        return fields
    if rope_type != "llama3":
        raise invalid("config.json rope_type", rope_type, "shardwise supports only 'default' and 'llama3' RoPE")
    where = "config.json llama3 rope_scaling"
    return fields | dict(
        rope_scaling_factor=float(required(params, "factor", where)),
        rope_low_freq_factor=float(required(params, "low_freq_factor", where)),
        rope_high_freq_factor=float(required(params, "high_freq_factor", where)),
        # transformers falls back to max_position_embeddings too.
        rope_original_max_seq_len=int(params.get("original_max_position_embeddings") or max_positions),
    )


def _single_rope_dict(params: dict) -> dict:
    """transformers 5.x may nest RoPE settings per layer type; shardwise has one RoPE for all layers."""
    nested = [value for value in params.values() if isinstance(value, dict)]
    if not nested:
        return params
    if any(value != nested[0] for value in nested):
        raise invalid("config.json rope_parameters", params, "per-layer-type RoPE is unsupported: use one setting")
    return nested[0]


# -- ModelConfig -> config.json --------------------------------------------------------------


def config_to_hf(cfg: ModelConfig, arch: str = "llama", *, dtype: str = "float32") -> dict:
    """A config.json dict that `transformers` (4.x and 5.x) loads as `arch`."""
    _check_exportable(cfg, arch)
    hf = dict(
        architectures=[ARCHITECTURES[arch]],
        model_type=arch,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_size,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        vocab_size=cfg.vocab_size,
        # 5.x reads `dtype`, 4.x `torch_dtype`; each accepts the other's spelling being present.
        dtype=dtype,
        torch_dtype=dtype,
        use_cache=True,
        **_rope_fields_to_hf(cfg),
    )
    if arch == "llama":
        hf |= dict(attention_bias=False, mlp_bias=False)
    if arch != "llama":
        hf["sliding_window"] = None
    if arch in QKV_BIAS_ARCHS:
        hf |= dict(use_sliding_window=False, max_window_layers=cfg.n_layers)
    if arch in MOE_ARCHITECTURES:
        hf |= moe_fields_to_hf(cfg, arch)
    return hf


def _rope_fields_to_hf(cfg: ModelConfig) -> dict:
    """The 4.x spelling: transformers 5.x still accepts it and moves it into `rope_parameters`."""
    if not cfg.rope_scaling_factor:
        return dict(rope_theta=cfg.rope_theta, rope_scaling=None)
    scaling = dict(
        rope_type="llama3",
        factor=cfg.rope_scaling_factor,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position_embeddings=cfg.rope_original_max_seq_len,
    )
    return dict(rope_theta=cfg.rope_theta, rope_scaling=scaling)


def _check_exportable(cfg: ModelConfig, arch: str) -> None:
    cfg.validate()
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, f"use one of {', '.join(ARCHITECTURES)}")
    refuse_parallel_block(cfg)
    check_moe_exportable(cfg, arch)
    if cfg.qkv_bias and arch not in QKV_BIAS_ARCHS:
        raise invalid("arch", arch, 'a model with q/k/v biases (model.qkv_bias) exports as arch="qwen2" (or qwen2_moe)')
    if not cfg.qkv_bias and arch == "qwen2":
        raise invalid("arch", arch, 'HF Qwen2 always has q/k/v biases: export a model without them as arch="llama"')
    if arch == "llama" and cfg.dim % cfg.n_heads:
        # transformers 5.x LlamaConfig refuses it even with head_dim set; Mistral is the same math and allows it.
        fix = f'HF Llama needs model.dim ({cfg.dim}) divisible by model.n_heads ({cfg.n_heads}): use arch="mistral"'
        raise invalid("arch", arch, fix)


def refuse_parallel_block(cfg: ModelConfig) -> None:
    if cfg.parallel_block:
        raise invalid("model.parallel_block", True, "HF Llama/Mistral/Qwen2 have no parallel block: export sequential ones")
