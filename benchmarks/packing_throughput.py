"""Packed vs padded instruction tuning on the SFT demo's data: the padding fraction of each and the
example tokens (not padding) trained per second. Prints one JSON object.

    python benchmarks/packing_throughput.py --init-from runs/demo [--steps 30] [--device cuda
        --autocast bfloat16 --compile]

Each case is configs/sft-demo.toml (LoRA on the demo run, prompt/completion pairs from the standard
library) with data.packing true or false, trained `--steps` steps in this process; the step time is the
median after the first `--warmup` steps. Example tokens per second = (1 - padding fraction) x the
step's tokens / the median step time, the padding fraction being the training rows' (a packed row
holds several examples, a padded row one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from shardwise.config.loader import load_config
from shardwise.data.example_data import padding_fraction, prepare_examples
from shardwise.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent


def measure(args, packing: bool, work: Path) -> dict:
    overrides = {"train.init_from": args.init_from, "data.packing": packing, "train.steps": args.steps,
                 "train.eval_every": 0, "data.val_fraction": 0.0, "train.device": args.device,
                 "train.autocast_dtype": args.autocast, "train.compile": args.compile, "checkpoint.at_end": False,
                 "run.dir": str(work / f"packing-{packing}"), "run.progress": False}
    cfg = load_config(ROOT / "configs" / "sft-demo.toml", overrides=overrides)
    examples = prepare_examples(cfg)
    rows = len(examples.train_rows) if packing else examples.train[0].num_examples
    padding = padding_fraction(examples.train[0], rows, cfg.train.seq_len)
    times: list[float] = []
    result = train(cfg, after_step=lambda step, record: times.append(record["step_time_s"]))
    step_time = statistics.median(times[args.warmup:])
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    return {"packing": packing, "rows": rows, "padding_fraction": round(padding, 4),
            "median_step_time_s": round(step_time, 4), "tokens_per_s": round(tokens_per_step / step_time, 1),
            "example_tokens_per_s": round((1 - padding) * tokens_per_step / step_time, 1),
            "first_loss": round(result.losses[0], 4), "last_loss": round(result.losses[-1], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init-from", default="runs/demo", help="the pretraining demo's run directory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", default="float32")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work, contextlib.redirect_stdout(sys.stderr):  # the runs' logs
        cases = [measure(args, packing, Path(work)) for packing in (True, False)]
    packed, padded = cases
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(json.dumps({
        "cases": cases, "example_tokens_per_s_packed_over_padded":
            round(packed["example_tokens_per_s"] / padded["example_tokens_per_s"], 2),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit.strip(),
        "settings": {key: value for key, value in vars(args).items()},
    }, indent=1))


if __name__ == "__main__":
    main()
