"""Read and write HF `transformers` Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen2-MoE checkpoints
(config.json + safetensors).

Mixture-of-experts layers: expert tensors are stacked / split and routers renamed in `hf_moe`.

The architectures are the same math as ours: RoPE uses the same "rotate half" layout, so the
weights are pure renames (no q/k permutation), Qwen3's per-head `self_attn.q_norm` / `k_norm`
included; config.json maps field by field (`hf_config`), sliding windows too.

Written with `safetensors` and `json` only: `transformers` is a test dependency, not a runtime
one. Pickled `.bin` checkpoints are refused, since unpickling can execute code.
Sharded files follow the HF layout (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`)
so `from_pretrained` reads them; each file is written to a temp name and `os.replace`d, so a
crash never leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardwise.config.errors import invalid
from shardwise.config.model import ModelConfig
from shardwise.models.llama.hf_config import (  # config_to_hf is also part of this module's API
    config_from_hf,
    config_to_hf,
    refuse_parallel_block,
)
from shardwise.models.llama.hf_moe import stack_experts, unstack_experts
from shardwise.models.llama.model import Llama

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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
            f"{label} does not match the model config: missing keys {_few(missing)}, unexpected keys {_few(unexpected)}; "
            "check that config.json describes these weights (layers, tie_word_embeddings, biases)"
        )
    for name, tensor in sd.items():
        if tuple(tensor.shape) != expected[our_name_of[name]]:
            raise invalid(
                f"{label} {name} shape", tuple(tensor.shape),
                f"the model config expects {expected[our_name_of[name]]}: check config.json describes these weights",
            )


def _few(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit]) or "none"
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a shardwise model with this config, from a meta-device build (no memory)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


# -- files -----------------------------------------------------------------------------------


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and state dict (shardwise names, stored dtype) of a HF checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise invalid("HF checkpoint path", str(path), "point to a directory holding config.json and model.safetensors")
    cfg = config_from_hf(_read_json(directory / CONFIG_FILE))
    hf_sd = {}
    for file in _weight_files(directory):
        hf_sd.update(load_file(file))
    return cfg, state_dict_from_hf(hf_sd, cfg)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise invalid("HF checkpoint file", str(file), f"the directory needs a {file.name} (as save_pretrained writes)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise invalid("HF checkpoint file", str(file), f"it is not valid JSON ({error})") from None


def _weight_files(directory: Path) -> list[Path]:
    if (directory / INDEX_FILE).is_file():
        shards = sorted(set(_read_json(directory / INDEX_FILE).get("weight_map", {}).values()))
        for shard in shards:
            if not (directory / shard).is_file():
                raise invalid("HF checkpoint shard", str(directory / shard), f"it is listed in {INDEX_FILE} but missing")
        return [directory / shard for shard in shards]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    if any(directory.glob("*.bin")):
        raise invalid(
            "HF checkpoint weights", str(directory), "it holds only pickled .bin files and only safetensors is loaded "
            "(unpickling can run code): re-save with save_pretrained(..., safe_serialization=True)",
        )
    raise invalid("HF checkpoint weights", str(directory), f"the directory needs {SINGLE_FILE} or {INDEX_FILE}")


def save_hf_checkpoint(
    cfg: ModelConfig, state_dict: dict[str, torch.Tensor], path: str | os.PathLike, *,
    arch: str = "llama", max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json and model.safetensors (or shards + index) that `from_pretrained` loads.
    Everything is checked before the first byte is written; weight files of an earlier save
    in the same directory that this one does not overwrite are removed afterwards."""
    if max_shard_bytes < 1:
        raise invalid("max_shard_bytes", max_shard_bytes, "use a positive byte count")
    hf_config = config_to_hf(cfg, arch)  # checks the architecture can express the model, before any work
    hf_sd = state_dict_to_hf(state_dict, cfg, arch)
    hf_config = config_to_hf(cfg, arch, dtype=str(hf_sd["model.embed_tokens.weight"].dtype).removeprefix("torch."))
    hf_sd = _standalone_cpu_tensors(hf_sd)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    earlier_files = _existing_weight_files(directory)
    written = _write_weights(hf_sd, directory, max_shard_bytes)
    _write_atomically(directory / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(hf_config, indent=2) + "\n"))
    for stale in earlier_files - written:
        (directory / stale).unlink(missing_ok=True)


def _standalone_cpu_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, none sharing memory with another: safetensors refuses
    aliased tensors (tied weights, views of one buffer). Only aliases are copied."""
    seen_storages, result = set(), {}
    for name, tensor in sd.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storages:
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        result[name] = tensor
    return result


def _write_weights(hf_sd: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> set[str]:
    shards = _split_into_shards(hf_sd, max_shard_bytes)
    if len(shards) == 1:
        _write_safetensors(shards[0], directory / SINGLE_FILE)
        return {SINGLE_FILE}
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(shard, directory / file_name)
        weight_map |= dict.fromkeys(shard, file_name)
    total_size = sum(tensor.nbytes for tensor in hf_sd.values())
    index = dict(metadata=dict(total_size=total_size), weight_map=weight_map)
    _write_atomically(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
    return {INDEX_FILE, *weight_map.values()}


def _split_into_shards(hf_sd: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy, in key order; a tensor larger than the limit gets a shard of its own."""
    shards, current, current_bytes = [], {}, 0
    for name, tensor in hf_sd.items():
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += tensor.nbytes
    return shards + [current]


def _write_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    # transformers checks for the "pt" format tag when loading.
    _write_atomically(file, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))


def _write_atomically(file: Path, write: Callable[[Path], object]) -> None:
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def _existing_weight_files(directory: Path) -> set[str]:
    files = {name for name in (SINGLE_FILE, INDEX_FILE) if (directory / name).is_file()}
    if INDEX_FILE in files:
        try:
            files |= set(json.loads((directory / INDEX_FILE).read_text()).get("weight_map", {}).values())
        except (json.JSONDecodeError, AttributeError):
            pass  # an unreadable earlier index: leave its shards alone rather than guess
    return files


# -- models ----------------------------------------------------------------------------------


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
