"""What the ranks would find wrong, found by `shardwise train --nproc N` before any rank starts.

A rank that raises a bad-input error leaves the others blocked in a collective; stopping them
costs a round trip through the launcher, and on a cluster a queue slot. So everything that can
be checked from the config and the files alone is checked here, in the launching process, with
the same one-line errors the ranks would raise: the data (readable, non-empty, well-formed: the
token cache is built here, and the ranks then find it), the tokenizer, the vocabulary against
model.vocab_size, and the newest checkpoint's model shape against model.*.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

from shardwise.compile.float8 import check_float8_device
from shardwise.core.errors import invalid
from shardwise.config.schema import Config
from shardwise.data.loader import TokenLoader
from shardwise.data.training_data import build_run_loaders, prepare_data
from shardwise.distributed.lora_layout import build_adapted_on_meta
from shardwise.models.common.lora import trained_state
from shardwise.checkpoint.store import STATE_FILE, checkpoint_dirs, checkpoint_tensor_shapes
from shardwise.checkpoint.integrity import MANIFEST_FILE
from shardwise.runtime.process_group import resolve_device
from shardwise.train.metrics import read_metrics_log
from shardwise.train.run_directory import check_starting_over


def check_before_launch(cfg: Config, *, run_dir_checks: bool = True) -> str:
    """Every check the ranks would make; the prepared data's digest (for the nodes' handshake).
    `run_dir_checks`: also the run directory's (a job's other nodes leave them to the head)."""
    check_float8_device(cfg.train.float8, resolve_device(cfg.train.device))
    if run_dir_checks:
        check_run_dir(cfg)
        check_starting_over(cfg)
    dataset = prepare_data(cfg)
    check_data_fits_model(cfg, dataset)
    if cfg.checkpoint.resume:
        check_checkpoint_fits_model(cfg)
    train_loader, _ = build_run_loaders(cfg, dataset)  # also checks the validation split's size
    if cfg.checkpoint.resume:
        check_checkpoint_fits_data(cfg, train_loader)
    return data_digest(dataset)


def data_digest(dataset) -> str:
    """What identifies the prepared data: its token cache's meta.json (sha256 of the tokens and the
    tokenizer, counts, sources), or for images their pixels and labels."""
    meta = getattr(getattr(dataset, "tokens", None), "meta", None)
    hasher = hashlib.sha256()
    if meta is not None:
        hasher.update(json.dumps(meta, sort_keys=True, default=str).encode())
    else:
        hasher.update(dataset.images.tobytes())
        hasher.update(dataset.labels.tobytes())
    return hasher.hexdigest()[:16]


def check_run_dir(cfg: Config) -> None:
    """run.dir can be written, and what a resume reads of it can be read, before any work: a rank
    meeting a read-only directory at its first save would leave its peers blocked, and a damaged
    metrics.jsonl is found here rather than after config.json and run.json were rewritten."""
    run_dir = Path(cfg.run.dir)
    existing = next(path for path in (run_dir, *run_dir.parents) if path.exists())
    if not existing.is_dir():
        raise invalid("run.dir", str(run_dir), f"{existing} is a file, not a directory; choose another run.dir")
    # Rewritten in place (metrics.jsonl) or by entries made in them (the directories).
    rewritten = [path for path in (existing, run_dir / "checkpoints", run_dir / "metrics.jsonl") if path.exists()]
    for path in rewritten:
        if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else os.R_OK)):
            raise invalid("run.dir", str(run_dir), f"{path} is not writable by this user; make it writable "
                                                   f"(chmod u+rwX {path}) or choose another run.dir")
    metrics = run_dir / "metrics.jsonl"
    if cfg.checkpoint.resume and metrics.is_file() and newest_complete_checkpoint(cfg) is not None:
        read_metrics_log(metrics, warn=False)  # the resume warns of a torn last line when it drops it


def check_data_fits_model(cfg: Config, dataset) -> None:
    """The tokenizer's vocabulary fits the model's (images are checked by their loader)."""
    if not hasattr(dataset, "tokens"):
        return
    tokens_meta = dataset.tokens.meta
    if tokens_meta["vocab_size"] > cfg.model.vocab_size:
        raise invalid(
            "model.vocab_size", cfg.model.vocab_size,
            f"the tokenizer has {tokens_meta['vocab_size']} tokens; use model.vocab_size >= {tokens_meta['vocab_size']}",
        )


def newest_complete_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint a resume would start from (unless its files fail their hashes; the ranks check those)."""
    complete = [path for path in checkpoint_dirs(Path(cfg.run.dir)) if (path / MANIFEST_FILE).is_file()]
    return complete[-1] if complete else None


def check_checkpoint_fits_data(cfg: Config, loader: TokenLoader) -> None:
    """The newest checkpoint's data position fits this data, sequence length, batch and seed (the
    loader's own check, on a copy: the resume itself restores the position)."""
    found = newest_complete_checkpoint(cfg)
    try:
        state = json.loads((found / STATE_FILE).read_text()).get("loader") if found else None
    except (OSError, ValueError):
        return  # unreadable: the ranks fall back to an older checkpoint and say so
    if state:
        copy.copy(loader).load_state_dict(state)


def check_checkpoint_fits_model(cfg: Config) -> None:
    """The newest complete checkpoint of run.dir holds the model the config builds (shapes of every weight)."""
    found = newest_complete_checkpoint(cfg)
    if found is None:
        return
    try:
        saved = checkpoint_tensor_shapes(found)
    except ValueError:
        return  # unreadable: the ranks fall back to an older checkpoint and say so
    # A LoRA run's checkpoints hold its adapters, not the frozen base.
    built = {f"model/{name}": tuple(tensor.shape) for name, tensor in trained_state(build_adapted_on_meta(cfg)).items()}
    mismatched = sorted(key for key in built if key in saved and saved[key] != built[key])
    missing = sorted(key for key in built if key not in saved)
    if not mismatched and not missing:
        return
    example = (f"{mismatched[0]} is {saved[mismatched[0]]} there, {built[mismatched[0]]} in this config"
               if mismatched else f"it has no {missing[0]}")
    field, value, was = changed_model_field(cfg, Path(cfg.run.dir))
    where = f"run.dir {cfg.run.dir} holds checkpoint {found.name}"
    if field is None:
        raise ValueError(f"model = the configured model is invalid here: {where} of another shape ({example}); "
                         "use the model settings it was saved with, or a new run.dir")
    raise ValueError(f"model.{field} = {value!r} is invalid: {where} of a model with model.{field} = {was!r} "
                     f"({example}); use the saved value, a new run.dir, or checkpoint.resume = false to start over")


def changed_model_field(cfg: Config, run_dir: Path) -> tuple[str | None, object, object]:
    """The first model.* field that differs from the run's saved config.json: (name, now, saved)."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())["model"]
    except (OSError, ValueError, KeyError):
        return None, None, None
    now = cfg.to_dict()["model"]
    for name, value in now.items():
        if name in saved and saved[name] != value:
            return name, value, saved[name]
    return None, None, None
