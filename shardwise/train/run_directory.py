"""A run directory holds one run: starting over in one that has checkpoints is refused, or, with
`checkpoint.overwrite = true`, the old run is moved aside first; never deleted.

Training from step 0 (`checkpoint.resume = false`) beside an older run's checkpoints would leave
them in place: the next plain rerun would resume the old run's newest step, and metrics.jsonl
would mix the two. So `check_starting_over` refuses it in one line naming the choices (a new
`--run.dir`, or `--checkpoint.overwrite true`), before anything is written: in the launching process
under `--nproc` (train/preflight.py), on rank 0 of a one-process run (train/setup.py).

`move_previous_run_aside` moves everything the old run wrote (checkpoints, metrics.jsonl, config,
tokenizer, loggers' folders, collectives) into `RUN/previous/<time>/`, leaving only the lock and
earlier moved runs. It runs under the run lock (train/run_lock.py), after every other check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from shardwise.checkpoint.store import step_dirs
from shardwise.config.schema import Config
from shardwise.core.errors import invalid
from shardwise.train.run_lock import LOCK_FILE, RunLock

PREVIOUS_DIR = "previous"

RANK_FLAGS_AFTER_MOVING_ASIDE = ["--checkpoint.resume=true", "--checkpoint.overwrite=false"]
"""What the launcher adds to its ranks' flags once it has checked the run directory (and moved an
old run aside): the ranks then resume whatever this job saves, so a restart continues the new run
instead of starting over or moving its checkpoints aside."""


def check_starting_over(cfg: Config) -> None:
    """Refuse `checkpoint.resume = false` in a run directory with checkpoints unless `checkpoint.overwrite`."""
    if cfg.checkpoint.resume or cfg.checkpoint.overwrite:
        return
    found = step_dirs(Path(cfg.run.dir))
    if found:
        newest = found[-1][1]
        raise invalid("checkpoint.resume", False,
                      f"run.dir {cfg.run.dir} holds another run's checkpoints (newest {newest.name}); use a new "
                      f"--run.dir, or --checkpoint.overwrite true to move that run aside into "
                      f"{Path(cfg.run.dir) / PREVIOUS_DIR}/ (nothing is deleted)")


def take_run_dir(cfg: Config, lock: RunLock | None) -> None:
    """Make run.dir this run's, once every check passed: locked (`lock`: None where the launcher holds
    it), and with checkpoint.overwrite the previous run moved aside."""
    if lock is not None:
        lock.acquire()
    move_previous_run_aside(cfg)


def previous_run_entries(run_dir: Path) -> list[Path]:
    """What a run left in `run_dir`: everything but the lock and the runs moved aside before."""
    if not run_dir.is_dir():
        return []
    return sorted(path for path in run_dir.iterdir() if path.name not in (LOCK_FILE, PREVIOUS_DIR))


def move_previous_run_aside(cfg: Config) -> Path | None:
    """With `checkpoint.overwrite` (and so `checkpoint.resume = false`), move what an earlier run left
    into RUN/previous/<local time>/ and say so; the folder, or None when there was nothing."""
    run_dir = Path(cfg.run.dir)
    if not cfg.checkpoint.overwrite:
        return None
    entries = previous_run_entries(run_dir)
    if not entries:
        return None
    target = fresh_folder(run_dir / PREVIOUS_DIR, time.strftime("%Y%m%d-%H%M%S"))
    for entry in entries:  # same file system: each a rename, nothing copied
        os.replace(entry, target / entry.name)
    print(f"shardwise: checkpoint.overwrite: moved the previous run in {run_dir} ({len(entries)} entries) "
          f"to {target}", flush=True)
    return target


def fresh_folder(parent: Path, name: str) -> Path:
    """parent/name, or parent/name-2, -3, ... when a run was moved aside within the same second."""
    parent.mkdir(parents=True, exist_ok=True)
    candidate, number = parent / name, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            number += 1
            candidate = parent / f"{name}-{number}"
