"""Metric loggers beside metrics.jsonl: TensorBoard event files and Weights & Biases runs.

    loggers = open_loggers(cfg.run.loggers, run_dir, run_name=..., project=..., config=..., resume_step=...)
    for logger in loggers:
        logger.log(record)          # the metrics.jsonl record of one step; record["step"] is the step
    for logger in loggers:
        logger.close()

Each logger receives the very record metrics.jsonl gets and flattens it (`flatten_metrics`), so
every numeric metric reaches every logger under one tag: nested dicts join with "/"
("comm/all_reduce/bytes"), lists take their index ("moe_tokens_per_expert/1/0": layer 1, expert 0).

Resuming from a checkpoint at step S re-runs steps S+1...: metrics.jsonl drops its lines after
S, TensorBoard purges its events after S (`purge_step`), and W&B continues the run whose id is
kept in RUN/wandb_id.txt. W&B keeps what an online run already logged: a resumed run's steps up to
the last one the server has are ignored (with a warning), so steps between the checkpoint and a
crash keep their first values there (rewinding a run, wandb's `resume_from`, needs the server's
support and is not used).

W&B's mode is the user's WANDB_MODE: "offline" keeps the run in RUN/wandb/offline-run-*, and
`wandb sync RUN/wandb/offline-run-*` uploads it later (a resumed run adds one such folder per
start; sync them in order).

tensorboard and wandb are optional dependencies (pip extras shardwise[tensorboard], shardwise[wandb]):
they are imported only when their logger is opened.
"""

from __future__ import annotations

import importlib
import numbers
import secrets
from pathlib import Path
from typing import Protocol

from shardwise.core.errors import invalid
from shardwise.config.schema import LOGGERS

WANDB_ID_FILE = "wandb_id.txt"


class MetricLogger(Protocol):
    def log(self, record: dict) -> None:
        """Record one step's metrics; record["step"] is the step."""

    def close(self) -> None:
        """Write out everything logged and release the files or the run."""


def flatten_metrics(record: dict) -> dict[str, float]:
    """Every numeric leaf of `record` under a "/"-joined tag, as float; "step" (the x axis, not a
    metric), bools, None and strings are left out."""
    flat: dict[str, float] = {}

    def visit(tag: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{tag}/{key}" if tag else str(key), item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(f"{tag}/{index}", item)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            flat[tag] = float(value)

    visit("", {key: value for key, value in record.items() if key != "step"})
    return flat


def import_logger_package(name: str, names: list[str] | None = None):
    """The package logger `name` needs, or a one-line error naming its pip extra."""
    package = LOGGERS[name]
    try:
        return importlib.import_module(package)
    except ImportError as error:
        field = f"run.loggers = {names!r}" if names is not None else "run.loggers"
        raise ModuleNotFoundError(f"{field} names {name}, which needs the {package} package: "
                                  f"pip install 'shardwise[{name}]'", name=package) from error


class TensorBoardLogger:
    """Scalars in RUN/tensorboard, one tag per metric; `tensorboard --logdir RUN/tensorboard` shows them."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        import_logger_package("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the events of earlier files at this step and after, so the
        # steps re-run after a checkpoint replace the ones logged before it instead of doubling
        # them; on a fresh run (resume_step 0) it clears a previous run's events from the folder.
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def log(self, record: dict) -> None:
        for tag, value in flatten_metrics(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def wandb_run_id(run_dir: Path, resume_step: int) -> str:
    """The W&B run id of this run directory: a new one for a fresh run, the stored one on resume
    (so the resumed run continues the same W&B run)."""
    path = run_dir / WANDB_ID_FILE
    if resume_step > 0 and path.exists() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)  # lowercase letters and digits, as W&B ids are
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


class WandbLogger:
    """A Weights & Biases run, its files in RUN/wandb; the mode comes from WANDB_MODE."""

    def __init__(self, run_dir: str | Path, *, project: str, name: str, config: dict, resume_step: int = 0):
        wandb = import_logger_package("wandb")
        run_dir = Path(run_dir)
        self.run = wandb.init(
            project=project, name=name, dir=str(run_dir), config=config,
            id=wandb_run_id(run_dir, resume_step), resume="allow",
            # quiet: keeps where the run is saved and how to sync it, drops the closing history summary
            settings=wandb.Settings(quiet=True),
        )

    def log(self, record: dict) -> None:
        self.run.log(flatten_metrics(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_loggers(names: list[str], run_dir: str | Path, *, run_name: str, project: str, config: dict,
                 resume_step: int) -> list[MetricLogger]:
    """The loggers of run.loggers besides "jsonl" (metrics.jsonl, which the trainer writes itself).
    Every package is checked before any logger opens, so a missing one starts no W&B run."""
    for name in names:
        if name not in LOGGERS:
            raise invalid("run.loggers", names, f"use a list of {', '.join(LOGGERS)}")
        if LOGGERS[name]:
            import_logger_package(name, names)
    loggers: list[MetricLogger] = []
    try:
        if "tensorboard" in names:
            loggers.append(TensorBoardLogger(run_dir, resume_step))
        if "wandb" in names:
            loggers.append(WandbLogger(run_dir, project=project, name=run_name, config=config,
                                       resume_step=resume_step))
    except BaseException:
        for logger in loggers:  # a W&B start that fails must not leave the event file open
            logger.close()
        raise
    return loggers
