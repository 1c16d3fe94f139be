"""Read and write HF `transformers` T5 checkpoints (`T5ForConditionalGeneration`: config.json +
safetensors).

Every tensor is a rename; HF's T5 uses bias-free nn.Linear throughout, in our layout:

  shared.weight                                          embed_tokens.weight
  {encoder,decoder}.block.0.layer.0.SelfAttention.
      relative_attention_bias.weight                     {encoder,decoder}_rel_bias.weight
  encoder.block.<i>.layer.0.SelfAttention.{q,k,v,o}      encoder_layers.<i>.attn.{q,k,v,o}_proj
  encoder.block.<i>.layer.0.layer_norm                   encoder_layers.<i>.attn_norm
  encoder.block.<i>.layer.1.DenseReluDense.wi            encoder_layers.<i>.mlp.up_proj (v1.0)
      ... .wi_0 / .wi_1 / .wo                            mlp.gate_proj / mlp.up_proj / mlp.down_proj
  encoder.block.<i>.layer.1.layer_norm                   encoder_layers.<i>.mlp_norm
  decoder.block.<i>.layer.0 / layer.1 (EncDecAttention) / layer.2: self-attention, cross-attention
      (cross_attn, cross_norm), MLP of decoder_layers.<i>
  {encoder,decoder}.final_layer_norm                     {encoder,decoder}_norm
  lm_head.weight                                         lm_head.weight (untied only)

Import drops what HF itself ignores or ties on load: the per-stack copies of the token table
(`encoder.embed_tokens.weight`, `decoder.embed_tokens.weight`, which older saves hold), the unused
`decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight` some checkpoints carry,
and, tied, `lm_head.weight`. Untied (v1.1) without `lm_head.weight`: transformers 5.x saves a
model built from an untied config that way, because it ties the head to the table whatever the
config says (only the dim**-0.5 scaling follows it); the head is then the table's values.
"""

from __future__ import annotations

import torch

from shardwise.models.common.hf_adapter_parts import HFAdapter, check_tensors, copy_weights_and_biases, meta_shapes
from shardwise.models.t5.hf_config import IMPORT_DEFAULTS, config_from_hf, config_to_hf
from shardwise.core.model import ModelConfig
from shardwise.models.t5.model import T5, t5_fields
from shardwise.models.families import validate_model

HEAD = "lm_head.weight"
TABLE = "shared.weight"
IGNORED_BY_HF = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                 "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")
"""Tensors a T5 checkpoint may hold that HF does not load as weights of their own."""
ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
CONFIG_KEYS = "num_layers, num_decoder_layers, feed_forward_proj, tie_word_embeddings / scale_decoder_outputs"
"""The config.json keys that decide which tensors a checkpoint holds: named when they do not match."""


def config_of(hf: dict) -> ModelConfig:
    """The ModelConfig of a config.json, validated, with IMPORT_DEFAULTS."""
    cfg = ModelConfig(**IMPORT_DEFAULTS, **config_from_hf(hf))
    validate_model(cfg)
    return cfg


def mlp_pairs(gated: bool) -> dict[str, str]:
    if gated:
        return {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
    return {"wi": "up_proj", "wo": "down_proj"}


def module_pairs(cfg) -> list[tuple[str, str]]:
    """(HF module, ours) of every module whose weight copies as it is."""
    f = t5_fields(cfg)
    pairs = [("shared", "embed_tokens"), ("encoder.final_layer_norm", "encoder_norm"),
             ("decoder.final_layer_norm", "decoder_norm")]
    for stack in ("encoder", "decoder"):
        pairs.append((f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias", f"{stack}_rel_bias"))
        sublayers = [("SelfAttention", "attn", "attn_norm")]
        if stack == "decoder":
            sublayers.append(("EncDecAttention", "cross_attn", "cross_norm"))
        for i in range(f.n_encoder_layers if stack == "encoder" else f.n_decoder_layers):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}_layers.{i}."
            for index, (hf_attn, attn, norm) in enumerate(sublayers):
                pairs += [(f"{hf}{index}.{hf_attn}.{p}", f"{ours}{attn}.{q}") for p, q in ATTENTION.items()]
                pairs.append((f"{hf}{index}.layer_norm", f"{ours}{norm}"))
            mlp = len(sublayers)
            pairs += [(f"{hf}{mlp}.DenseReluDense.{p}", f"{ours}mlp.{q}") for p, q in mlp_pairs(f.gated_mlp).items()]
            pairs.append((f"{hf}{mlp}.layer_norm", f"{ours}mlp_norm"))
    if not f.tie_embeddings:
        pairs.append(("lm_head", "lm_head"))
    return pairs


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF T5ForConditionalGeneration checkpoint of this config, as import
    normalises it: ours, renamed."""
    ours = meta_shapes(T5, cfg)
    return {f"{hf}.weight": ours[f"{mine}.weight"] for hf, mine in module_pairs(cfg)}


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF tensors -> shardwise's (see the module docstring for what is dropped or filled in)."""
    sd = {name: tensor for name, tensor in hf_sd.items() if name not in IGNORED_BY_HF}
    if t5_fields(cfg).tie_embeddings:
        sd.pop(HEAD, None)  # the token table, which HF ties to it
    elif HEAD not in sd and TABLE in sd:
        sd[HEAD] = sd[TABLE]  # a 5.x save of a head tied despite an untied config
    check_tensors(sd, hf_shapes(cfg), "HF checkpoint", CONFIG_KEYS)
    return copy_weights_and_biases(sd, module_pairs(cfg))


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """shardwise tensors -> HF's (tied: no lm_head.weight, as HF saves)."""
    check_tensors(sd, meta_shapes(T5, cfg), "shardwise state dict", CONFIG_KEYS)
    return copy_weights_and_biases(sd, [(ours, theirs) for theirs, ours in module_pairs(cfg)])


# -- files and models -------------------------------------------------------------------------

ADAPTER = HFAdapter(T5, "t5", config_of, config_to_hf, state_dict_from_hf, state_dict_to_hf, dtype_tensor=TABLE)
load_hf_checkpoint, save_hf_checkpoint = ADAPTER.load_hf_checkpoint, ADAPTER.save_hf_checkpoint
model_from_hf, model_to_hf = ADAPTER.model_from_hf, ADAPTER.model_to_hf
