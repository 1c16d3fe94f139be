"""What checking the token cache costs on each run's first use: the full check (SHA-256 of tokens.bin
and tokenizer.json against meta.json, what a one-process run and the `--nproc` launcher do) and the
ranks' check (tokens.bin's inode, size, mtime and ctime against the last hash's record), on the
demo's cache (configs/demo.toml's data, built first if absent).

    python benchmarks/token_cache_check.py [--repeats 20]

Prints one JSON object: the entry's size and token count, and the median milliseconds of each check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from shardwise.config.loader import load_config
from shardwise.data.prepare import TOKENS_FILE, build_dataset, verify_cache_entry

ROOT = Path(__file__).resolve().parents[1]


def median_ms(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    data = build_dataset(load_config(ROOT / "configs/demo.toml").data)
    entry = data.tokens.path
    print(json.dumps({
        "tokens_bin_bytes": (entry / TOKENS_FILE).stat().st_size, "num_tokens": data.tokens.num_tokens,
        "full_check_ms": median_ms(lambda: verify_cache_entry(entry, rehash=True), args.repeats),
        "ranks_check_ms": median_ms(lambda: verify_cache_entry(entry, rehash=False), args.repeats),
        "repeats": args.repeats,
    }))


if __name__ == "__main__":
    main()
