"""Weight-only quantization (issue 40, item 1): decode speed at batch 1 through the serving engine, and
perplexity on a trained run's held-out split. Prints JSON.

    python benchmarks/quantize.py speed [--dim 1536 --layers 20 --ffn 4096 --tokens 32 --rounds 3]
    python benchmarks/quantize.py quality --run RUN      # a run trained with data.val_fraction > 0

speed: a Llama shape with random weights (tied head, vocabulary 32000; 0.57B parameters by default),
one prompt, greedy, in one process and one run: fp32, bf16 (the model cast), int8 and int4 (the fp32
model's linears quantized at load, as `--quantize` does). Tokens/s counts decode steps only: each
variant generates 1 and then 1 + N tokens after the same prompt, and the difference in time is N
steps; the best of a few rounds in which the variants take turns. Ratios are against fp32 and bf16
of the same run.

quality: the run's model fp32, then int8 and int4 (each linear and the head), over the run's held-out
batches (the ones its training evaluated: train.eval_batches of data.val_fraction): perplexity
exp(mean token loss), and the change against fp32.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch

from shardwise.config.presets import model_config
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.quantize import quantize_model
from shardwise.generation.sampling import SamplingParams
from shardwise.models.llama.model import build_model

VARIANTS = ("fp32", "bf16", "int8", "int4")


def llama_models(args) -> dict:
    """The four variants of one random Llama (a copy each: every one is timed in every round)."""
    cfg = model_config("demo", dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128,
                       n_kv_heads=args.dim // 256, ffn_dim=args.ffn, vocab_size=32000, max_seq_len=256)
    base = build_model(cfg, device="cpu", seed=0).eval()
    models = {"fp32": base, "bf16": copy.deepcopy(base).to(torch.bfloat16)}
    for scheme in ("int8", "int4"):
        models[scheme] = quantize_model(copy.deepcopy(base), scheme)
    return {name: model for name, model in models.items() if name in args.variants}


class TokenNumbers:
    """A tokenizer stand-in for random weights: a token's text is its number."""

    def decode(self, ids):
        return " ".join(map(str, ids))


PROMPT = [[(17 * i) % 31000 + 100 for i in range(16)]]


def generation_seconds(engine, max_tokens: int) -> float:
    start = time.perf_counter()
    generate_all(engine, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def speed(args) -> dict:
    """Tokens/s of each variant: the best of `args.rounds` rounds, the variants taking turns in each
    (a busy shared machine slows some rounds; the best is the least disturbed)."""
    with torch.no_grad():
        models = llama_models(args)
        params = sum(p.numel() for p in next(iter(models.values())).parameters())
        engines = {name: engine_for_model(model, TokenNumbers(), eos_id=None, max_batch=1, owns_model=True)
                   for name, model in models.items()}
        for engine in engines.values():
            generation_seconds(engine, 4)  # warm-up: the cache is allocated, the kernels' first calls made
        best = {name: math.inf for name in args.variants}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                decode = generation_seconds(engine, 1 + args.tokens) - generation_seconds(engine, 1)
                best[name] = min(best[name], decode)
    figures = {name: round(args.tokens / seconds, 2) for name, seconds in best.items()}
    ratios = {f"{v}_vs_{base}": round(figures[v] / figures[base], 2) for v in ("bf16", "int8", "int4")
              for base in ("fp32", "bf16") if v != base and {v, base} <= figures.keys()}
    return {"shape": {"dim": args.dim, "layers": args.layers, "ffn": args.ffn, "vocab": 32000, "params": params},
            "batch": 1, "decode_tokens": args.tokens, "rounds": args.rounds, "tokens_per_s": figures,
            "ratios": ratios}


def held_out_perplexity(model, cfg, batches) -> float:
    from shardwise.models.common.loss import IGNORE_INDEX

    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            logits = model(inputs).float()
            loss_sum += float(torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"))
            count += int(targets.ne(IGNORE_INDEX).sum())
    return math.exp(loss_sum / count)


def held_out_batches(cfg) -> list:
    from shardwise.data.training_data import build_run_loaders, prepare_data
    from shardwise.models.common.loss import micro_batch_parts

    _, val_loader = build_run_loaders(cfg, prepare_data(cfg, verify=False))
    if val_loader is None:
        raise SystemExit("the run holds no validation split: train it with data.val_fraction > 0")
    return [micro_batch_parts(micro_batch)[:2] for i in range(cfg.train.eval_batches)
            for micro_batch in val_loader.batch_of_step(i)]


def quality(args) -> dict:
    from shardwise.infer.load import load_run, read_run_config

    cfg = read_run_config(Path(args.run))
    batches = held_out_batches(cfg)  # the same batches for every variant
    figures = {}
    for variant in ("fp32", "int8", "int4"):
        _, model, _ = load_run(Path(args.run))
        if variant != "fp32":
            quantize_model(model, variant)
        figures[variant] = held_out_perplexity(model, cfg, batches)
    tokens = sum(int(t.numel()) for _, t in batches)
    return {"run": args.run, "held_out_tokens": tokens, "perplexity": {k: round(v, 4) for k, v in figures.items()},
            "change_vs_fp32_percent": {v: round(100 * (figures[v] / figures["fp32"] - 1), 3) for v in ("int8", "int4")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("speed", "quality"))
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS),
                        help="which to time, e.g. fp32,int8 (default: all four)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, the variants taking turns")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per variant")
    parser.add_argument("--run", help="quality: a trained run directory with a held-out split")
    args = parser.parse_args()
    result = speed(args) if args.what == "speed" else quality(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result.update(date=datetime.date.today().isoformat(), commit=commit, torch=torch.__version__,
                  machine=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
