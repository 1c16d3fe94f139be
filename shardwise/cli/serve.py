"""`shardwise serve`: a trained run behind an OpenAI-compatible HTTP API (`infer/server.py`)."""

from __future__ import annotations

import argparse

from shardwise.cli.ranks import (add_prefix_cache_argument, add_quantize_arguments, add_run_arguments,
                                 check_at_least_one, check_prefix_cache_mb, launched_again)
from shardwise.cli.speculation_flags import add_speculation_arguments, check_speculation_flags

SERVE_FLAGS = ("run", "host", "port", "api_key", "model_name", "max_batch", "max_queue", "prefill_chunk",
               "context_len", "compile", "prefix_cache_mb", "checkpoint", "device",
               "quantize", "group_size", "speculate", "num_speculative_tokens")
"""The flags a rank of `serve --nproc N` is given again (`ranks.rank_argv`)."""


def add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve a trained run over an OpenAI-compatible HTTP API",
                         description="Serve a run's newest checkpoint (any training layout) at /v1/completions, "
                                     "/v1/chat/completions and /v1/models, with /health and /metrics; continuous "
                                     "batching over --max-batch slots. See docs/serving.md.")
    srv.add_argument("--run", required=True, help="run directory written by `shardwise train` (or convert --from-hf)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $SHARDWISE_API_KEY, else none)")
    srv.add_argument("--model-name", help="the model id clients name (default: the run's run.name)")
    srv.add_argument("--max-batch", type=int, default=16,
                     help="sequences decoded together, each holding a KV-cache slot (default: %(default)s)")
    srv.add_argument("--max-queue", type=int, default=256,
                     help="sequences that may wait for a slot; beyond it requests get 429 (default: %(default)s)")
    srv.add_argument("--prefill-chunk", type=int, default=256,
                     help="prompt tokens prefilled per engine step, so long prompts do not stall decoding "
                          "(default: %(default)s)")
    srv.add_argument("--context-len", type=int,
                     help="tokens per sequence, prompt and output (default: the model's max_seq_len)")
    srv.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile "
                                                            "(CUDA graphs on GPU)")
    add_prefix_cache_argument(srv)
    add_quantize_arguments(srv)
    add_speculation_arguments(srv)
    add_run_arguments(srv)
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    from shardwise.infer.commands import serve
    from shardwise.infer.quantized_run import check_quantize_at_load

    check_at_least_one(args, ("max_batch", "max_queue", "prefill_chunk"))
    check_prefix_cache_mb(args)
    check_quantize_at_load(args)
    if args.compile and args.tp > 1:  # every compiled step failed (torch 2.13, CPU): refused, not left to fail
        raise ValueError(f"--compile is invalid with --parallel.tp = {args.tp}: the compiled decode step does not "
                         "run on tensor-parallel (DTensor) weights yet; leave out --compile, or serve on one process")
    check_speculation_flags(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port = {args.port} is invalid: use a TCP port from 0 to 65535")
    if not launched_again(args, SERVE_FLAGS):
        serve(args)
