"""`python -m shardwise.train [--config F] [--section.field V ...]`: one training rank.

This is what `torchrun ... -m shardwise.train ...` (and `shardwise train --nproc N`) runs in
every process. It takes exactly the arguments of `shardwise train`, by handing them to the
CLI, so the two can never drift apart; torchrun's RANK/WORLD_SIZE/... in the environment
are read once, by the trainer's run context (train/context.py).

`record` writes an uncaught exception to the file the elastic agent names, so the launcher
can report the failed rank's error in one line. Bad input is still the CLI's one-line
`shardwise: error: ...` with exit status 2.

A rank that fails ends with `os._exit`: after its step raised (status 1, once its traceback is
printed), and after the CLI's one-line error for bad input (status 2). The normal interpreter
teardown destroys the gloo process group while a peer may still be inside a collective, and that
teardown could abort (SIGABRT, exit 134) instead, so the launcher named the wrong cause and
restarted the job (seen for bad input on one rank in a CI run, 2026-11-26).
Nothing is left to do at exit: the trainer's `finally` blocks have run and no `atexit` hooks exist.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.cli.main import main as cli_main


@record
def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


def run_rank() -> None:
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code
    except Exception:  # `record` has written the error file; print and leave at once
        sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes each line with [rankN]
        leave_at_once(1)
    if isinstance(status, str):  # as the interpreter does for SystemExit("message")
        print(status, file=sys.stderr)
        status = 1
    if status:  # a failed rank (bad input: the CLI's one-line error is printed): leave at once as well
        leave_at_once(status)
    sys.exit(status)


def leave_at_once(status: int) -> None:
    """Exit without the interpreter's teardown (the module docstring says why)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run_rank()
