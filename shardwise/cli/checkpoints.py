"""`shardwise checkpoints`: a run's checkpoints, each checked against its manifest."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_checkpoints_parser(sub) -> None:
    ckpts = sub.add_parser("checkpoints", help="a run's checkpoints with their step and status (ok/corrupt/incomplete)",
                           description="List RUN_DIR's checkpoints, oldest first, each checked against its "
                                       "manifest (every file's size and SHA-256): ok, incomplete (save not "
                                       "finished, or a file missing) or corrupt; and the one a resume would load.")
    ckpts.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `shardwise train`")
    ckpts.set_defaults(func=cmd_checkpoints)


def cmd_checkpoints(args: argparse.Namespace) -> None:
    from shardwise.checkpoint.store import step_dirs
    from shardwise.checkpoint.integrity import checkpoints_table

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR = {run_dir} is not a directory: give the run.dir of a `shardwise train` run")
    print(checkpoints_table(run_dir, step_dirs(run_dir)))
