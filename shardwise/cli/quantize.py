"""`shardwise quantize`: write a run whose linears are stored int8 or int4 (`infer/quantized_run.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_quantize_parser(sub) -> None:
    quant = sub.add_parser("quantize", help="write a weight-only int8/int4 quantized copy of a run, for serving",
                           description="Quantize a trained run's linear weights (int8 per output channel, or int4 "
                                       "in groups of input columns) into a new run directory that `shardwise "
                                       "generate` and `shardwise serve` load directly. See docs/serving.md.")
    quant.add_argument("--run", required=True, help="run directory written by `shardwise train` (or convert --from-hf)")
    quant.add_argument("--scheme", required=True, metavar="SCHEME", help="int8 or int4")
    quant.add_argument("--group-size", type=int, metavar="G",
                       help="int4: input columns sharing a scale and zero point, 32, 64, 128 or 256 (default: 128, "
                            "or the largest that divides every linear's input width)")
    quant.add_argument("--out", required=True, help="the new run directory (must not exist)")
    quant.add_argument("--checkpoint", help="a checkpoint directory of the run (default: the newest)")
    quant.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> None:
    from shardwise.infer.quantized_run import write_quantized_run

    out = write_quantized_run(Path(args.run), args.scheme, Path(args.out), group_size=args.group_size,
                              checkpoint=args.checkpoint and Path(args.checkpoint))
    print(f"quantized {args.run} ({args.scheme}) -> run dir {out} (serve it with: shardwise serve --run {out})")
