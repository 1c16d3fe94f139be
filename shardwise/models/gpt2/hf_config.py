"""config.json of HF `transformers` GPT-2 (`GPT2LMHeadModel`) <-> shardwise ModelConfig (family gpt2).

Field by field; what shardwise's GPT-2 does not compute (exact-erf or other activations, unscaled
or layer-scaled attention scores, cross-attention) is refused with an error naming the key rather
than converted approximately. A key config.json leaves out takes GPT2Config's default. Used by
`hf_adapter`, which adds the weights.
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_config_parts import (Fields, check_model_type, config_json, fields_from_hf,
    fields_to_hf, hf_value)
from shardwise.models.families import validate_model

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
"""HF's names of GELU's tanh approximation, which shardwise's GPT-2 MLP computes."""
DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, layer_norm_epsilon=1e-5,
                initializer_range=0.02, activation_function="gelu_new", tie_word_embeddings=True)
"""transformers' GPT2Config defaults."""
REFUSED = {
    "scale_attn_weights": (True, "shardwise scales attention scores by 1/sqrt(head_dim): only true converts"),
    "scale_attn_by_inverse_layer_idx": (False, "shardwise does not scale scores by layer: only false converts"),
    "add_cross_attention": (False, "shardwise's GPT-2 is a decoder without cross-attention: only false converts"),
}
"""config.json keys whose other values change the math: (the value shardwise computes, the fix).
`reorder_and_upcast_attn` is accepted: it only changes the precision of HF's eager attention."""


FIELDS: Fields = dict(
    dim=("n_embd", int), n_layers=("n_layer", int), n_heads=("n_head", int), vocab_size=("vocab_size", int),
    max_seq_len=("n_positions", int), norm_eps=("layer_norm_epsilon", float),
    init_std=("initializer_range", float), tie_embeddings=("tie_word_embeddings", bool),
)
"""The ModelConfig fields that are one config.json key each (`ffn_dim` is `n_inner`, default 4 * dim)."""
ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
           "n_positions": "max_position_embeddings"}
"""The `hidden_size`-style names GPT2Config also answers to."""


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a HF GPT-2 config.json dict, validated."""
    check_model_type(hf, "gpt2")
    activation = hf_value(hf, "activation_function", DEFAULTS)
    if activation not in TANH_GELU:
        raise invalid("config.json activation_function", activation,
                      f"shardwise's GPT-2 MLP is GELU's tanh approximation: use {' or '.join(TANH_GELU)}")
    for key, (value, fix) in REFUSED.items():
        if hf.get(key, value) != value:
            raise invalid(f"config.json {key}", hf[key], fix)
    fields = fields_from_hf(hf, FIELDS, DEFAULTS, ALIASES)
    cfg = ModelConfig(
        preset="gpt2",  # every field is set here; the preset name only satisfies ModelConfig.validate
        family="gpt2", n_kv_heads=fields["n_heads"], ffn_dim=int(hf.get("n_inner") or 4 * fields["dim"]), **fields,
    )
    validate_model(cfg)
    return cfg


def config_to_hf(cfg: ModelConfig, arch: str = "gpt2", *, dtype: str = "float32") -> dict:
    """A config.json dict that `transformers` (4.x and 5.x) loads as GPT2LMHeadModel."""
    check_exportable(cfg, arch)
    keys = fields_to_hf(cfg, FIELDS) | dict(
        n_inner=cfg.ffn_dim,
        activation_function="gelu_new",
        # shardwise trains without dropout: the exported model fine-tunes as it was trained.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
    )
    return config_json(arch, ARCHITECTURES, keys, dtype, use_cache=True)


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    validate_model(cfg)
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, 'a GPT-2 model (model.family = "gpt2") exports as arch="gpt2"')
