"""config.json of HF `transformers` BERT (`BertForMaskedLM`) <-> shardwise ModelConfig (family bert).

Field by field; what shardwise's BERT does not compute (an activation other than the exact erf
GELU, relative position scores, a causal decoder, cross-attention) is refused with an error
naming the key rather than converted approximately. A key config.json leaves out takes
BertConfig's default. Used by `hf_adapter`, which adds the weights.
"""

from __future__ import annotations

from shardwise.config.errors import invalid
from shardwise.config.model import ModelConfig

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


def hf_value(hf: dict, key: str):
    """hf[key], or BertConfig's default."""
    return hf[key] if hf.get(key) is not None else DEFAULTS[key]


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a HF BERT config.json dict, validated."""
    if hf.get("model_type") != "bert":
        raise invalid("config.json model_type", hf.get("model_type"), "use bert")
    for key, (value, fix) in REFUSED.items():
        if hf.get(key) is not None and hf[key] != value:
            raise invalid(f"config.json {key}", hf[key], fix)
    n_heads = int(hf_value(hf, "num_attention_heads"))
    cfg = ModelConfig(
        preset="bert-base",  # every field is set here; the preset name only satisfies ModelConfig.validate
        family="bert", dim=int(hf_value(hf, "hidden_size")), n_layers=int(hf_value(hf, "num_hidden_layers")),
        n_heads=n_heads, n_kv_heads=n_heads, ffn_dim=int(hf_value(hf, "intermediate_size")),
        vocab_size=int(hf_value(hf, "vocab_size")), max_seq_len=int(hf_value(hf, "max_position_embeddings")),
        type_vocab_size=int(hf_value(hf, "type_vocab_size")), norm_eps=float(hf_value(hf, "layer_norm_eps")),
        init_std=float(hf_value(hf, "initializer_range")), tie_embeddings=bool(hf_value(hf, "tie_word_embeddings")),
    )
    cfg.validate()
    return cfg


def config_to_hf(cfg: ModelConfig, arch: str = "bert", *, dtype: str = "float32") -> dict:
    """A config.json dict that `transformers` (4.x and 5.x) loads as BertForMaskedLM."""
    check_exportable(cfg, arch)
    return dict(
        architectures=[ARCHITECTURES[arch]],
        model_type=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.ffn_dim,
        hidden_act="gelu",
        # shardwise trains without dropout: the exported model fine-tunes as it was trained.
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=cfg.type_vocab_size,
        initializer_range=cfg.init_std,
        layer_norm_eps=cfg.norm_eps,
        position_embedding_type="absolute",  # read by 4.x; 5.x has only absolute positions
        is_decoder=False,
        add_cross_attention=False,
        tie_word_embeddings=cfg.tie_embeddings,
        # 5.x reads `dtype`, 4.x `torch_dtype`; each accepts the other's spelling being present.
        dtype=dtype,
        torch_dtype=dtype,
        use_cache=True,
    )


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    cfg.validate()
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, 'a BERT model (model.family = "bert") exports as arch="bert"')
