"""LoRA against full fine-tuning on an accelerator: peak memory and step time of one training step of
a preset's shape, each case in a fresh process. Prints one JSON object.

    python benchmarks/lora_gpu.py --device cuda --preset llama3-1b --batch 4 --seq-len 2048 \
        [--autocast bfloat16] [--compile] [--rank 16] [--steps 6]

Each case builds the model with the trainer's own pieces (`parallelize_config`, `build_optimizer`,
`train_step`: fused AdamW, clipping, the chunked loss) on one device and trains `--steps` steps on
random tokens; the peak is torch's allocator high-water mark (`max_memory_allocated`, and what it
reserved), the step time the median after the first two steps. Cases: "full" trains every weight,
"lora" adapters of rank `--rank` on q,k,v,o,gate,up,down with the base frozen in fp32, "lora-bf16-base"
the base held in bf16. `--device cpu` runs the same for a smoke test (no memory figures).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time, torch
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.parallelize import parallelize_config
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

overrides, steps = json.loads(sys.argv[1]), int(sys.argv[2])
cfg = load_config(overrides=overrides)
device = torch.device(cfg.train.device)
cuda = device.type == "cuda"
pm = parallelize_config(cfg, ParallelDims(world_size=1), device=device)
optimizer = build_optimizer([p for _, p, _ in pm.sync.named_optimizer_params()], cfg.train)
params = list(pm.model.parameters())
gen = torch.Generator().manual_seed(0)
batch = cfg.train.micro_batch_size
tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=gen)
losses, seconds = [], []
for _ in range(steps):
    start = time.perf_counter()
    loss, _ = train_step(pm, optimizer, [(tokens[:, :-1], tokens[:, 1:])], cfg, device)
    pm.sync.zero_grad(optimizer)
    if cuda:
        torch.cuda.synchronize()
    seconds.append(time.perf_counter() - start)
    losses.append(round(loss, 4))
print(json.dumps({
    "parameters": sum(p.numel() for p in params),
    "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
    "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
    "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 3) if cuda else None,
    "median_step_s": round(statistics.median(seconds[2:] or seconds), 4),
    "tokens_per_s": round(batch * cfg.train.seq_len / statistics.median(seconds[2:] or seconds), 1),
    "losses": losses,
}))
"""


def case_overrides(case: str, args) -> dict:
    base = {"model.preset": args.preset, "train.seq_len": args.seq_len, "train.global_batch_size": args.batch,
            "train.micro_batch_size": args.batch, "train.steps": args.steps, "train.warmup_steps": 1,
            "train.device": args.device, "train.autocast_dtype": args.autocast, "train.compile": args.compile,
            "train.sample_tokens": 0, "train.lr": 1e-4, "data.vocab_size": 260}
    if case == "full":
        return base
    lora = {"train.lora_rank": args.rank, "train.lora_alpha": 2.0 * args.rank, "train.lora_targets": "q,k,v,o,gate,up,down"}
    if case == "lora-bf16-base":
        lora["train.lora_base_dtype"] = "bfloat16"
    return {**base, **lora}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--autocast", default="bfloat16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cases", default="full,lora,lora-bf16-base")
    args = parser.parse_args()
    results = {}
    for case in args.cases.split(","):
        run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case_overrides(case, args)), str(args.steps)],
                             capture_output=True, text=True)
        results[case] = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                         else {"error": run.stderr.strip().splitlines()[-3:]})
    peaks = {case: r.get("peak_allocated_GiB") for case, r in results.items()}
    full = peaks.get("full")
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(json.dumps({"cases": results, "peak_vs_full": {case: round(peak / full, 3) for case, peak in peaks.items()
                                                          if peak and full},
                      "settings": vars(args), "commit": commit.stdout.strip()}, indent=1))


if __name__ == "__main__":
    main()
