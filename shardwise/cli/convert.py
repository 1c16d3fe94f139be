"""`shardwise convert`: a run directory from, or to, a Hugging Face checkpoint; a LoRA run's adapters
to a PEFT adapter."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_convert_parser(sub) -> None:
    conv = sub.add_parser("convert", help="convert between a run directory and a Hugging Face checkpoint")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR",
                           help="import a transformers checkpoint (Llama/Mistral/Qwen2/3/Mixtral, GPT-2, BERT masked LM, "
                                "ViT image classifier)")
    direction.add_argument("--to-hf", metavar="RUN_DIR", help="export a run's checkpoint as a transformers checkpoint")
    direction.add_argument("--to-peft", metavar="RUN_DIR",
                           help="export a LoRA run's adapters as a PEFT adapter (adapter_config.json, "
                                "adapter_model.safetensors) for the base its train.init_from names")
    conv.add_argument("--out", help="the directory to write (or give it after the other arguments)")
    conv.add_argument("out_dir", nargs="?", metavar="OUT", help="the directory to write, as --out")
    conv.add_argument("--merge", action="store_true",
                      help="with --to-hf of a LoRA run: fold each adapter into its base linear "
                           "(W + lora_alpha / lora_rank x B A) and write the merged model")
    conv.add_argument("--arch", default=None,
                      help="architecture written by --to-hf: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, ... for "
                           "the llama family; gpt2, bert, vit for theirs (the family's converter checks it) "
                           "(default: the run's family: llama, gpt2, bert or vit)")
    conv.add_argument("--checkpoint", help="with --to-hf or --to-peft: a checkpoint directory (default: the newest)")
    conv.add_argument("--tokenizer", help="with --from-hf: tokenizer.json to use (default: the one in HF_DIR)")
    conv.set_defaults(func=cmd_convert)


def out_dir_of(args: argparse.Namespace) -> Path:
    if args.out and args.out_dir and Path(args.out) != Path(args.out_dir):
        raise ValueError(f"--out {args.out!r} and OUT {args.out_dir!r} differ: give the directory to write once")
    if not (args.out or args.out_dir):
        raise ValueError("--out is missing: give the directory to write (--out DIR, or DIR last)")
    return Path(args.out or args.out_dir)


def cmd_convert(args: argparse.Namespace) -> None:
    from shardwise.convert import export_run_to_hf, export_run_to_peft, import_hf_to_run

    out = out_dir_of(args)
    checkpoint = args.checkpoint and Path(args.checkpoint)
    if args.merge and not args.to_hf:
        raise ValueError("--merge is invalid here: it folds a LoRA run's adapters into an --to-hf export; "
                         "use it with --to-hf")
    if args.from_hf:
        out = import_hf_to_run(Path(args.from_hf), out, tokenizer=args.tokenizer and Path(args.tokenizer))
        print(f"imported {args.from_hf} -> run dir {out} (generate with: shardwise generate --run {out})")
    elif args.to_peft:
        out = export_run_to_peft(Path(args.to_peft), out, checkpoint=checkpoint)
        print(f"exported {args.to_peft}'s adapters -> PEFT adapter {out} (load with "
              f"peft.PeftModel.from_pretrained(base, {str(out)!r}))")
        if not json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]:
            print("note: the run's train.init_from is empty, so its base is the seeded initial weights, which no "
                  "Hugging Face checkpoint holds; --to-hf --merge exports the whole model", file=sys.stderr)
    else:
        out = export_run_to_hf(Path(args.to_hf), out, arch=args.arch, checkpoint=checkpoint, merge=args.merge)
        print(f"exported {args.to_hf} -> Hugging Face checkpoint {out}")
