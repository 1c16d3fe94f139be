"""`python -m shardwise.train [--config F] [--section.field V ...]`: one training rank.

This is what `torchrun ... -m shardwise.train ...` (and `shardwise train --nproc N`) runs in
every process. It takes exactly the arguments of `shardwise train`, by handing them to the
CLI, so the two can never drift apart; torchrun's RANK/WORLD_SIZE/... in the environment
are read by the trainer.

`record` writes an uncaught exception to the file the elastic agent names, so the launcher
can report the failed rank's error in one line. Bad input is still the CLI's one-line
`shardwise: error: ...` with exit status 2.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.cli import main as cli_main


@record
def main(argv: list[str] | None = None) -> int:
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
