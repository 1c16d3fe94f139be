"""Where a run directory keeps its checkpoints: the names the checkpoint store writes
(shardwise/checkpoint/store.py) and the config layer reads before torch is imported (`train.init_from`
names a run, config/init_source.py). Pure pathlib: one layout, written once."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = "checkpoints"
STEP_PREFIX = "step_"
STATE_FILE = "state.json"
METADATA_FILE = ".metadata"  # DCP's name (filesystem._metadata_fn)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint directory, whole or not, oldest first (directories
    being written start with a dot and are not among them)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [(int(p.name[len(STEP_PREFIX):]), p) for p in root.iterdir()
             if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found)


def finished_step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the checkpoints whose save finished (state and DCP metadata written; the
    manifest is checked when loading), oldest first."""
    return [(step, p) for step, p in step_dirs(run_dir)
            if (p / STATE_FILE).is_file() and (p / METADATA_FILE).is_file()]
