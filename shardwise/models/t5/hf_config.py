"""config.json of HF `transformers` T5 (`T5ForConditionalGeneration`) <-> shardwise's T5 fields.

`config_from_hf` returns a dict of ModelConfig field values (family "t5"), not a ModelConfig: an
import adds IMPORT_DEFAULTS to them (`hf_adapter.config_of`, train.init_from). `config_to_hf` takes
such a dict, or any object with those attributes.

What needs care:
  tied head       T5 v1.0 ties the output head to the token table AND scales the decoder output
                  by dim**-0.5 before it; v1.1 does neither. 4.x spells both with
                  `tie_word_embeddings`; 5.x forces `tie_word_embeddings` to true and keeps the
                  scaling apart as `scale_decoder_outputs` (it unties the head only when a
                  checkpoint holds an `lm_head.weight` that differs from the table). So
                  `scale_decoder_outputs` decides where present, else `tie_word_embeddings`
                  (default true); export writes both, which 4.x and 5.x read alike
  MLP             `feed_forward_proj`: "relu" (v1.0) or "gated-gelu" (v1.1: GELU's tanh
                  approximation on wi_0 times wi_1); anything else is refused
  init            `initializer_factor` is HF T5's init multiplier; it is stored as `init_std`,
                  which the T5 model reads as that factor (see models/t5/model.py)
  tokens          the decoder starts from token 0 and ignored targets become 0 in its inputs
                  (T5's pad): a config naming another start or pad token is refused
A key config.json leaves out (or sets null) takes T5Config's default; `num_decoder_layers`
defaults to `num_layers`, as HF's does.
"""

from __future__ import annotations

from types import SimpleNamespace

from shardwise.core.errors import invalid
from shardwise.models.common.hf_config_parts import Fields, check_model_type, config_json, fields_from_hf, fields_to_hf

ARCHITECTURES = {"t5": "T5ForConditionalGeneration"}
DEFAULTS = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
                initializer_factor=1.0, feed_forward_proj="relu", tie_word_embeddings=True)
"""transformers' T5Config defaults."""
MLP_KINDS = {"relu": False, "gated-gelu": True}
"""feed_forward_proj -> gated_mlp: the two MLPs shardwise's T5 computes."""
FIELDS: Fields = dict(
    dim=("d_model", int), head_dim=("d_kv", int), ffn_dim=("d_ff", int), n_layers=("num_layers", int),
    n_heads=("num_heads", int), relative_buckets=("relative_attention_num_buckets", int),
    relative_max_distance=("relative_attention_max_distance", int), norm_eps=("layer_norm_epsilon", float),
    vocab_size=("vocab_size", int), init_std=("initializer_factor", float),
)
"""The fields that are one config.json key each (n_decoder_layers, gated_mlp and tie_embeddings
are read apart: each has a rule of its own)."""
IMPORT_DEFAULTS = dict(preset="t5-small", max_seq_len=512)
"""What a T5 read from config.json takes beside `config_from_hf`'s values (`convert --from-hf`, train.init_from):
T5 has no absolute positions, and max_seq_len (what inputs are checked against) is t5-small's 512."""
T5_TOKEN = 0
"""The decoder start and pad token shardwise's T5 uses (models/t5/model.py DECODER_START_ID)."""


def config_from_hf(hf: dict) -> dict:
    """The ModelConfig field values of a HF T5 config.json dict (refusing what shardwise's T5 does
    not compute)."""
    check_model_type(hf, "t5")
    proj = hf.get("feed_forward_proj") or DEFAULTS["feed_forward_proj"]
    if proj not in MLP_KINDS:
        raise invalid("config.json feed_forward_proj", proj,
                      "shardwise's T5 computes relu (T5 v1.0) or gated-gelu (v1.1, Flan-T5): only those convert")
    if hf.get("is_encoder_decoder") is False:
        raise invalid("config.json is_encoder_decoder", False,
                      "shardwise's T5 is T5ForConditionalGeneration, an encoder-decoder: only true converts")
    for key in ("decoder_start_token_id", "pad_token_id"):
        if hf.get(key) not in (None, T5_TOKEN):
            raise invalid(f"config.json {key}", hf[key], f"shardwise's T5 starts and pads the decoder with token "
                                                          f"{T5_TOKEN}: only {T5_TOKEN} converts")
    fields = fields_from_hf(hf, FIELDS, DEFAULTS)
    decoder_layers = hf.get("num_decoder_layers")
    scaled = hf.get("scale_decoder_outputs")
    if scaled is None:
        scaled = hf.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"]) is not False
    return dict(family="t5", n_kv_heads=fields["n_heads"], **fields,
                n_decoder_layers=fields["n_layers"] if decoder_layers is None else int(decoder_layers),
                gated_mlp=MLP_KINDS[proj], tie_embeddings=bool(scaled))


def config_to_hf(cfg, arch: str = "t5", *, dtype: str = "float32") -> dict:
    """A config.json dict that `transformers` (4.x and 5.x) loads as T5ForConditionalGeneration.
    `cfg`: a dict of field values (as `config_from_hf` returns) or an object with those fields."""
    if arch not in ARCHITECTURES:
        raise invalid("arch", arch, 'a T5 model (model.family = "t5") exports as arch="t5"')
    cfg = SimpleNamespace(**cfg) if isinstance(cfg, dict) else cfg
    tied = bool(cfg.tie_embeddings)
    keys = fields_to_hf(cfg, FIELDS) | dict(
        num_decoder_layers=cfg.n_decoder_layers,
        feed_forward_proj="gated-gelu" if cfg.gated_mlp else "relu",
        tie_word_embeddings=tied,  # 4.x: ties the head and scales; 5.x reads the next key for the scaling
        scale_decoder_outputs=tied,
        # shardwise trains without dropout: the exported model fine-tunes as it was trained.
        dropout_rate=0.0,
        is_encoder_decoder=True,
        decoder_start_token_id=T5_TOKEN, pad_token_id=T5_TOKEN, eos_token_id=1,
    )
    return config_json(arch, ARCHITECTURES, keys, dtype, use_cache=True)
