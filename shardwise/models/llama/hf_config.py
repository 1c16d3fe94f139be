"""config.json of HF `transformers` Llama / Mistral / Qwen2 / Qwen3 (and, via `hf_moe`, Mixtral /
Qwen2-MoE) <-> shardwise ModelConfig.

Field by field; what has no shardwise equivalent (o_proj or MLP biases, YaRN and other RoPE
variants, parallel blocks, a sliding window on some layers only) is refused with an error naming
the key rather than converted approximately. Used by `hf_adapter`, which adds the weights.
`estimate_config_from_hf` is the planner's reading: the shape alone, of any decoder, refusing none
of that.

Sliding windows: Mistral's `sliding_window`, Qwen2/Qwen3's `use_sliding_window` +
`sliding_window` + `max_window_layers` (or `layer_types`), read by `hf_shape.layer_windows`.
One window on every layer converts to `model.sliding_window`; a window of at least
max_position_embeddings cuts nothing within the model's context and converts to 0 (full causal
attention, which every layout runs); a mix of windowed and full layers is refused.
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.models.llama.hf_shape import QKV_BIAS_TYPES, hf_shape, layer_windows, required
from shardwise.core.model import ModelConfig
from shardwise.models.llama.hf_moe_config import MOE_ARCHITECTURES, check_moe_exportable, moe_fields_from_hf, moe_fields_to_hf
from shardwise.models.families import validate_model

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", **MOE_ARCHITECTURES}
QKV_BIAS_ARCHS = QKV_BIAS_TYPES
CONVERTED_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                          "tie_embeddings", "qkv_bias", "qk_norm")
"""The fields of `hf_shape.hf_shape` a Llama-family ModelConfig takes as they are (MoE ones via hf_moe)."""
# Used when config.json leaves a field out: the defaults of the HF config classes.
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768, "mixtral": 4096 * 32,
                         "qwen2_moe": 32768}
WINDOW_ARCHS = ("mistral", "mixtral", "qwen2", "qwen3")
"""Architectures that export a sliding window on every layer."""
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0


# -- config.json -> ModelConfig --------------------------------------------------------------


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a HF config.json dict (Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen2-MoE), validated."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise invalid("config.json model_type", model_type, f"use one of {', '.join(ARCHITECTURES)}")
    max_positions = hf.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS[model_type]
    _refuse_unsupported_features(hf)
    shape = hf_shape(hf)
    cfg = ModelConfig(
        # Every shape field is set explicitly; "demo" only satisfies ModelConfig.validate.
        preset="demo",
        **{key: shape[key] for key in CONVERTED_SHAPE_FIELDS},
        max_seq_len=max_positions,
        sliding_window=sliding_window_from_hf(hf, max_positions),
        norm_eps=hf.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS),
        init_std=hf.get("initializer_range", 0.02),
        **_rope_fields_from_hf(hf, max_positions),
        **moe_fields_from_hf(hf, model_type, shape),
    )
    validate_model(cfg)
    return cfg


def estimate_config_from_hf(hf: dict) -> ModelConfig:
    """The planner's ModelConfig of a decoder's config.json, validated: the shape `hf_shape` reads,
    of any model_type whose keys are Llama's (Qwen3-MoE, ...). Unlike `config_from_hf` it refuses
    nothing the counts do not need (other activations, o_proj or MLP biases, RoPE variants, windows
    on some layers only, dense `mlp_only_layers`, a shared expert whose width is no multiple of an
    expert's): the planner estimates the model without converting it. RoPE, windows and router
    settings keep their defaults; a config.json without `max_position_embeddings` keeps the
    default model.max_seq_len, which a Llama-family count does not read."""
    shape = hf_shape(hf)
    positions = hf.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS.get(hf.get("model_type"))
    cfg = ModelConfig(
        preset="demo", **{key: shape[key] for key in CONVERTED_SHAPE_FIELDS},
        **({"max_seq_len": int(positions)} if positions else {}), **estimated_moe_fields(shape),
    )
    return validate_model(cfg)


def estimated_moe_fields(shape: dict) -> dict:
    """The MoE fields of an `hf_shape`: one shared expert of the config's shared width (Qwen-MoE's,
    gated), the MoE layers by step less the dense ones (indices beyond the model are ignored, as HF does)."""
    n_experts = shape["n_experts"]
    if not n_experts:
        return {}
    shared = shape["shared_ffn_dim"]
    return dict(n_experts=n_experts, experts_per_token=shape["experts_per_token"], moe_ffn_dim=shape["moe_ffn_dim"],
                n_shared_experts=1 if shared else 0, shared_expert_ffn_dim=shared, shared_expert_gate=bool(shared),
                moe_layer_step=shape["moe_layer_step"],
                dense_layers=[layer for layer in shape["dense_layers"] if 0 <= layer < shape["n_layers"]])


def _refuse_unsupported_features(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise invalid("config.json hidden_act", hf["hidden_act"], "shardwise's MLP is SwiGLU: only 'silu' converts")
    if hf.get("mlp_bias"):
        raise invalid("config.json mlp_bias", True, "shardwise's MLP has no biases: only mlp_bias false converts")
    if hf.get("attention_bias"):
        # HF Llama puts the bias on o_proj too; shardwise has q/k/v biases only (the Qwen2 layout).
        raise invalid("config.json attention_bias", True, "o_proj biases are unsupported: use false")


def sliding_window_from_hf(hf: dict, max_positions: int) -> int:
    """`model.sliding_window`: the one window of every layer, 0 when none cuts attention short."""
    windows = {window if window < max_positions else 0 for window in layer_windows(hf)}
    if len(windows) > 1:
        key = "layer_types" if hf.get("layer_types") else "max_window_layers"
        raise invalid(
            f"config.json {key}", hf.get(key), "shardwise applies one sliding window to every layer, and this "
            "config mixes windowed and full-attention layers (max_window_layers 0: all windowed)",
        )
    return windows.pop() if windows else 0


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
    if arch in ("llama", "qwen3"):
        hf |= dict(attention_bias=False)
    if arch == "llama":
        hf["mlp_bias"] = False
    if arch != "llama":
        hf["sliding_window"] = cfg.sliding_window or None
    if arch in (*QKV_BIAS_ARCHS, "qwen3"):
        # max_window_layers: the first layer with a window (0: all, n_layers: none); layer_types says
        # it again for transformers versions that read only the list.
        first_windowed = 0 if cfg.sliding_window else cfg.n_layers
        hf |= dict(use_sliding_window=bool(cfg.sliding_window), max_window_layers=first_windowed)
    if arch in ("qwen2", "qwen3") and cfg.sliding_window:
        hf["layer_types"] = ["sliding_attention"] * cfg.n_layers
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
    validate_model(cfg)
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, f"use one of {', '.join(ARCHITECTURES)}")
    refuse_parallel_block(cfg)
    check_moe_exportable(cfg, arch)
    if cfg.qk_norm and cfg.qkv_bias:
        raise invalid("model.qkv_bias", True, "no HF architecture has q/k/v biases together with q/k norms "
                      "(model.qk_norm = true): only a model without one of them exports")
    if cfg.qk_norm and arch != "qwen3":
        raise invalid("arch", arch, 'a model with q/k norms (model.qk_norm) exports as arch="qwen3"')
    if not cfg.qk_norm and arch == "qwen3":
        raise invalid("arch", arch, 'HF Qwen3 always has q/k norms: export a model without them as arch="mistral"')
    if cfg.sliding_window and arch not in WINDOW_ARCHS:
        others = ", ".join(WINDOW_ARCHS[1:])
        raise invalid("arch", arch, f"HF {ARCHITECTURES[arch]} has no sliding window on every layer "
                      f"(model.sliding_window = {cfg.sliding_window}): use arch=\"mistral\" (or {others})")
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
        raise invalid("model.parallel_block", True,
                      "HF Llama/Mistral/Qwen2/Qwen3 have no parallel block: export sequential ones")
