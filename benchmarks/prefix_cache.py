"""Prefix caching: time to first token of clients sharing a long prompt prefix, caching off vs on, one run.

    python benchmarks/prefix_cache.py [--clients 16] [--prefix 1024] [--suffix 16] [--repeats 2] [--machine NAME]

Through the engine (`generation.engine.Engine`, `--max-batch` slots, prefill chunk 256, as `serve`),
the demo model with random weights and max_seq_len 2048 (timing only), greedy, 16 new tokens each.
`--clients` requests arrive at once, each a `--prefix`-token prefix shared by all and a distinct
`--suffix`-token end. Cases, each timed off and on alternately, `--repeats` times (medians):
- "shared_cold": the prefix is cached by no one yet (a fresh pool each time): the first client
  computes it, the others restore it;
- "shared_warm": the pool already holds the prefix (an earlier wave with other suffixes);
- "distinct": nothing shared (every prompt its own random tokens): the cost of caching for nothing.
A first wave of each, not counted, warms up. Also the cost of one restore of `--prefix` columns into a slot, one store of them, and one prefill of
them alone. Greedy outputs off and on must be equal ("outputs_equal"). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch

from shardwise.config.presets import model_config
from shardwise.generation.engine import Engine, generate_all
from shardwise.generation.prefix_cache import DEFAULT_PREFIX_CACHE_MB, enable_prefix_caching
from shardwise.generation.prefix_index import RESTORE, STORE, PrefixCopy
from shardwise.generation.runner import ModelRunner
from shardwise.generation.sampling import SamplingParams
from shardwise.models.llama.model import build_model

NEW_TOKENS = 16


class IdsTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def prompts_of(args, seed: int, shared: bool) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(5, 4000, (n,), generator=generator).tolist()

    prefix = tokens(args.prefix)
    return [(prefix if shared else tokens(args.prefix)) + tokens(args.suffix) for _ in range(args.clients)]


def timed_wave(engine: Engine, prompts) -> dict:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    start = time.perf_counter()
    seqs = generate_all(engine, prompts, params)
    wall = time.perf_counter() - start
    ttft = [seq.first_token_at - seq.submitted_at for seq in seqs]
    return {"ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "wall_s": wall, "reused_tokens": sum(seq.num_reused for seq in seqs),
            "outputs": [seq.output_ids for seq in seqs]}


def engine_of(runner, prefix_cache=None) -> Engine:
    return Engine(runner, IdsTokenizer(), eos_id=None, prefill_chunk=256, prefix_cache=prefix_cache)


def one_repeat(runner, args, repeat: int) -> dict:
    """Each case off, then on: {case: {"off": wave, "on": wave}}."""
    print(f"repeat {repeat}: {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    pool_bytes = args.prefix_cache_mb * 2**20
    off = engine_of(runner)
    shared, warm_up, distinct = (prompts_of(args, 100 + repeat, True), prompts_of(args, 100 + repeat, True),
                                 prompts_of(args, 200 + repeat, False))
    warm_up = [p[:args.prefix] + list(reversed(p[args.prefix:])) for p in warm_up]  # other suffixes
    result = {"shared_cold": {"off": timed_wave(off, shared)}}
    result["shared_cold"]["on"] = timed_wave(engine_of(runner, enable_prefix_caching(runner, pool_bytes)), shared)
    warm = engine_of(runner, enable_prefix_caching(runner, pool_bytes))
    timed_wave(warm, warm_up)
    result["shared_warm"] = {"off": timed_wave(off, shared), "on": timed_wave(warm, shared)}
    result["distinct"] = {"off": timed_wave(off, distinct),
                          "on": timed_wave(engine_of(runner, enable_prefix_caching(runner, pool_bytes)), distinct)}
    return result


def copy_costs(runner, args) -> dict:
    """ms for one restore and one store of `--prefix` columns, and one prefill of them (median of 5)."""
    engine = engine_of(runner, enable_prefix_caching(runner, args.prefix_cache_mb * 2**20))
    generate_all(engine, prompts_of(args, 7, True)[:1], SamplingParams(max_tokens=1, temperature=0))
    blocks = list(range(args.prefix // 16))

    def median_ms(fn):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    with torch.inference_mode():
        restore = median_ms(lambda: runner.copy_prefix(PrefixCopy(RESTORE, 1, 0, blocks)))
        store = median_ms(lambda: runner.copy_prefix(PrefixCopy(STORE, 1, 0, blocks)))
    prompt = prompts_of(args, 8, True)[:1]
    prefill = median_ms(lambda: generate_all(engine_of(runner), [p[:args.prefix] for p in prompt],
                                             SamplingParams(max_tokens=1, temperature=0)))
    return {"restore_ms": restore, "store_ms": store, "prefill_ms": prefill}


def summary(repeats: list[dict]) -> dict:
    out = {}
    for case in repeats[0]:
        out[case] = {}
        for mode in ("off", "on"):
            waves = [r[case][mode] for r in repeats]
            out[case][mode] = {key: statistics.median(w[key] for w in waves)
                               for key in ("ttft_mean_s", "ttft_p50_s", "ttft_max_s", "wall_s", "reused_tokens")}
        out[case]["ttft_mean_off_over_on"] = out[case]["off"]["ttft_mean_s"] / out[case]["on"]["ttft_mean_s"]
        out[case]["wall_off_over_on"] = out[case]["off"]["wall_s"] / out[case]["on"]["wall_s"]
        out[case]["outputs_equal"] = all(r[case]["off"]["outputs"] == r[case]["on"]["outputs"] for r in repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB)
    parser.add_argument("--machine", default=platform.processor() or platform.machine(),
                        help="the machine's name in the figures (default: what Python says)")
    args = parser.parse_args()
    cfg = model_config("demo", max_seq_len=2048)
    model = build_model(cfg, seed=0).eval()
    runner = ModelRunner(model, num_slots=args.clients, owns_model=True)
    warm_up = prompts_of(args, 0, True)  # the first forwards of each shape are slower
    timed_wave(engine_of(runner), warm_up)
    timed_wave(engine_of(runner, enable_prefix_caching(runner, args.prefix_cache_mb * 2**20)), warm_up)
    repeats = [one_repeat(runner, args, repeat) for repeat in range(args.repeats)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"benchmark": "prefix_cache", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                      "commit": commit, "machine": args.machine,
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "model": "demo, max_seq_len 2048",
                      "clients": args.clients, "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
                      "new_tokens": NEW_TOKENS, "prefix_cache_mb": args.prefix_cache_mb, "repeats": args.repeats,
                      "cases": summary(repeats), "copy_costs": copy_costs(runner, args)}, indent=1))


if __name__ == "__main__":
    main()
