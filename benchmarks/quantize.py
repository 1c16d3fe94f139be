"""Weight-only quantization (issue 40, item 1): decode speed at batch 1 through the serving engine, and
perplexity on a trained run's held-out split. Prints JSON.

    python benchmarks/quantize.py speed [--dim 1536 --layers 20 --ffn 4096 --tokens 32 --rounds 3] [--compile]
    python benchmarks/quantize.py quality --run RUN      # a run trained with data.val_fraction > 0
    python benchmarks/quantize.py kernels [--threads 1,2]

speed: a Llama shape with random weights (tied head, vocabulary 32000; 0.57B parameters by default),
one prompt, greedy, in one process and one run: fp32, bf16 (the model cast), int8 and int4 (the fp32
model's linears quantized at load, as `--quantize` does). Tokens/s counts decode steps only: each
variant generates 1 and then 1 + N tokens after the same prompt, and the difference in time is N
steps; the best of a few rounds in which the variants take turns. Ratios are against fp32 and bf16
of the same run.

kernels: one decode product (one row) at the default model's shapes, each kernel in the layout the engine
gives it (fp32: transposed storage, `cpu_weight_layout`; bf16: as stored; int8/int4: `quantize.py`'s), with
the weights cold: each kernel cycles through copies of its weight that add up to more than the last-level
cache, as a decode step reads each weight once (one weight timed alone stays cached and runs several
times faster). Microseconds per product and the GB/s of weight bytes that makes.

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
        engines = {name: engine_for_model(model, TokenNumbers(), eos_id=None, max_batch=1, owns_model=True,
                                          compile=args.compile)
                   for name, model in models.items()}
        for engine in engines.values():
            generation_seconds(engine, 4)  # warm-up: the cache is allocated, the kernels' first calls made (compiled)
        best = {name: math.inf for name in args.variants}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                decode = generation_seconds(engine, 1 + args.tokens) - generation_seconds(engine, 1)
                best[name] = min(best[name], decode)
    figures = {name: round(args.tokens / seconds, 2) for name, seconds in best.items()}
    ratios = {f"{v}_vs_{base}": round(figures[v] / figures[base], 2) for v in ("bf16", "int8", "int4")
              for base in ("fp32", "bf16") if v != base and {v, base} <= figures.keys()}
    return {"shape": {"dim": args.dim, "layers": args.layers, "ffn": args.ffn, "vocab": 32000, "params": params},
            "batch": 1, "compiled": args.compile, "decode_tokens": args.tokens, "rounds": args.rounds, "tokens_per_s": figures,
            "ratios": ratios}


KERNEL_SHAPES = ((1536, 1536), (4096, 1536), (1536, 4096), (32000, 1536))
"""[out, in] of the default model's products: wq/wo, w1/w3, w2, the head (wk/wv are [768, 1536])."""
COLD_BYTES = 600e6


def kernel_products(out_features: int, in_features: int) -> dict:
    """name -> (bytes per weight element, a product of one row by one copy of the weight, made fresh)."""
    x = torch.randn(1, in_features)
    x_bf16 = x.bfloat16()
    scales = torch.rand(out_features).bfloat16()
    scales_and_zeros = torch.rand(in_features // 128, out_features, 2).bfloat16()

    def fp32():
        weight = torch.randn(out_features, in_features).t().contiguous().t()
        return lambda: torch.nn.functional.linear(x, weight)

    def bf16():
        weight = torch.randn(out_features, in_features).bfloat16()
        return lambda: torch.nn.functional.linear(x_bf16, weight)

    def int8():
        codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
        return lambda: torch.ops.aten._weight_int8pack_mm(x_bf16, codes, scales)

    def int4():
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16, packed, 128, scales_and_zeros)

    return {"fp32": (4, fp32), "bf16": (2, bf16), "int8": (1, int8), "int4": (0.5, int4)}


def kernels(args) -> dict:
    """Per thread count and shape: each kernel's best pass (of 3) over its cold copies."""
    figures = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for out_features, in_features in KERNEL_SHAPES:
            row = figures.setdefault(f"{threads}t {out_features}x{in_features}", {})
            for name, (element_bytes, make) in kernel_products(out_features, in_features).items():
                copies = max(4, math.ceil(COLD_BYTES / (out_features * in_features * element_bytes)))
                products = [make() for _ in range(copies)]
                pass_seconds(products)  # warm-up: the first calls' allocations
                best = min(pass_seconds(products) for _ in range(3)) / copies
                gb_per_s = out_features * in_features * element_bytes / best / 1e9
                row[name] = {"us": round(best * 1e6), "GB/s": round(gb_per_s, 1)}
                del products
    return {"kernels": figures, "cold_bytes_per_kernel": COLD_BYTES}


def pass_seconds(products) -> float:
    start = time.perf_counter()
    for product in products:
        product()
    return time.perf_counter() - start


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
    parser.add_argument("what", choices=("speed", "quality", "kernels"))
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS),
                        help="which to time, e.g. fp32,int8 (default: all four)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, the variants taking turns")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per variant")
    parser.add_argument("--compile", action="store_true", help="speed: every variant's decode step compiled, "
                        "as `generate/serve --compile` does")
    parser.add_argument("--threads", type=lambda text: [int(t) for t in text.split(",")], default=[1, 2],
                        help="kernels: thread counts, e.g. 1,2")
    parser.add_argument("--run", help="quality: a trained run directory with a held-out split")
    args = parser.parse_args()
    result = {"speed": speed, "quality": quality, "kernels": kernels}[args.what](args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result.update(date=datetime.date.today().isoformat(), commit=commit, torch=torch.__version__,
                  machine=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
