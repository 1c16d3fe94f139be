"""config.json of HF `transformers` BERT (`BertForMaskedLM`) <-> shardwise ModelConfig (family bert).

Field by field; what shardwise's BERT does not compute (an activation other than the exact erf
GELU, relative position scores, a causal decoder, cross-attention) is refused with an error
naming the key rather than converted approximately. A key config.json leaves out takes
BertConfig's default. Used by `hf_adapter`, which adds the weights.
"""

from __future__ import annotations

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_config_parts import (ENCODER_CONSTANTS, ENCODER_FIELDS, Fields, check_model_type,
    config_json, fields_from_hf, fields_to_hf)
from shardwise.models.families import validate_model

ARCHITECTURES = {"bert": "BertForMaskedLM"}
DEFAULTS = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
                initializer_range=0.02, layer_norm_eps=1e-12, tie_word_embeddings=True)
"""transformers' BertConfig defaults."""
REFUSED = {
    "hidden_act": ("gelu", "shardwise's BERT MLP and head use the exact (erf) GELU: only gelu converts"),
    "position_embedding_type": ("absolute", "shardwise's BERT adds a learned absolute position table and has no "
                                            "relative position scores: only absolute converts"),
    "is_decoder": (False, "shardwise's BERT is a bidirectional encoder, not a causal decoder: only false converts"),
    "add_cross_attention": (False, "shardwise's BERT has no cross-attention: only false converts"),
}
"""config.json keys whose other values change the math: (the value shardwise computes, the fix).
transformers 5.x dropped `position_embedding_type` (it computes absolute positions whatever the
key says), but a 4.x checkpoint with relative positions holds distance tables it would ignore."""


FIELDS: Fields = ENCODER_FIELDS | dict(
    vocab_size=("vocab_size", int), max_seq_len=("max_position_embeddings", int),
    type_vocab_size=("type_vocab_size", int), tie_embeddings=("tie_word_embeddings", bool),
)
"""The ModelConfig fields that are one config.json key each."""


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a HF BERT config.json dict, validated."""
    check_model_type(hf, "bert")
    for key, (value, fix) in REFUSED.items():
        if hf.get(key) is not None and hf[key] != value:
            raise invalid(f"config.json {key}", hf[key], fix)
    fields = fields_from_hf(hf, FIELDS, DEFAULTS)
    cfg = ModelConfig(
        preset="bert-base",  # every field is set here; the preset name only satisfies ModelConfig.validate
        family="bert", n_kv_heads=fields["n_heads"], **fields,
    )
    validate_model(cfg)
    return cfg


def config_to_hf(cfg: ModelConfig, arch: str = "bert", *, dtype: str = "float32") -> dict:
    """A config.json dict that `transformers` (4.x and 5.x) loads as BertForMaskedLM."""
    check_exportable(cfg, arch)
    keys = fields_to_hf(cfg, FIELDS) | ENCODER_CONSTANTS | dict(
        position_embedding_type="absolute",  # read by 4.x; 5.x has only absolute positions
        is_decoder=False,
        add_cross_attention=False,
    )
    return config_json(arch, ARCHITECTURES, keys, dtype, use_cache=True)


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    validate_model(cfg)
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, 'a BERT model (model.family = "bert") exports as arch="bert"')
