"""The files of a HF `transformers` checkpoint directory, whatever the family: config.json and
safetensors weights, one `model.safetensors` or shards + `model.safetensors.index.json`.

Written with `safetensors` and `json` only: `transformers` is a test dependency, not a runtime
one. Pickled `.bin` checkpoints are refused, since unpickling can execute code.
Sharded files follow the HF layout (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`)
so `from_pretrained` reads them; each file is written to a temp name and `os.replace`d, so a
crash never leaves a half-written file under the final name. A family's adapter (names, shapes,
its config.json fields) sits on top: `models/<family>/hf_adapter.py`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardwise.core.errors import invalid

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_files(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """The parsed config.json and every weight (HF names, stored dtype) of a HF checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise invalid("HF checkpoint path", str(path), "point to a directory holding config.json and model.safetensors")
    hf_config = read_json(directory / CONFIG_FILE)
    hf_sd = {}
    for file in weight_files(directory):
        hf_sd.update(load_file(file))
    return hf_config, hf_sd


def check_max_shard_bytes(max_shard_bytes: int) -> None:
    """Called by a save before any work, so a bad limit is reported first."""
    if max_shard_bytes < 1:
        raise invalid("max_shard_bytes", max_shard_bytes, "use a positive byte count")


def dtype_name(tensor: torch.Tensor) -> str:
    """A tensor's dtype as config.json spells it: `float32`, `bfloat16`, ..."""
    return str(tensor.dtype).removeprefix("torch.")


def write_hf_files(
    hf_config: dict, hf_sd: dict[str, torch.Tensor], path: str | os.PathLike, max_shard_bytes: int,
) -> None:
    """Write config.json and model.safetensors (or shards + index) that `from_pretrained` loads; weight
    files of an earlier save in the same directory that this one does not overwrite are removed afterwards."""
    hf_sd = standalone_cpu_tensors(hf_sd)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    earlier_files = existing_weight_files(directory)
    written = write_weights(hf_sd, directory, max_shard_bytes)
    write_atomically(directory / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(hf_config, indent=2) + "\n"))
    for stale in earlier_files - written:
        (directory / stale).unlink(missing_ok=True)


def few(names: list[str], limit: int = 4) -> str:
    """At most `limit` names for an error message, and how many there are in all."""
    shown = ", ".join(names[:limit]) or "none"
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def read_json(file: Path) -> dict:
    if not file.is_file():
        raise invalid("HF checkpoint file", str(file), f"the directory needs a {file.name} (as save_pretrained writes)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise invalid("HF checkpoint file", str(file), f"it is not valid JSON ({error})") from None


def weight_files(directory: Path) -> list[Path]:
    if (directory / INDEX_FILE).is_file():
        shards = sorted(set(read_json(directory / INDEX_FILE).get("weight_map", {}).values()))
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


def standalone_cpu_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def write_weights(hf_sd: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> set[str]:
    shards = split_into_shards(hf_sd, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(shards[0], directory / SINGLE_FILE)
        return {SINGLE_FILE}
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, directory / file_name)
        weight_map |= dict.fromkeys(shard, file_name)
    total_size = sum(tensor.nbytes for tensor in hf_sd.values())
    index = dict(metadata=dict(total_size=total_size), weight_map=weight_map)
    write_atomically(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
    return {INDEX_FILE, *weight_map.values()}


def split_into_shards(hf_sd: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy, in key order; a tensor larger than the limit gets a shard of its own."""
    shards, current, current_bytes = [], {}, 0
    for name, tensor in hf_sd.items():
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += tensor.nbytes
    return shards + [current]


def write_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    # transformers checks for the "pt" format tag when loading.
    write_atomically(file, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))


def write_atomically(file: Path, write: Callable[[Path], object]) -> None:
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def existing_weight_files(directory: Path) -> set[str]:
    files = {name for name in (SINGLE_FILE, INDEX_FILE) if (directory / name).is_file()}
    if INDEX_FILE in files:
        try:
            files |= set(json.loads((directory / INDEX_FILE).read_text()).get("weight_map", {}).values())
        except (json.JSONDecodeError, AttributeError):
            pass  # an unreadable earlier index: leave its shards alone rather than guess
    return files
