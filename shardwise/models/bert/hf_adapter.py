"""Read and write HF `transformers` BERT checkpoints (`BertForMaskedLM`: config.json + safetensors).

Every tensor is a rename (`bert.embeddings.word_embeddings` -> `embed_tokens`,
`bert.encoder.layer.<i>.attention.self.query` -> `layers.<i>.attn.q_proj`, ...): HF's BERT uses
nn.Linear throughout, in our layout. What needs care is the output head, whose spelling differs
between versions:

  output bias     `cls.predictions.bias`, and `cls.predictions.decoder.bias` besides. 4.x makes the
                  two one tensor always; 5.x ties them only with tied embeddings, and an untied
                  5.x model computes with `decoder.bias` alone. So: tied, `predictions.bias` is the
                  bias (`decoder.bias`, where present, its copy); untied, `decoder.bias` is (or
                  `predictions.bias` where a 4.x save kept only that name)
  output weight   `cls.predictions.decoder.weight`: the token table when tied (dropped on import,
                  not written on export, as HF does), the head's own weight when untied

Export writes what both versions load to the same logits: tied, `predictions.bias` only (as 5.x
saves); untied, both bias names with the same values. Import also reads older spellings:
LayerNorm `gamma` / `beta`, no `bert.` prefix (a BertModel save), the position / token-type index
buffers old versions saved, and a BertForPreTraining save's pooler and next-sentence head, which
the masked LM does not compute (HF drops them too when it loads such a checkpoint as
BertForMaskedLM). The files themselves are read and written by `models/common/hf_files.py`.
"""

from __future__ import annotations

import torch

from shardwise.core.model import ModelConfig
from shardwise.models.bert.hf_config import config_from_hf, config_to_hf
from shardwise.models.bert.model import Bert
from shardwise.models.common.hf_adapter_parts import HFAdapter, check_tensors, copy_weights_and_biases, meta_shapes

PREFIX = "bert."
HEAD = "cls.predictions."
OUTPUT_BIAS, DECODER_WEIGHT, DECODER_BIAS = HEAD + "bias", HEAD + "decoder.weight", HEAD + "decoder.bias"
NOT_WEIGHTS = ("embeddings.position_ids", "embeddings.token_type_ids")
"""Index buffers older transformers saved: not weights."""
NOT_MASKED_LM = ("bert.pooler.", "cls.seq_relationship.")
"""The pooler and next-sentence head of BertModel / BertForPreTraining saves: the masked LM has neither."""
LEGACY_NORM_NAMES = {".LayerNorm.gamma": ".LayerNorm.weight", ".LayerNorm.beta": ".LayerNorm.bias"}
"""The LayerNorm names of checkpoints converted from the original TensorFlow BERT."""
TOP_MODULES = {
    "bert.embeddings.word_embeddings": "embed_tokens",
    "bert.embeddings.position_embeddings": "embed_positions",
    "bert.embeddings.token_type_embeddings": "embed_types",
    "bert.embeddings.LayerNorm": "embed_norm",
    "cls.predictions.transform.dense": "head_transform.dense",
    "cls.predictions.transform.LayerNorm": "head_transform.norm",
}
LAYER_MODULES = {
    "attention.self.query": "attn.q_proj",
    "attention.self.key": "attn.k_proj",
    "attention.self.value": "attn.v_proj",
    "attention.output.dense": "attn.o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "mlp.up_proj",
    "output.dense": "mlp.down_proj",
    "output.LayerNorm": "mlp_norm",
}
"""HF module under `bert.encoder.layer.<i>.` -> ours under `layers.<i>.`."""
CONFIG_KEYS = "num_hidden_layers, tie_word_embeddings"
"""The config.json keys that decide which tensors a checkpoint holds: named when they do not match."""
MASKED_LM_ONLY = " and that they are a BertForMaskedLM's"


# -- state dicts ------------------------------------------------------------------------------


