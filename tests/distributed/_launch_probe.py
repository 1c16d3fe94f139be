"""A stand-in training entry for tests/distributed/test_launch.py (the trainer is not needed).

`python -m _launch_probe OUT_DIR [--fail-rank R --fail-how exit|raise]`: joins the gloo group
from torchrun's environment, all-reduces the ranks and writes OUT_DIR/rank{R}.json.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-how", choices=["exit", "raise"], default="exit")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if rank == args.fail_rank:
        if args.fail_how == "raise":
            raise RuntimeError(f"probe failure on rank {rank}")
        sys.exit(3)
    dist.init_process_group("gloo")
    rank_sum = torch.tensor([float(rank)])
    dist.all_reduce(rank_sum)
    record_ = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "rank_sum": rank_sum.item(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record_))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
