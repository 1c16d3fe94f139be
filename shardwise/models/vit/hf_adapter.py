"""Read and write HF `transformers` ViT checkpoints (`ViTForImageClassification`: config.json +
safetensors).

Every tensor keeps its layout (the patch projection is a Conv2d on both sides, q/k/v are separate
linears on both sides): the conversion is a renaming, `vit.encoder.layer.<i>.attention.attention.query`
-> `layers.<i>.attn.q_proj` and so on (`hf_names`). Names are written as `save_pretrained` writes them
(transformers 4.x's, which 5.x still saves and renames on load); on import, 5.x's in-memory names
(`vit.layers.<i>.attention.q_proj`, `mlp.fc1`, ...) are read too, for checkpoints saved from a 5.x
state dict directly. The files themselves (safetensors only, shards + index, atomic writes) are read
and written by `shardwise/models/common/hf_files.py`, shared with the other families.
"""

from __future__ import annotations

import re

import torch

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_adapter_parts import HFAdapter, check_tensors, meta_shapes
from shardwise.models.vit.hf_config import config_from_hf, config_to_hf
from shardwise.models.vit.model import ViT

PREFIX = "vit."
CLASSIFIER = "classifier"
PARAMETERS = {"embeddings.cls_token": "embed.cls_token", "embeddings.position_embeddings": "embed.positions"}
"""HF parameters held by no submodule (under `vit.`) -> ours."""
TOP_MODULES = {"embeddings.patch_embeddings.projection": "embed.projection", "layernorm": "norm"}
"""HF modules under `vit.` -> ours (each with a weight and a bias)."""
LAYER_MODULES = {
    "layernorm_before": "attn_norm",
    "attention.attention.query": "attn.q_proj",
    "attention.attention.key": "attn.k_proj",
    "attention.attention.value": "attn.v_proj",
    "attention.output.dense": "attn.o_proj",
    "layernorm_after": "mlp_norm",
    "intermediate.dense": "mlp.up_proj",
    "output.dense": "mlp.down_proj",
}
"""HF modules under `vit.encoder.layer.<i>.` -> ours under `layers.<i>.`."""
TRANSFORMERS5_NAMES = (
    (r"^vit\.layers\.(\d+)\.", r"vit.encoder.layer.\1."),
    (r"\.attention\.q_proj\.", ".attention.attention.query."),
    (r"\.attention\.k_proj\.", ".attention.attention.key."),
    (r"\.attention\.v_proj\.", ".attention.attention.value."),
    (r"\.attention\.o_proj\.", ".attention.output.dense."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
)
"""transformers 5.x's in-memory names -> the saved ones (its conversion_mapping, reversed)."""
CONFIG_KEYS = "num_hidden_layers, id2label"
"""The config.json keys that decide which tensors a checkpoint holds: named when they do not match."""


# -- state dicts ------------------------------------------------------------------------------


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> ours, for every tensor of a ViTForImageClassification of this config."""
    modules = [(PREFIX + hf, ours) for hf, ours in TOP_MODULES.items()] + [(CLASSIFIER, CLASSIFIER)]
    for i in range(cfg.n_layers):
        modules += [(f"{PREFIX}encoder.layer.{i}.{hf}", f"layers.{i}.{ours}") for hf, ours in LAYER_MODULES.items()]
    names = {PREFIX + hf: ours for hf, ours in PARAMETERS.items()}
    return names | {f"{hf}.{kind}": f"{ours}.{kind}" for hf, ours in modules for kind in ("weight", "bias")}


def saved_names(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors under the names `save_pretrained` writes for a ViTForImageClassification: a ViTModel's
    (no `vit.` prefix) get it; 5.x's in-memory names are renamed. A ViTModel's pooler (dense + tanh
    over the class token) is dropped: ViTForImageClassification has none and classifies the
    normalised class token itself, so the pooler never reaches the logits."""
    renamed = {}
    for name, tensor in hf_sd.items():
        if not name.startswith((PREFIX, CLASSIFIER + ".")):
            name = PREFIX + name
        if name.startswith(PREFIX + "pooler."):
            continue
        for pattern, replacement in TRANSFORMERS5_NAMES:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor
    return renamed


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (a ViTForImageClassification's, or a ViTModel's plus a classifier) -> shardwise's."""
    sd = saved_names(hf_sd)
    if f"{CLASSIFIER}.weight" not in sd:
        raise invalid("HF checkpoint classifier.weight", None,
                      "the checkpoint has no classification head (a ViTModel's): load it in transformers with "
                      "ViTForImageClassification.from_pretrained(path, num_labels=N), which adds one, and "
                      "save_pretrained that")
    names = hf_names(cfg)
    check_tensors(sd, hf_shapes(cfg, names), "HF checkpoint", CONFIG_KEYS)
    return {ours: sd[hf] for hf, ours in names.items()}


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """shardwise tensors -> HF's, named as `save_pretrained` writes them."""
    check_tensors(sd, our_shapes(cfg), "shardwise state dict", CONFIG_KEYS)
    return {hf: sd[ours] for hf, ours in hf_names(cfg).items()}


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a shardwise ViT of this config."""
    return meta_shapes(ViT, cfg)


def hf_shapes(cfg: ModelConfig, names: dict[str, str] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF ViTForImageClassification of this config: ours, renamed (no layout differs)."""
    ours = our_shapes(cfg)
    return {hf: ours[name] for hf, name in (names or hf_names(cfg)).items()}


# -- files and models -------------------------------------------------------------------------

ADAPTER = HFAdapter(ViT, "vit", config_from_hf, config_to_hf, state_dict_from_hf, state_dict_to_hf,
                    dtype_tensor=f"{CLASSIFIER}.weight")
load_hf_checkpoint, save_hf_checkpoint = ADAPTER.load_hf_checkpoint, ADAPTER.save_hf_checkpoint
model_from_hf, model_to_hf = ADAPTER.model_from_hf, ADAPTER.model_to_hf
