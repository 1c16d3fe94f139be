"""`shardwise generate`: continue prompts with a trained run, on one process or tensor-parallel."""

from __future__ import annotations

import argparse
import os

from shardwise.cli.ranks import (add_prefix_cache_argument, add_quantize_arguments, add_run_arguments,
                                 check_at_least_one, check_prefix_cache_mb, launched_again)
from shardwise.cli.speculation_flags import add_speculation_arguments, check_speculation_flags

GENERATE_FLAGS = ("run", "prompt", "prompts_file", "json", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                  "max_batch", "prefix_cache_mb", "checkpoint", "device",
                  "quantize", "group_size", "speculate", "num_speculative_tokens")
"""The flags a rank of `generate --nproc N` is given again (`ranks.rank_argv`)."""


def add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a trained run (several prompts batched)",
                         description="Continue one prompt, or every prompt of a file at once (continuous batching), "
                                     "with a trained run's newest checkpoint of any layout.")
    gen.add_argument("--run", required=True, help="run directory written by `shardwise train`")
    prompts = gen.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", help="text to continue (default: 'def ')")
    prompts.add_argument("--prompts-file", metavar="FILE",
                         help="one prompt per line, or a .jsonl file of strings or {\"prompt\": ...} objects")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (prompt, completion, finish_reason, token counts)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="sampling temperature from 0 (greedy) to 2 (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=50,
                     help="sample from the k most likely tokens; 0 = all (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample from the smallest set of tokens whose probability reaches p (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    gen.add_argument("--max-batch", type=int, default=16, help="prompts generated at once (default: %(default)s)")
    add_prefix_cache_argument(gen)
    add_quantize_arguments(gen)
    add_speculation_arguments(gen)
    add_run_arguments(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> None:
    from shardwise.infer.commands import generate_text, read_prompts, sampling_of
    from shardwise.infer.quantized_run import check_quantize_at_load

    sampling_of(args)  # every flag checked here, before any rank starts
    read_prompts(args)
    check_quantize_at_load(args)
    check_at_least_one(args, ("max_batch",))
    check_prefix_cache_mb(args)
    check_speculation_flags(args)
    if not launched_again(args, GENERATE_FLAGS):
        text = generate_text(args)
        if os.environ.get("RANK", "0") == "0":
            print(text)
