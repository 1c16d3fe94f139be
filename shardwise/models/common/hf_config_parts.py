"""The parts of a family's config.json mapping (`config/hf_<family>.py`; the Llama family's is
`models/llama/hf_config.py` on `config/hf_config.py`) that do not depend on the family: a key's value or its default, the ModelConfig fields that are one config.json key
each (`fields`: ModelConfig field -> (key, type), read and written by the same table), and the
frame of an exported config.json (architectures, model_type, dtype under both spellings).
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig

Fields = dict[str, tuple[str, type]]
"""ModelConfig field -> (its config.json key, the type it is read as)."""

ENCODER_FIELDS: Fields = dict(
    dim=("hidden_size", int), n_layers=("num_hidden_layers", int), n_heads=("num_attention_heads", int),
    ffn_dim=("intermediate_size", int), norm_eps=("layer_norm_eps", float), init_std=("initializer_range", float),
)
"""The keys BERT-style configs (BertConfig, ViTConfig) share."""
ENCODER_CONSTANTS = dict(
    hidden_act="gelu",
    # shardwise trains without dropout: the exported model fine-tunes as it was trained.
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)
"""What a BERT-style export always writes: the exact erf GELU and no dropout."""


def hf_value(hf: dict, key: str, defaults: dict, aliases: dict[str, str] | None = None):
    """hf[key] (or hf[aliases[key]]), or `defaults[key]` (the family's HF config class default) where
    config.json leaves it out or null."""
    for name in (key, (aliases or {}).get(key)):
        if name and hf.get(name) is not None:
            return hf[name]
    return defaults[key]


def check_model_type(hf: dict, model_type: str) -> None:
    if hf.get("model_type") != model_type:
        raise invalid("config.json model_type", hf.get("model_type"), f"use {model_type}")


def fields_from_hf(hf: dict, fields: Fields, defaults: dict, aliases: dict[str, str] | None = None) -> dict:
    """The ModelConfig fields of `fields`, each read from its key (or its default) as its type."""
    return {field: kind(hf_value(hf, key, defaults, aliases)) for field, (key, kind) in fields.items()}


def fields_to_hf(cfg: ModelConfig, fields: Fields) -> dict:
    """config.json's keys of `fields`, from the ModelConfig."""
    return {key: getattr(cfg, field) for field, (key, _) in fields.items()}


def config_json(arch: str, architectures: dict[str, str], keys: dict, dtype: str, **after_dtype) -> dict:
    """An exported config.json: the architecture and model type, the family's `keys`, the weights'
    dtype, then `after_dtype`."""
    return dict(
        architectures=[architectures[arch]],
        model_type=arch,
        **keys,
        # 5.x reads `dtype`, 4.x `torch_dtype`; each accepts the other's spelling being present.
        dtype=dtype,
        torch_dtype=dtype,
        **after_dtype,
    )
