"""Read and write HF `transformers` Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen2-MoE checkpoints
(config.json + safetensors).

Mixture-of-experts layers: expert tensors are stacked / split and routers renamed in `hf_moe`.

The architectures are the same math as ours: RoPE uses the same "rotate half" layout, so the
weights are pure renames (no q/k permutation), Qwen3's per-head `self_attn.q_norm` / `k_norm`
included; config.json maps field by field (`hf_config`), sliding windows too.

The files themselves (safetensors only, shards + index, atomic writes) are read and written by
`shardwise/models/common/hf_files.py`, shared with the other families.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_files import check_max_shard_bytes, dtype_name, few, read_hf_files, write_hf_files
from shardwise.models.llama.hf_config import (  # config_to_hf is also part of this module's API
    config_from_hf,
    config_to_hf,
    refuse_parallel_block,
)
from shardwise.models.llama.hf_moe import stack_experts, unstack_experts
from shardwise.models.llama.model import Llama

# -- state dict renames ----------------------------------------------------------------------

_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# (HF, shardwise) prefixes inside one layer; "mlp_norm." does not start with "mlp.", so order is free.
_LAYER_PARTS = (
    ("self_attn.", "attn."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "mlp_norm."),
    ("mlp.", "mlp."),
)
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def hf_name_to_ours(name: str) -> str | None:
    """`model.layers.3.self_attn.q_proj.weight` -> `layers.3.attn.q_proj.weight`; None if unknown."""
    return _rename(name, _TOP_LEVEL, _HF_LAYER, "layers.", _LAYER_PARTS)


def our_name_to_hf(name: str) -> str | None:
    """`layers.3.attn.q_proj.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    top_level = {ours: hf for hf, ours in _TOP_LEVEL.items()}
    parts = tuple((ours, hf) for hf, ours in _LAYER_PARTS)
    return _rename(name, top_level, _OUR_LAYER, "model.layers.", parts)


def _rename(name, top_level: dict, layer_pattern: re.Pattern, layer_prefix: str, parts) -> str | None:
    if name in top_level:
        return top_level[name]
    match = layer_pattern.fullmatch(name)
    if match is None:
        return None
    layer, rest = match.groups()
    for source, target in parts:
        if rest.startswith(source):
            return f"{layer_prefix}{layer}.{target}{rest[len(source):]}"
    return None


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> shardwise names. A tied model drops HF's lm_head (HF ties it to the embedding);
    rotary `inv_freq` buffers are dropped (shardwise computes RoPE from the config)."""
    kept = {
        name: tensor for name, tensor in stack_experts(hf_sd, cfg).items()
        if not name.endswith("rotary_emb.inv_freq") and not (cfg.tie_embeddings and name == "lm_head.weight")
    }
    our_name_of = {name: hf_name_to_ours(name) for name in kept}
    _check_against_model(kept, our_name_of, cfg, "HF checkpoint", show_missing_as=our_name_to_hf)
    return {our_name_of[name]: tensor for name, tensor in kept.items()}


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, arch: str = "") -> dict[str, torch.Tensor]:
    """shardwise names -> HF names (a tied model writes no lm_head, as HF does); a MoE model's
    experts one tensor each, as `arch` (default: qwen2_moe with shared experts, else mixtral) names them."""
    refuse_parallel_block(cfg)
    _check_against_model(sd, {name: name for name in sd}, cfg, "shardwise state dict", show_missing_as=str)
    renamed = {our_name_to_hf(name): tensor for name, tensor in sd.items()}
    return unstack_experts(renamed, cfg, arch or ("qwen2_moe" if cfg.n_shared_experts else "mixtral"))


def _check_against_model(sd: dict, our_name_of: dict, cfg: ModelConfig, label: str, show_missing_as: Callable) -> None:
    """Compare with the model's own parameters, so missing, unknown and misshapen tensors are
    all reported before anything is loaded or written. Names are shown as `sd` spells them."""
    expected = expected_shapes(cfg)
    unexpected = sorted(name for name, our_name in our_name_of.items() if our_name not in expected)
    missing = sorted(show_missing_as(name) for name in set(expected) - set(our_name_of.values()))
    if missing or unexpected:
        raise ValueError(
            f"{label} does not match the model config: missing keys {few(missing)}, unexpected keys {few(unexpected)}; "
            "check that config.json describes these weights (layers, tie_word_embeddings, biases)"
        )
    for name, tensor in sd.items():
        if tuple(tensor.shape) != expected[our_name_of[name]]:
            raise invalid(
                f"{label} {name} shape", tuple(tensor.shape),
                f"the model config expects {expected[our_name_of[name]]}: check config.json describes these weights",
            )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a shardwise model with this config, from a meta-device build (no memory)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


# -- files and models ------------------------------------------------------------------------


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and state dict (shardwise names, stored dtype) of a HF checkpoint directory."""
    hf_config, hf_sd = read_hf_files(path)
    cfg = config_from_hf(hf_config)
    return cfg, state_dict_from_hf(hf_sd, cfg)


def save_hf_checkpoint(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], path: str | os.PathLike, *,
    arch: str = "llama", max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json and model.safetensors (or shards + index) that `from_pretrained` loads.
    Everything is checked before the first byte is written; weight files of an earlier save
    in the same directory that this one does not overwrite are removed afterwards."""
    check_max_shard_bytes(max_shard_bytes)
    config_to_hf(cfg, arch)  # checks the architecture can express the model, before any work
    hf_sd = state_dict_to_hf(state_dict, cfg, arch)
    hf_config = config_to_hf(cfg, arch, dtype=dtype_name(hf_sd["model.embed_tokens.weight"]))
    write_hf_files(hf_config, hf_sd, path, max_shard_bytes)


def model_from_hf(path: str | os.PathLike, device: torch.device | str = "cpu") -> Llama:
    """A shardwise Llama holding a HF checkpoint's weights (fp32 parameters, as build_model makes)."""
    cfg, sd = load_hf_checkpoint(path)
    with torch.device("meta"):
        model = Llama(cfg)
    # No init_weights: the strict load below overwrites every parameter.
    model.to_empty(device=device)
    model.load_state_dict(sd, strict=True)
    return model


def model_to_hf(
    model: Llama, path: str | os.PathLike, *, arch: str = "llama", max_shard_bytes: int = 5 * 2**30,
) -> None:
    """save_hf_checkpoint of a shardwise model's config and weights."""
    save_hf_checkpoint(model.cfg, model.state_dict(), path, arch=arch, max_shard_bytes=max_shard_bytes)
