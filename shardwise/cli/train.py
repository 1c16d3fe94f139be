"""`shardwise train`: validate the config, then train here or launch the ranks that will."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_train_parser(sub) -> None:
    from shardwise.cli.node_flags import add_node_arguments
    from shardwise.config.loader import add_config_arguments

    train = sub.add_parser("train", help="train a model (no arguments: the built-in demo on 2 CPU processes)",
                           description="Train a model. With no arguments, trains the built-in demo, "
                                       "data-parallel over 2 processes on CPU (one per accelerator otherwise).")
    train.add_argument("--nproc", default="auto", metavar="N",
                       help="training processes on this machine: auto (one per accelerator; 2 on CPU) or a count "
                            "(default: %(default)s); on several machines, per machine (--nnodes)")
    add_node_arguments(train)
    add_config_arguments(train)
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    from shardwise.cli.node_flags import check_layout_on_every_node_count, nodes_of
    from shardwise.config.loader import config_from_args
    from shardwise.runtime.launch import already_launched, config_argv, launch_local, resolve_nproc

    nproc = resolve_nproc(args.nproc)
    nodes = nodes_of(args)
    cfg = config_from_args(args)  # validated once, here, before any worker starts
    if not already_launched():
        check_layout_on_every_node_count(nodes, nproc, lambda world: check_layout(cfg, world))
    if nodes.multi_node and not already_launched():
        sys.exit(train_on_nodes(args, cfg, nodes, nproc))
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


def check_layout(cfg, world_size: int) -> None:
    """The layout (written or planned) against the world size, the model and the batch."""
    from shardwise.distributed.dims import ParallelDims
    from shardwise.runtime.process_group import resolve_device
    from shardwise.train.auto_layout import resolve_parallel

    planned = resolve_parallel(cfg, world_size, device_type=resolve_device(cfg.train.device).type, announce=False)
    ParallelDims.from_config(planned.parallel, world_size).check(planned)


def train_on_nodes(args: argparse.Namespace, cfg, nodes, nproc: int) -> int:
    """This node's part of a job on several (cli/node_flags.py): checks, handshake, then the launch."""
    from shardwise.cli.node_flags import announce, join_nodes, run_node
    from shardwise.runtime.launch import config_argv
    from shardwise.runtime.launch_nodes import launch_nodes
    from shardwise.train.preflight import check_before_launch
    from shardwise.train.run_directory import RANK_FLAGS_AFTER_MOVING_ASIDE, take_run_dir
    from shardwise.train.run_lock import RunLock

    data_digest = check_before_launch(cfg, run_dir_checks=nodes.is_head)  # the run directory is the head's
    config = cfg.to_dict()
    config["data"].pop("cache_dir", None)  # a node's own cache may live anywhere: the data's digest is compared
    store, presence = join_nodes(nodes, config, data_digest, nproc)
    announce(nodes, nproc)
    launch = dict(max_restarts=cfg.train.max_restarts, run_dir=Path(cfg.run.dir), stop_signals=cfg.train.preempt_signals,
                  stall_timeout_s=cfg.train.stall_timeout_s, rejoin_timeout_s=cfg.train.rejoin_timeout_s)
    argv = config_argv(args) + RANK_FLAGS_AFTER_MOVING_ASIDE
    try:
        if not nodes.is_head:
            return run_node(lambda: launch_nodes(store, nodes, nproc, argv, **launch))
        with RunLock(cfg.run.dir) as lock:  # held for the whole job, restarts included
            take_run_dir(cfg, lock)
            return launch_nodes(store, nodes, nproc, argv, **launch)
    finally:
        presence.stop()
