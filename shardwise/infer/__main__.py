"""`python -m shardwise.infer generate|serve [arguments]`: one rank of a tensor-parallel generation
or server, as started by `shardwise generate|serve --nproc N --parallel.tp N` (or torchrun)."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.cli.main import main as cli_main
from shardwise.runtime.launch import die_with_launcher


@record
def main(argv: list[str] | None = None) -> int:
    die_with_launcher()  # no rank serves on without the launcher
    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
