"""`--speculate` and `--num-speculative-tokens`, shared by `generate` and `serve`."""

from __future__ import annotations

import argparse

from shardwise.generation.speculation_options import (DEFAULT_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS,
                                                     speculation_options)


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculate", metavar="ngram|draft:RUN",
                        help="speculative decoding: 'ngram' proposes the tokens that followed the last n-gram's "
                             "earlier occurrence in prompt + output (code edits); 'draft:RUN' a smaller run with "
                             "the same tokenizer; output as without it (greedy: identical; sampled: same distribution)")
    parser.add_argument("--num-speculative-tokens", type=int, metavar="K",
                        help=f"tokens proposed per step, 1 to {MAX_SPECULATIVE_TOKENS} "
                             f"(default: {DEFAULT_SPECULATIVE_TOKENS['ngram']} for ngram, {DEFAULT_SPECULATIVE_TOKENS['draft']} for a "
                             "draft; adapted per sequence)")


def check_speculation_flags(args: argparse.Namespace) -> None:
    """The flags' values, before any rank starts (the draft run itself is checked when it opens)."""
    speculation_options(args.speculate, args.num_speculative_tokens)
