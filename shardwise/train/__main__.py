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

Ctrl-C: a launched rank takes SIGINT from its launcher, which passes a person's Ctrl-C on. From the
start of this module to the run's own handler (runtime/preemption.py: save and stop) and after it,
SIGINT ends such a rank quietly with status 130: there is nothing of the run to save yet, or any more,
and the launcher says what happened in one line. The handler comes before the imports (seconds, for
torch), which is why they are inside the functions. Not launched, the CLI's own one line answers it.
A launched rank also dies with its launcher (`die_with_launcher`).
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    # `record` writes an uncaught exception to the file the elastic agent names
    from torch.distributed.elastic.multiprocessing.errors import record

    from shardwise.cli.main import main as cli_main

    return record(cli_main)(["train", *(sys.argv[1:] if argv is None else argv)])


def stop_quietly(signum, frame) -> None:
    """SIGINT outside the run: leave at once, printing nothing (status 128 + SIGINT)."""
    leave_at_once(128 + signum)


def run_rank() -> None:
    if "WORLD_SIZE" in os.environ:  # launched (the one place this is read is launch.rank_environment, later)
        signal.signal(signal.SIGINT, stop_quietly)
    from shardwise.runtime.launch import die_with_launcher

    die_with_launcher()
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
