"""Compiler speed on this machine, side by side in one process (issue 16 item 5).

    python benchmarks/compile_speed.py rmsnorm [--dtype float32|bfloat16] [--repeats 50]
    python benchmarks/compile_speed.py step [--preset demo] [--layers N --dim D --vocab V]
                                            [--batch 8] [--seq-len 128] [--steps 15] [--autocast bfloat16]

`rmsnorm`: forward + backward of RMSNorm at three shapes: the composed ops as Llama writes them
(eager), `F.rms_norm` (eager), `torch.compile` of the composition (inductor), and the composition
compiled with shardwise's rewrite rules (`compile/rules/rms_norm.py` -> torch's fused kernel,
then inductor).

`step`: a training step (forward, backward, clip, AdamW) of shardwise's Llama with
`train.compile` (regional compilation, rewrite rules, chunked loss), the same without the
rules, and eager, against HF
`transformers` LlamaForCausalLM eager and under `torch.compile`, same shapes, batch and
optimizer, timed alternately after warm-up. Each prints one JSON object with the CPU's bf16
flags; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from step_vs_hf import hf_model

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")


def cpu_flags() -> list[str]:
    """The CPU features that decide bf16 speed (AMX: bf16 matrix units; avx512_bf16: bf16 dot
    products in the vector units)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [flag for flag in BF16_FLAGS if flag in flags]


def machine() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags()}


def timed(fns: dict, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each function, calls alternating so all see the same machine state."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def composed_rms_norm(x, weight, eps: float = 1e-5):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def library_rms_norm(x, weight, eps: float = 1e-5):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rmsnorm(args) -> dict:
    from shardwise.compile.rules.backend import FIRED, rules_backend

    dtype = getattr(torch, args.dtype)
    variants = {
        "composed_eager": composed_rms_norm,
        "F.rms_norm": library_rms_norm,
        "torch.compile": torch.compile(composed_rms_norm, dynamic=False),
        "rule": torch.compile(composed_rms_norm, backend=rules_backend, dynamic=False),
    }
    results = []
    for tokens, dim in ((8192, 256), (4096, 1024), (2048, 4096)):
        torch.manual_seed(0)
        x = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
        weight = torch.randn(dim, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, dim, dtype=dtype)

        def fwd_bwd(fn):
            def run():
                x.grad = weight.grad = None
                fn(x, weight).backward(grad)
            return run

        median = timed({name: fwd_bwd(fn) for name, fn in variants.items()}, args.repeats)
        results.append({"shape": [tokens, dim], "median_ms": {k: round(v * 1e3, 3) for k, v in median.items()},
                        "rule_speedup": {k: round(v / median["rule"], 2) for k, v in median.items() if k != "rule"}})
    assert FIRED["rms_norm"] >= 3, f"the rms_norm rule did not fire on every shape: {dict(FIRED)}"
    return {"bench": "rmsnorm forward+backward", "dtype": args.dtype, **machine(), "shapes": results}


def step_cfg(args):
    from shardwise.config.model import model_config

    cfg = model_config(args.preset)
    changes = {"n_layers": args.layers, "dim": args.dim, "vocab_size": args.vocab}
    changes = {k: v for k, v in changes.items() if v}
    if args.dim:  # the demo's proportions at another width: head_dim 32, ffn ~2.75 dim
        changes.update(n_heads=args.dim // 32, n_kv_heads=args.dim // 64, ffn_dim=args.dim * 11 // 4)
    return dataclasses.replace(cfg, **changes)


def step(args) -> dict:
    from shardwise.compile.regional import compile_blocks
    from shardwise.models.families import plan_of
    from shardwise.models.llama.model import build_model

    cfg = step_cfg(args)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))

    def full_loss(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    compiled, no_rules = build_model(cfg, seed=0).train(), build_model(cfg, seed=0).train()
    compile_blocks([compiled], plan_of(cfg))
    compile_blocks([no_rules], plan_of(cfg), rules=False)
    hf_compiled = hf_model(cfg)
    models = {
        "shardwise_compiled": (compiled, lambda m: m(tokens, targets_BS=targets)),
        "shardwise_compiled_no_rules": (no_rules, lambda m: m(tokens, targets_BS=targets)),
        "shardwise_eager": (build_model(cfg, seed=0).train(), lambda m: full_loss(m(tokens))),
        "transformers_eager": (hf_model(cfg), lambda m: full_loss(m(input_ids=tokens).logits)),
        "transformers_compiled": (hf_compiled, lambda m, c=torch.compile(hf_compiled, dynamic=False):
                                  full_loss(c(input_ids=tokens).logits)),
    }
    autocast = args.autocast == "bfloat16"

    def train_step(model, loss_of, optimizer):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return run

    steps = {}
    for name, (model, loss_of) in models.items():
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params(), name
        # fused AdamW for all: shardwise's default, and HF Trainer's (adamw_torch_fused) since torch 2.8
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        steps[name] = train_step(model, loss_of, optimizer)
    median = timed(steps, args.steps)
    tokens_per_step = args.batch * args.seq_len
    return {
        "bench": "train step", "autocast": args.autocast, **machine(),
        "transformers": __import__("transformers").__version__,
        "model": {"layers": cfg.n_layers, "dim": cfg.dim, "vocab": cfg.vocab_size, "params": cfg.num_params()},
        "batch": args.batch, "seq_len": args.seq_len,
        "median_step_s": {k: round(v, 4) for k, v in median.items()},
        "tokens_per_s": {k: round(tokens_per_step / v) for k, v in median.items()},
        "shardwise_compiled_speedup": {k: round(v / median["shardwise_compiled"], 3)
                                       for k, v in median.items() if k != "shardwise_compiled"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    norm = sub.add_parser("rmsnorm")
    norm.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    norm.add_argument("--repeats", type=int, default=50)
    train = sub.add_parser("step")
    train.add_argument("--preset", default="demo")
    train.add_argument("--layers", type=int, default=0)
    train.add_argument("--dim", type=int, default=0)
    train.add_argument("--vocab", type=int, default=0)
    train.add_argument("--batch", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=128)
    train.add_argument("--steps", type=int, default=15, help="timed steps per model (after 3 warm-up steps)")
    train.add_argument("--autocast", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(json.dumps(rmsnorm(args) if args.bench == "rmsnorm" else step(args), indent=2))


if __name__ == "__main__":
    main()
