"""What `generate` and `serve` share: the flags of the run they open, and `--nproc N`, which starts
N ranks running the same command, tensor-parallel over all of them."""

from __future__ import annotations

import argparse
import sys

from shardwise.cli.flag_types import positive_int
from shardwise.cli.node_flags import add_node_arguments, announce, join_nodes, nodes_of, run_node


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Which checkpoint, which device, how many processes."""
    parser.add_argument("--checkpoint", help="a checkpoint directory of the run (default: the newest)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ... (default: %(default)s)")
    parser.add_argument("--nproc", default="1", metavar="N", help="processes to split the model over (default: 1)")
    parser.add_argument("--parallel.tp", dest="tp", type=positive_int, default=1,
                        help="tensor-parallel degree; must equal --nproc times --nnodes (default: 1)")
    add_node_arguments(parser)


def add_prefix_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-cache-mb", type=int, metavar="MB",
                        help="MiB per process for keys and values of prompt prefixes that later requests reuse "
                             "(0 = off; default: 256 for decoders, off for encoder-decoders)")


def check_prefix_cache_mb(args: argparse.Namespace) -> None:
    """The sign only, before any rank starts; the size against one block of the model is checked
    where the run's config is read (`infer.load.open_engine`)."""
    if args.prefix_cache_mb is not None and args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb = {args.prefix_cache_mb} is invalid: use 0 (off) or a positive size "
                         "in MiB")


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """Weight-only quantization at load (`generation/quantize.py`)."""
    parser.add_argument("--quantize", metavar="SCHEME",
                        help="quantize the linears' weights at load: int8 (per channel) or int4 (grouped); "
                             "a run written by `shardwise quantize` is quantized already")
    parser.add_argument("--group-size", type=int, metavar="G",
                        help="int4: input columns sharing a scale, 32, 64, 128 or 256 (default: 128, or the "
                             "largest that divides every linear's input width)")


def check_at_least_one(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    for flag in flags:
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} = {getattr(args, flag)} is invalid: use 1 or more")


def launched_again(args: argparse.Namespace, flags: tuple[str, ...]) -> bool:
    """`generate`/`serve --nproc N` (N > 1): start N ranks running this command, tensor-parallel over all
    of them; False when this process is to do the work itself (one process, or a rank already)."""
    from shardwise.runtime.launch import already_launched, launch_local, resolve_nproc

    nproc = resolve_nproc(args.nproc)
    if already_launched():  # a rank: its launcher checked the flags
        return False
    nodes = nodes_of(args)
    if nodes.min_nodes != nodes.max_nodes:
        raise ValueError(f"--nnodes = {args.nnodes} is invalid for {args.command}: the model is split over every "
                         "rank, so the node count is fixed; give one count N")
    world = nproc * nodes.max_nodes
    if args.tp != world:
        over = f"{world} processes (--nproc {nproc} x --nnodes {nodes.max_nodes}); use the same number" \
            if nodes.multi_node else f"--nproc {nproc} processes; use the same number for both"
        raise ValueError(f"--parallel.tp = {args.tp} is invalid: {args.command} splits the model over all {over}")
    if world == 1:
        return False
    argv = [*rank_argv(args, flags), f"--nproc={nproc}", f"--parallel.tp={args.tp}"]
    if not nodes.multi_node:
        sys.exit(launch_local(nproc, argv, module="shardwise.infer"))
    from shardwise.runtime.launch_nodes import launch_nodes

    store, presence = join_nodes(nodes, {"argv": argv}, "", nproc)
    announce(nodes, nproc)
    try:
        sys.exit(run_node(lambda: launch_nodes(store, nodes, nproc, argv, module="shardwise.infer")))
    finally:
        presence.stop()


def rank_argv(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """The command line that gives a rank the same `flags` (those given, and defaults: flags left unset
    are None or False, so mutually exclusive ones are never passed together)."""
    argv = [args.command]
    for flag in flags:
        value = getattr(args, flag)
        if value is True:
            argv.append(f"--{flag.replace('_', '-')}")
        elif value is not None and value is not False:
            argv.append(f"--{flag.replace('_', '-')}={value}")
    return argv
