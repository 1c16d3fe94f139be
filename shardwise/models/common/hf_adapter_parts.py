"""The parts of a family's HF adapter (`models/<family>/hf_adapter.py`) that do not depend on the
family: the tensor checks, the copy of same-layout modules, and the checkpoint/model skeleton
(`HFAdapter`: config.json + weights -> config + state dict -> model, and back) around a family's
own name and layout mapping (`state_dict_from_hf` / `state_dict_to_hf`) and config.json mapping
(`config_from_hf` / `config_to_hf`). The files themselves are `hf_files.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.core.errors import invalid
from shardwise.core.model import ModelConfig
from shardwise.models.common.hf_files import check_max_shard_bytes, dtype_name, few, read_hf_files, write_hf_files

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

StateDict = dict[str, torch.Tensor]


def copy_weights_and_biases(sd: StateDict, pairs: list[tuple[str, str]]) -> StateDict:
    """`{to.weight: sd[from.weight], to.bias: sd[from.bias]}` for each (from, to) module, where `sd` has them
    (tables have no bias)."""
    return {f"{target}.{kind}": sd[f"{source}.{kind}"]
            for source, target in pairs for kind in ("weight", "bias") if f"{source}.{kind}" in sd}


def meta_shapes(model_class: type[nn.Module], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a shardwise `model_class` of this config, from a meta-device build (no memory)."""
    with torch.device("meta"):
        model = model_class(cfg)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_tensors(sd: StateDict, expected: dict[str, tuple[int, ...]], label: str, keys: str, also: str = "") -> None:
    """Missing, unexpected and misshapen tensors are all reported before anything is loaded or written.
    `keys`: the family's config.json keys that decide which tensors there are, named in the message
    (then `also`, a further thing to check)."""
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{label} does not match the model config: missing keys {few(missing)}, unexpected keys "
            f"{few(unexpected)}; check that config.json describes these weights ({keys}){also}"
        )
    for name, tensor in sd.items():
        if tuple(tensor.shape) != expected[name]:
            raise invalid(f"{label} {name} shape", tuple(tensor.shape),
                          f"the model config expects {expected[name]}: check config.json describes these weights")


@dataclass(frozen=True)
class HFAdapter:
    """A family's four public adapter functions (`load_hf_checkpoint`, `save_hf_checkpoint`,
    `model_from_hf`, `model_to_hf`) from its model class, its default `arch`, its state-dict and
    config.json mappings, and `dtype_tensor`: the HF tensor whose dtype config.json records."""

    model_class: type[nn.Module]
    arch: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[..., dict]
    state_dict_from_hf: Callable[[StateDict, ModelConfig], StateDict]
    state_dict_to_hf: Callable[[StateDict, ModelConfig], StateDict]
    dtype_tensor: str

    def load_hf_checkpoint(self, path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
        """The config and state dict (shardwise names, stored dtype) of a HF checkpoint directory."""
        hf_config, hf_sd = read_hf_files(path)
        cfg = self.config_from_hf(hf_config)
        return cfg, self.state_dict_from_hf(hf_sd, cfg)

    def save_hf_checkpoint(self, cfg: ModelConfig, state_dict: StateDict, path: str | os.PathLike, *,
                           arch: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """Write config.json and model.safetensors (or shards + index) that `from_pretrained` loads.
        Everything is checked before the first byte is written; weight files of an earlier save in
        the same directory that this one does not overwrite are removed afterwards."""
        arch = self.arch if arch is None else arch
        check_max_shard_bytes(max_shard_bytes)
        self.config_to_hf(cfg, arch)  # checks the architecture can express the model, before any work
        hf_sd = self.state_dict_to_hf(state_dict, cfg)
        hf_config = self.config_to_hf(cfg, arch, dtype=dtype_name(hf_sd[self.dtype_tensor]))
        write_hf_files(hf_config, hf_sd, path, max_shard_bytes)

    def model_from_hf(self, path: str | os.PathLike, device: torch.device | str = "cpu") -> nn.Module:
        """A shardwise model holding a HF checkpoint's weights."""
        cfg, sd = self.load_hf_checkpoint(path)
        with torch.device("meta"):
            model = self.model_class(cfg)
        model.to_empty(device=device)  # no init_weights: the strict load overwrites every parameter
        model.load_state_dict(sd, strict=True)
        return model

    def model_to_hf(self, model: nn.Module, path: str | os.PathLike, *, arch: str | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """save_hf_checkpoint of a shardwise model's config and weights."""
        self.save_hf_checkpoint(model.cfg, model.state_dict(), path, arch=arch, max_shard_bytes=max_shard_bytes)
