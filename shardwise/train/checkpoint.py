"""Checkpoints of one process: safetensors for tensors, JSON for everything else.

Nothing is unpickled on load, so a checkpoint from elsewhere cannot execute code. A checkpoint
is a directory `checkpoints/step_00000100/` written under a temporary name and renamed into
place, so a crash mid-save leaves the previous checkpoints intact and no half-written one
that resume would pick up. (The multi-process, reshardable format comes with the distributed
runtime and `torch.distributed.checkpoint`.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CHECKPOINT_DIR = "checkpoints"
STEP_PREFIX = "step_"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories start with a dot)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state keyed by parameter name (`<param>::exp_avg`), not by position."""
    tensors = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            tensors[f"{name}::{key}"] = value.detach().contiguous()
    return tensors


def load_optimizer_tensors(model, optimizer, tensors: dict[str, torch.Tensor]) -> None:
    by_name = dict(model.named_parameters())
    for key, value in tensors.items():
        name, state_key = key.split("::", 1)
        if name not in by_name:
            raise ValueError(f"checkpoint optimizer state names parameter {name!r} that the model does not have; "
                             "resume with the model config the checkpoint was saved with")
        param = by_name[name]
        # Adam keeps `step` on the CPU unless capturable/fused; the moments live with the parameter.
        target = value if state_key == "step" else value.to(param.device)
        optimizer.state[param][state_key] = target


def save_checkpoint(run_dir: Path, step: int, *, model, optimizer, state: dict, keep: int) -> Path:
    """Write checkpoint `step` atomically, then drop all but the newest `keep`."""
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{STEP_PREFIX}{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
        save_file(optimizer_tensors(model, optimizer), tmp / "optimizer.safetensors")
        save_file({"cpu": torch.get_rng_state()}, tmp / "rng.safetensors")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_model_weights(checkpoint: Path, model, device="cpu") -> None:
    path = Path(checkpoint) / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no model.safetensors; pass a complete checkpoint directory")
    weights = load_file(path, device=str(device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(checkpoint)!r} does not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); use the model config it was saved with")


def load_checkpoint(checkpoint: Path, *, model, optimizer, device) -> dict:
    """Restore model, optimizer and RNG in place; returns the JSON state (step, loader, ...)."""
    load_model_weights(checkpoint, model, device)
    load_optimizer_tensors(model, optimizer, load_file(Path(checkpoint) / "optimizer.safetensors"))
    torch.set_rng_state(load_file(Path(checkpoint) / "rng.safetensors")["cpu"])
    return json.loads((Path(checkpoint) / "state.json").read_text())
