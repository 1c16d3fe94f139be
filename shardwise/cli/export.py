"""`shardwise export`: a trained decoder run as an AOTInductor package that runs without shardwise."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_export_parser(sub) -> None:
    exp = sub.add_parser("export", help="export a run as an AOTInductor package (prefill + decode, KV cache)",
                         description="Write an AOTInductor package of a decoder run's prefill and decode programs "
                                     "(dynamic batch and lengths, KV cache as inputs and outputs), with its "
                                     "tokenizer, chat template and a manifest; examples/run_exported.py runs it "
                                     "with torch and tokenizers alone.")
    exp.add_argument("--run", required=True, help="run directory written by `shardwise train`")
    exp.add_argument("--out", required=True, help="the directory to write (must not exist)")
    exp.add_argument("--checkpoint", help="a checkpoint directory of the run (default: the newest)")
    exp.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> None:
    from shardwise.infer.export import export_run

    manifest = export_run(Path(args.run), Path(args.out), checkpoint=args.checkpoint and Path(args.checkpoint))
    print(f"exported {args.run} ({manifest['family']}, {manifest['dtype']}) -> {args.out} (run it with: "
          f"python examples/run_exported.py {args.out} --prompt 'def ')")
