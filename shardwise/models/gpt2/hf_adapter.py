"""Read and write HF `transformers` GPT-2 checkpoints (`GPT2LMHeadModel`: config.json + safetensors).

HF's GPT-2 stores its linear layers as `Conv1D`, whose weight is [in, out], the transpose of
`nn.Linear`'s, and packs q, k and v into one `c_attn` ([dim, 3 * dim], q then k then v, each
all heads in order): import transposes and splits it into our q/k/v_proj, export concatenates
and transposes back. Otherwise the weights are renames (`wte` -> `embed_tokens`, `h.<i>.ln_1` ->
`layers.<i>.attn_norm`, ...). The files themselves (safetensors only, shards + index, atomic writes)
are read and written by `shardwise/models/common/hf_files.py`, shared with the other families.
"""

from __future__ import annotations

import torch

from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_adapter_parts import HFAdapter, check_tensors, copy_weights_and_biases, meta_shapes
from shardwise.models.gpt2.hf_config import config_from_hf, config_to_hf
from shardwise.models.gpt2.model import GPT2

PREFIX = "transformer."
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
"""The causal-mask buffers older transformers saved with every layer: not weights."""
RENAMED = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "norm"}
"""HF top-level module -> ours (the blocks' modules under `h.<i>.` are the maps below)."""
LAYER_NORMS = {"ln_1": "attn_norm", "ln_2": "mlp_norm"}
CONV1D = {"attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
"""HF Conv1D layers (weight [in, out]) -> our nn.Linear layers (weight [out, in]), besides c_attn."""
CONFIG_KEYS = "n_layer, tie_word_embeddings"
"""The config.json keys that decide which tensors a checkpoint holds: named when they do not match."""


# -- state dicts ------------------------------------------------------------------------------


def same_layout_modules(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF module, ours) of the modules whose tensors copy as they are: the two tables, the LayerNorms."""
    pairs = [(PREFIX + hf, ours) for hf, ours in RENAMED.items()]
    for i in range(cfg.n_layers):
        pairs += [(f"{PREFIX}h.{i}.{hf}", f"layers.{i}.{ours}") for hf, ours in LAYER_NORMS.items()]
    return pairs


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (with or without the `transformer.` prefix: a GPT2Model's checkpoint has none)
    -> shardwise's. A tied model drops HF's lm_head; old causal-mask buffers are dropped."""
    sd = {name if name.startswith(PREFIX) or name == "lm_head.weight" else PREFIX + name: tensor
          for name, tensor in hf_sd.items() if not name.endswith(MASK_BUFFERS)}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    check_tensors(sd, hf_shapes(cfg), "HF checkpoint", CONFIG_KEYS)
    ours = copy_weights_and_biases(sd, same_layout_modules(cfg))
    if not cfg.tie_embeddings:
        ours["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        hf, layer = f"{PREFIX}h.{i}.", f"layers.{i}."
        q_w, k_w, v_w = sd[f"{hf}attn.c_attn.weight"].t().chunk(3, dim=0)
        q_b, k_b, v_b = sd[f"{hf}attn.c_attn.bias"].chunk(3, dim=0)
        for proj, weight, bias in (("q_proj", q_w, q_b), ("k_proj", k_w, k_b), ("v_proj", v_w, v_b)):
            ours[f"{layer}attn.{proj}.weight"], ours[f"{layer}attn.{proj}.bias"] = weight.contiguous(), bias.contiguous()
        for hf_conv, linear in CONV1D.items():
            ours[f"{layer}{linear}.weight"] = sd[f"{hf}{hf_conv}.weight"].t().contiguous()
            ours[f"{layer}{linear}.bias"] = sd[f"{hf}{hf_conv}.bias"]
    return ours


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """shardwise tensors -> HF's (`transformer.`-prefixed; a tied model writes no lm_head, as HF does)."""
    check_tensors(sd, meta_shapes(GPT2, cfg), "shardwise state dict", CONFIG_KEYS)
    hf = copy_weights_and_biases(sd, [(ours, theirs) for theirs, ours in same_layout_modules(cfg)])
    for i in range(cfg.n_layers):
        prefix, layer = f"{PREFIX}h.{i}.", f"layers.{i}."
        projections = [f"{layer}attn.{proj}" for proj in ("q_proj", "k_proj", "v_proj")]
        hf[f"{prefix}attn.c_attn.weight"] = torch.cat([sd[f"{p}.weight"] for p in projections]).t().contiguous()
        hf[f"{prefix}attn.c_attn.bias"] = torch.cat([sd[f"{p}.bias"] for p in projections])
        for hf_conv, linear in CONV1D.items():
            hf[f"{prefix}{hf_conv}.weight"] = sd[f"{layer}{linear}.weight"].t().contiguous()
            hf[f"{prefix}{hf_conv}.bias"] = sd[f"{layer}{linear}.bias"]
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = sd["lm_head.weight"]
    return hf


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF GPT2LMHeadModel checkpoint of this config (lm_head only when untied)."""
    d, f = cfg.dim, cfg.ffn_dim
    shapes = {f"{PREFIX}wte.weight": (cfg.vocab_size, d), f"{PREFIX}wpe.weight": (cfg.max_seq_len, d),
              f"{PREFIX}ln_f.weight": (d,), f"{PREFIX}ln_f.bias": (d,)}
    for i in range(cfg.n_layers):
        layer = {"ln_1.weight": (d,), "ln_1.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
                 "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
                 "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
                 "mlp.c_fc.weight": (d, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, d), "mlp.c_proj.bias": (d,)}
        shapes |= {f"{PREFIX}h.{i}.{name}": shape for name, shape in layer.items()}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


# -- files and models -------------------------------------------------------------------------

ADAPTER = HFAdapter(GPT2, "gpt2", config_from_hf, config_to_hf, state_dict_from_hf, state_dict_to_hf,
                    dtype_tensor=f"{PREFIX}wte.weight")
load_hf_checkpoint, save_hf_checkpoint = ADAPTER.load_hf_checkpoint, ADAPTER.save_hf_checkpoint
model_from_hf, model_to_hf = ADAPTER.model_from_hf, ADAPTER.model_to_hf