def module_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF module, ours) of every module whose weight (and bias) copy as they are."""
    pairs = list(TOP_MODULES.items())
    for i in range(cfg.n_layers):
        pairs += [(f"{PREFIX}encoder.layer.{i}.{hf}", f"layers.{i}.{ours}") for hf, ours in LAYER_MODULES.items()]
    return pairs


def normalised_hf_names(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors under today's names: `bert.`-prefixed, LayerNorm weight/bias for gamma/beta,
    without old index buffers, pooler and next-sentence head."""
    sd = {}
    for name, tensor in hf_sd.items():
        if not name.startswith((PREFIX, "cls.")):
            name = PREFIX + name
        if name.endswith(NOT_WEIGHTS) or name.startswith(NOT_MASKED_LM):
            continue
        for legacy, today in LEGACY_NORM_NAMES.items():
            if name.endswith(legacy):
                name = name.removesuffix(legacy) + today
        sd[name] = tensor
    return sd


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (any spelling the module docstring lists) -> shardwise's."""
    sd = normalised_hf_names(hf_sd)
    bias_names = (OUTPUT_BIAS, DECODER_BIAS) if cfg.tie_embeddings else (DECODER_BIAS, OUTPUT_BIAS)
    output_bias = next((sd[name] for name in bias_names if name in sd), None)
    sd.pop(DECODER_BIAS, None)
    if output_bias is not None:
        sd[OUTPUT_BIAS] = output_bias
    if cfg.tie_embeddings:
        sd.pop(DECODER_WEIGHT, None)  # the token table, which HF ties to it on load
    check_tensors(sd, hf_shapes(cfg), "HF checkpoint", CONFIG_KEYS, MASKED_LM_ONLY)
    ours = copy_weights_and_biases(sd, module_pairs(cfg))
    ours["lm_bias.bias"] = sd[OUTPUT_BIAS]
    if not cfg.tie_embeddings:
        ours["lm_head.weight"] = sd[DECODER_WEIGHT]
    return ours


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """shardwise tensors -> HF's (tied: no decoder tensors, as HF saves; untied: both bias names)."""
    check_tensors(sd, meta_shapes(Bert, cfg), "shardwise state dict", CONFIG_KEYS, MASKED_LM_ONLY)
    hf = copy_weights_and_biases(sd, [(ours, theirs) for theirs, ours in module_pairs(cfg)])
    hf[OUTPUT_BIAS] = sd["lm_bias.bias"]
    if not cfg.tie_embeddings:
        hf[DECODER_WEIGHT] = sd["lm_head.weight"]
        hf[DECODER_BIAS] = sd["lm_bias.bias"]  # the same tensor: write_hf_files copies aliases
    return hf


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a normalised HF BertForMaskedLM checkpoint of this config (one output bias;
    the decoder weight only when untied)."""
    d, f, v = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    tables = {"word_embeddings": v, "position_embeddings": cfg.max_seq_len,
              "token_type_embeddings": cfg.type_vocab_size}
    shapes = {f"{PREFIX}embeddings.{table}.weight": (rows, d) for table, rows in tables.items()}
    linears = {"cls.predictions.transform.dense": (d, d)}
    for i in range(cfg.n_layers):
        layer = f"{PREFIX}encoder.layer.{i}."
        linears |= {f"{layer}attention.self.{proj}": (d, d) for proj in ("query", "key", "value")}
        linears |= {f"{layer}attention.output.dense": (d, d), f"{layer}intermediate.dense": (f, d),
                    f"{layer}output.dense": (d, f)}
    for module, (out_features, in_features) in linears.items():
        shapes |= {f"{module}.weight": (out_features, in_features), f"{module}.bias": (out_features,)}
    norms = [f"{PREFIX}embeddings.LayerNorm", "cls.predictions.transform.LayerNorm"]
    norms += [f"{PREFIX}encoder.layer.{i}.{norm}.LayerNorm" for i in range(cfg.n_layers)
              for norm in ("attention.output", "output")]
    shapes |= {f"{norm}.{kind}": (d,) for norm in norms for kind in ("weight", "bias")}
    shapes[OUTPUT_BIAS] = (v,)
    if not cfg.tie_embeddings:
        shapes[DECODER_WEIGHT] = (v, d)
    return shapes


# -- files and models -------------------------------------------------------------------------

ADAPTER = HFAdapter(Bert, "bert", config_from_hf, config_to_hf, state_dict_from_hf, state_dict_to_hf,
                    dtype_tensor=f"{PREFIX}embeddings.word_embeddings.weight")
load_hf_checkpoint, save_hf_checkpoint = ADAPTER.load_hf_checkpoint, ADAPTER.save_hf_checkpoint
model_from_hf, model_to_hf = ADAPTER.model_from_hf, ADAPTER.model_to_hf
