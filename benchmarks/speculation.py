"""Speculative decoding against plain decoding, same engine, same weights, one run (`--speculate`).

    python benchmarks/speculation.py --target /work/bench_runs/spec_demo --draft /work/bench_runs/spec_debug

The target is a `demo` run, the draft a `debug` run trained on the same data with the same tokenizer
(data.vocab_size 4096 both; the draft with --model.vocab_size 4096 --model.max_seq_len 1024). Greedy,
batch 1 (one prompt at a time, `--new-tokens` each): generated tokens per second over the prompt set,
prefill included, the median of `--repeats` passes timed alternately, for
- "copy": code-editing prompts whose answer repeats the prompt: a standard-library function, then
  "the same function with NAME renamed to NEW" and its first line (the model continues by copying);
  plain vs `ngram` vs `draft`;
- "novel": prompts where less is accepted: a shuffle of a function's tokens, sampled (temperature
  1, end-of-text ignored); plain vs `ngram` vs `draft`;
- "never": nothing accepted by construction: the copy prompts with every proposal made wrong (each
  token + 1; a draft model still runs its steps), the case the back-off bounds; plain vs ngram and draft;
- "batch_sweep": `--batch-sizes` copy prompts at once (continuous batching), plain vs ngram vs draft
  with the batch cutoff lifted: where speculation stops paying fixes `SPECULATION_MAX_BATCH`.
Prints one JSON object (ratios are speculative / plain tokens per second; `*_steps_per_token`:
decode steps per generated token, the work saved, free of timing noise; `*_same_output`: the
greedy tokens equal plain decoding's).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import platform
import random
import re
import statistics
import subprocess
import textwrap
import time
from pathlib import Path

import torch

from shardwise.generation.engine import generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.load import open_engine

SOURCES = ["textwrap:TextWrapper._split", "shlex:quote", "fnmatch:translate", "string:capwords", "calendar:monthrange",
           "statistics:median", "shutil:copyfileobj", "argparse:ArgumentParser.add_argument", "base64:b64encode",
           "difflib:get_close_matches", "csv:DictReader.__next__", "textwrap:dedent"]


def function_source(name: str) -> str:
    import importlib

    module, attribute = name.split(":")
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return textwrap.dedent(inspect.getsource(obj))


def copy_prompt(source: str, max_chars: int = 1200) -> str:
    """The function, then its renamed copy's first line: the rest of the answer repeats the prompt."""
    source = source[:max_chars].rsplit("\n", 1)[0]
    names = [n for n in re.findall(r"\b[a-z_][a-z0-9_]{2,}\b", source.split("\n", 1)[0])
             if n not in ("def", "self", "cls", "return")]
    old = names[-1] if names else "x"
    new = old + "_value"
    renamed = re.sub(rf"\b{old}\b", new, source)
    return f"{source}\n\n# The same function, with `{old}` renamed to `{new}`:\n{renamed.split(chr(10), 1)[0]}\n"


def novel_prompt(tokenizer, source: str, seed: int) -> list[int]:
    ids = tokenizer.encode(source[:600]).ids
    random.Random(seed).shuffle(ids)
    return ids


def timed(engine, prompts: list[list[int]], params: SamplingParams, batch: int):
    """(tokens per second, acceptance rate) generating every prompt, `batch` at a time."""
    steps_before = engine.stats["decode_steps"]
    start = time.perf_counter()
    seqs = []
    for first in range(0, len(prompts), batch):
        seqs += generate_all(engine, prompts[first:first + batch], params)
    seconds = time.perf_counter() - start
    proposed = sum(s.speculation.proposed for s in seqs if s.speculation)
    accepted = sum(s.speculation.accepted for s in seqs if s.speculation)
    tokens = sum(len(s.output_ids) for s in seqs)
    engine.steps_per_token = (engine.stats["decode_steps"] - steps_before) / tokens
    return tokens / seconds, (accepted / proposed if proposed else None), seqs


