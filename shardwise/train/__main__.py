"""`python -m shardwise.train [--config F] [--section.field V ...]`: one training rank.

This is what `torchrun ... -m shardwise.train ...` (and `shardwise train --nproc N`) runs in
every process. It takes exactly the arguments of `shardwise train`, by handing them to the
CLI, so the two can never drift apart; torchrun's RANK/WORLD_SIZE/... in the environment
are read by the trainer.

`record` writes an uncaught exception to the file the elastic agent names, so the launcher
can report the failed rank's error in one line. Bad input is still the CLI's one-line
`shardwise: error: ...` with exit status 2.

A rank whose step raised ends with `os._exit(1)` once its traceback is printed: the normal interpreter
teardown destroys the gloo process group while a peer may still be inside a collective, and that
teardown could abort (SIGABRT, exit 134) instead of exiting 1, so the launcher named the wrong cause.
Nothing is left to do at exit: the trainer's `finally` blocks have run and no `atexit` hooks exist.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.cli import main as cli_main


@record
def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


def run_rank() -> None:
    try:
        status = main()
    except SystemExit:
        raise
    except Exception:  # `record` has written the error file; print and leave at once
        sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes each line with [rankN]
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(status)


if __name__ == "__main__":
    run_rank()
