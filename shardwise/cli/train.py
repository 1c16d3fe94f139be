"""`shardwise train`: validate the config, then train here or launch the ranks that will."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_train_parser(sub) -> None:
    from shardwise.config.loader import add_config_arguments

    train = sub.add_parser("train", help="train a model (no arguments: the built-in demo on 2 CPU processes)",
                           description="Train a model. With no arguments, trains the built-in demo, "
                                       "data-parallel over 2 processes on CPU (one per accelerator otherwise).")
    train.add_argument("--nproc", default="auto", metavar="N",
                       help="training processes on this machine: auto (one per accelerator; 2 on CPU) or a count "
                            "(default: %(default)s). Many machines: torchrun ... -m shardwise.train, see examples/README.md")
    add_config_arguments(train)
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    from shardwise.config.loader import config_from_args
    from shardwise.runtime.launch import already_launched, config_argv, launch_local, resolve_nproc

    nproc = resolve_nproc(args.nproc)
    cfg = config_from_args(args)  # validated once, here, before any worker starts
    if not already_launched():
        from shardwise.distributed.dims import ParallelDims
        from shardwise.train.auto_layout import resolve_parallel
        from shardwise.runtime.process_group import resolve_device

        planned = resolve_parallel(cfg, nproc, device_type=resolve_device(cfg.train.device).type, announce=False)
        ParallelDims.from_config(planned.parallel, nproc).check(planned)  # the layout against model and batch
    if nproc > 1 and not already_launched():
        from shardwise.train.preflight import check_before_launch
        from shardwise.train.run_directory import RANK_FLAGS_AFTER_MOVING_ASIDE, take_run_dir
        from shardwise.train.run_lock import RunLock

        check_before_launch(cfg)  # data, tokenizer, checkpoint shape: here, not as N ranks' errors
        with RunLock(cfg.run.dir) as lock:  # held for the whole job, restarts included; the ranks take none
            take_run_dir(cfg, lock)
            code = launch_local(nproc, config_argv(args) + RANK_FLAGS_AFTER_MOVING_ASIDE,
                                max_restarts=cfg.train.max_restarts, run_dir=Path(cfg.run.dir),
                                stop_signals=cfg.train.preempt_signals, stall_timeout_s=cfg.train.stall_timeout_s)
        sys.exit(code)
    from shardwise.train.trainer import train

    result = train(cfg)
    losses = result.losses
    if losses and os.environ.get("RANK", "0") == "0":
        validation = f", val_loss {result.val_losses[max(result.val_losses)]:.4f}" if result.val_losses else ""
        print(f"trained steps {result.first_step}..{result.first_step + len(losses) - 1}: "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}{validation} in {result.wall_time_s:.1f}s; "
              f"run dir {result.run_dir}")
