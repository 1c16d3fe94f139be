"""`shardwise convert`: a run directory from, or to, a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_convert_parser(sub) -> None:
    conv = sub.add_parser("convert", help="convert between a run directory and a Hugging Face checkpoint")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR",
                           help="import a transformers checkpoint (Llama/Mistral/Qwen2/3/Mixtral, GPT-2, BERT masked LM, "
                                "ViT image classifier)")
    direction.add_argument("--to-hf", metavar="RUN_DIR", help="export a run's checkpoint as a transformers checkpoint")
    conv.add_argument("--out", required=True, help="the directory to write")
    conv.add_argument("--arch", default=None,
                      help="architecture written by --to-hf: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, ... for "
                           "the llama family; gpt2, bert, vit for theirs (the family's converter checks it) "
                           "(default: the run's family: llama, gpt2, bert or vit)")
    conv.add_argument("--checkpoint", help="with --to-hf: a checkpoint directory (default: the newest)")
    conv.add_argument("--tokenizer", help="with --from-hf: tokenizer.json to use (default: the one in HF_DIR)")
    conv.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> None:
    from shardwise.convert import export_run_to_hf, import_hf_to_run

    if args.from_hf:
        out = import_hf_to_run(Path(args.from_hf), Path(args.out), tokenizer=args.tokenizer and Path(args.tokenizer))
        print(f"imported {args.from_hf} -> run dir {out} (generate with: shardwise generate --run {out})")
    else:
        out = export_run_to_hf(Path(args.to_hf), Path(args.out), arch=args.arch,
                               checkpoint=args.checkpoint and Path(args.checkpoint))
        print(f"exported {args.to_hf} -> Hugging Face checkpoint {out}")
