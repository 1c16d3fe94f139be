"""The `shardwise` command: train, generate, serve, report, checkpoints, convert, export, rules, estimate, plan, calibrate.

Each subcommand builds its own parser and runs in its own module of this package (`train.py`,
`generate.py`, ..., `plan_commands.py` for the planner's three); this one only puts the parsers
together and dispatches. Each subcommand validates everything it was given before doing any work;
a bad value ends with one line on stderr (`shardwise: error: ...`) and exit status 2 (set
SHARDWISE_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from shardwise.cli.checkpoints import add_checkpoints_parser
from shardwise.cli.convert import add_convert_parser
from shardwise.cli.export import add_export_parser
from shardwise.cli.flag_types import SUBJECT_FIRST
from shardwise.cli.generate import add_generate_parser
from shardwise.cli.predict import add_predict_parser
from shardwise.cli.quantize import add_quantize_parser
from shardwise.cli.report import add_report_parser
from shardwise.cli.rules import add_rules_parser
from shardwise.cli.serve import add_serve_parser
from shardwise.cli.train import add_train_parser
from shardwise.core import exit_status

PLANNER_COMMANDS = ("estimate", "plan", "calibrate")
"""Subcommands that run without torch: their parser is built without the config (which imports it)."""

TORCH_COMMANDS = (add_train_parser, add_predict_parser, add_generate_parser, add_serve_parser, add_report_parser,
                  add_checkpoints_parser, add_convert_parser, add_export_parser, add_rules_parser,
                  add_quantize_parser)
"""The parser builders of the other subcommands, in the order `shardwise --help` lists them (the
planner's follow). Their modules import torch only when a parser or a command runs."""


def add_planner_commands(sub) -> None:
    from shardwise.cli.plan_commands import add_calibrate_parser, add_estimate_parser, add_plan_parser

    add_estimate_parser(sub)
    add_plan_parser(sub)
    add_calibrate_parser(sub)


class OneLineErrors(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a value of the wrong type) in the one-line form of all others."""

    def error(self, message: str):
        # "argument --devices: = 0 is invalid: ..." (a cli/flag_types parser) -> "--devices = 0 is invalid: ..."
        message = re.sub(rf"^argument ([^:]+): (?={SUBJECT_FIRST})", r"\1 ", message)
        self.exit(exit_status.BAD_INPUT, f"shardwise: error: {message} (see: {self.prog} --help)\n")


def build_planner_parser() -> argparse.ArgumentParser:
    """Only the planner's subcommands: `shardwise estimate --jsonl` starts without importing torch."""
    parser = OneLineErrors(prog="shardwise", description=__doc__.splitlines()[0])
    add_planner_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in TORCH_COMMANDS:
        add_parser(sub)
    add_planner_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_planner_parser() if words[:1] and words[0] in PLANNER_COMMANDS else build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        if os.environ.get("SHARDWISE_DEBUG"):
            raise
        report(f"shardwise: error: {err}")
        raise SystemExit(exit_status.BAD_INPUT) from None
    except PermissionError as err:  # a path this user may not read or write, met past the checks: name it
        if os.environ.get("SHARDWISE_DEBUG"):
            raise
        report(f"shardwise: error: {permission_denied(err)}")
        raise SystemExit(exit_status.BAD_INPUT) from None
    except FloatingPointError as err:  # the trainer's NonfiniteLoss: the run diverged, not bad input
        if os.environ.get("SHARDWISE_DEBUG"):
            raise
        report(f"shardwise: error: {err}", rank_zero_only=True)
        return exit_status.NONFINITE
    except Exception as err:
        preemption = sys.modules.get("shardwise.runtime.preemption")  # loaded by training only (it imports torch)
        if preemption is None:
            raise
        if isinstance(err, preemption.Preempted):  # raised by every rank alike, after the save (or Ctrl-C's)
            report(f"shardwise: {err}", rank_zero_only=True)
            return err.exit_status
        if preemption.stopped_by_launcher(err):  # a peer died and the launcher is stopping us: it reports
            preemption.exit_quietly(err.signal_name)
        raise
    except KeyboardInterrupt:  # Ctrl-C where no handler of ours took it (a run saves and stops: Preempted)
        if os.environ.get("SHARDWISE_DEBUG"):
            raise
        report("shardwise: stopped by Ctrl-C (SIGINT)")
        return exit_status.INTERRUPTED
    return 0


def permission_denied(err: PermissionError) -> str:
    if err.filename is None:
        return f"{err}; run as a user allowed to, or choose other paths"
    return (f"{err.filename} is not accessible to this user ({err.strerror}); give it read and write permission "
            "(chmod, chown), or choose another path")


def report(line: str, *, rank_zero_only: bool = False) -> None:
    """Print a one-line outcome on stderr; a rank started by `shardwise train --nproc` hands it to the
    launcher instead, which prints the first failed rank's line once."""
    rank = os.environ.get("RANK", "0")
    if "WORLD_SIZE" in os.environ:  # a rank: torch is loaded already
        from shardwise.runtime.launch import MESSAGE_DIR_ENV

        if os.environ.get(MESSAGE_DIR_ENV):
            (Path(os.environ[MESSAGE_DIR_ENV]) / f"rank{rank}.txt").write_text(line)
            return
    if rank == "0" or not rank_zero_only:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