def never_accepted(engine):
    """The engine's proposals made wrong (each token + 1): every verify step (and draft step) is wasted."""
    propose = engine.speculator.proposals

    def wrong(seqs):
        proposals = propose(seqs)
        for proposal in proposals.values():
            proposal.tokens = [(token + 1) % engine.vocab_size for token in proposal.tokens]
        return proposals
    engine.speculator.proposals = wrong
    return engine


def engines_for(args, max_batch: int, lift_cutoff: bool = False, kinds=("plain", "ngram", "draft")) -> dict:
    engines = {}
    for name, speculate in (("plain", None), ("ngram", "ngram"), ("draft", f"draft:{args.draft}")):
        if name not in kinds:
            continue
        _, engine, tokenizer = open_engine(args.target, device_name="cpu", max_batch=max_batch, speculate=speculate,
                                           num_speculative_tokens=args.k if speculate else None, compile=args.compile)
        if lift_cutoff and engine.speculator is not None:
            engine.speculator.options = dataclasses.replace(engine.speculator.options, max_batch=max_batch)
        engines[name] = engine
    return engines, tokenizer


def compare(engines: dict, prompts, params, batch: int, repeats: int) -> dict:
    """Median tokens/s of each engine (passes alternate), the acceptance rates, and whether every
    engine's greedy output equals plain decoding's."""
    for engine in engines.values():  # warm-up: with --compile, the compiled step's every shape (verify widths too)
        generate_all(engine, prompts[:batch], params)
    rates, accept, outputs = {name: [] for name in engines}, {}, {}
    for _ in range(repeats):
        for name, engine in engines.items():
            tokens_per_s, accept[name], seqs = timed(engine, prompts, params, batch)
            rates[name].append(tokens_per_s)
            outputs[name] = [s.output_ids for s in seqs]
    result = {f"{name}_tokens_per_s": round(statistics.median(r), 1) for name, r in rates.items()}
    # decode steps (forwards of the model) per generated token: the work saved, free of timing noise
    result.update({f"{name}_steps_per_token": round(engine.steps_per_token, 3) for name, engine in engines.items()})
    for name in engines:
        if name != "plain":
            result[f"{name}_speedup"] = round(statistics.median(rates[name]) / statistics.median(rates["plain"]), 3)
            result[f"{name}_acceptance_rate"] = accept[name] and round(accept[name], 3)
            if params.temperature == 0:  # sampled outputs differ by design (the drafts draw too)
                result[f"{name}_same_output"] = outputs[name] == outputs["plain"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("/work/bench_runs/spec_demo"))
    parser.add_argument("--draft", type=Path, default=Path("/work/bench_runs/spec_debug"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=None, help="--num-speculative-tokens (default: the engine's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--compile", action="store_true", help="the compiled decode step (verify steps run eager)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on the shared 2-core machine, under other work, a 2-thread "
                             "OpenMP team waits for a busy core at every op: 30 vs 350 tokens/s measured)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    sampled = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    engines, tokenizer = engines_for(args, max_batch=1)
    sources = [function_source(name) for name in SOURCES]
    copy = [tokenizer.encode(copy_prompt(s)).ids for s in sources][:args.num_prompts]
    novel = [novel_prompt(tokenizer, s, seed) for seed, s in enumerate(sources)][:args.num_prompts]
    wrong = {name: never_accepted(engine) for name, engine in engines_for(args, 1, kinds=("ngram", "draft"))[0].items()}
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "commit": git_commit(), "new_tokens": args.new_tokens,
              "compile": args.compile, "k": args.k or engines["ngram"].speculator.options.num_tokens,
              "copy_prompt_tokens": [len(p) for p in copy],
              "copy": compare(engines, copy, params, 1, args.repeats),
              "novel": compare(engines, novel, sampled, 1, args.repeats),
              "never": compare({"plain": engines["plain"], **wrong}, copy, params, 1, args.repeats),
              "batch_sweep": {}}
    for batch in [int(b) for b in args.batch_sizes.split(",") if b]:
        sweep, _ = engines_for(args, max_batch=batch, lift_cutoff=True)
        prompts = (copy * batch)[:max(batch, len(copy))]
        result["batch_sweep"][batch] = compare(sweep, prompts, params, batch, max(1, args.repeats - 1))
    print(json.dumps(result, indent=1))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
