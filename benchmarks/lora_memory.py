"""Peak memory and trainable parameters of LoRA against full fine-tuning, one process on this CPU.

    python benchmarks/lora_memory.py [--steps 2] [--rank 16] [--alpha 32] [--cases full,lora]
                                     [--recompute none|full|selective] [--out FILE]

The model is a ~0.5B-parameter Llama shape (Qwen2.5-0.5B's: dim 896, 24 layers, 14 query and 2
key/value heads, q/k/v biases, SwiGLU 4864, vocabulary 151,936, tied embeddings: 494M parameters),
trained at batch 1 x 512 tokens in fp32 by the trainer's own pieces (`parallelize_config`,
`build_optimizer`, `train_step`, AdamW) for `--steps` optimizer steps on random tokens. Each case
runs in a fresh process, whose peak resident set (VmHWM: everything the process ever held at once,
the Python and torch runtime included) is the figure; `rss_after_import` is the runtime's part.

Each case is measured under two settings of glibc's allocator: its default, whose mmap threshold grows
with the tensors freed (so a freed activation's memory stays in the heap, resident, and the next
step's tensors do not always fit back into it: the peak then holds both), and a fixed 128 KiB
threshold (MALLOC_MMAP_THRESHOLD_), under which every tensor of that size is mapped on its own and
returned when freed, so the peak is what the step holds at once.

Cases: "full" trains every weight; "lora" adapters of rank `--rank` on q,k,v,o,gate,up,down with the
base frozen in fp32; "lora-bf16-base" the same with train.lora_base_dtype = bfloat16. Two steps cover
the peak: the first allocates AdamW's state, the second's backward holds parameters, optimizer
state, activations and gradients together. `--recompute` sets train.recompute for every case (full
fine-tuning's peak is its optimizer step, parameters, gradients and AdamW's state, which recomputation
leaves alone; LoRA's is its activations beside the frozen base; torchtune's LoRA recipes recompute by
default). Prints one JSON object (Linux only: /proc).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

SHAPE = {"model.preset": "demo", "model.dim": 896, "model.n_layers": 24, "model.n_heads": 14, "model.n_kv_heads": 2,
         "model.ffn_dim": 4864, "model.vocab_size": 151936, "model.max_seq_len": 512, "model.qkv_bias": True,
         "model.tie_embeddings": True, "model.rope_theta": 1e6, "model.norm_eps": 1e-6}
"""Qwen2.5-0.5B's shape (its config.json) as a shardwise Llama."""

CHILD = r"""
import json, sys, time, torch
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.parallelize import parallelize_config
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

overrides, steps = json.loads(sys.argv[1]), int(sys.argv[2])
after_import = status("VmRSS")
cfg = load_config(overrides=overrides)
device = torch.device("cpu")
pm = parallelize_config(cfg, ParallelDims(world_size=1), device=device)
optimizer = build_optimizer([p for _, p, _ in pm.sync.named_optimizer_params()], cfg.train)
params = list(pm.model.parameters())
tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0))
losses, seconds = [], []
for _ in range(steps):
    start = time.perf_counter()
    loss, _ = train_step(pm, optimizer, [(tokens[:, :-1], tokens[:, 1:])], cfg, device)
    pm.sync.zero_grad(optimizer)
    seconds.append(round(time.perf_counter() - start, 1))
    losses.append(loss)
print(json.dumps({
    "parameters": sum(p.numel() for p in params),
    "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
    "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
    "optimizer_state_bytes": sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()),
    "peak_rss_GiB": round(status("VmHWM") / 2**30, 3),
    "rss_after_import_GiB": round(after_import / 2**30, 3),
    "step_seconds": seconds, "losses": losses,
}))
"""


def case_overrides(case: str, args) -> dict:
    train = {"train.seq_len": 512, "train.global_batch_size": 1, "train.micro_batch_size": 1,
             "train.steps": max(args.steps, 2), "train.warmup_steps": 1, "train.device": "cpu",
             "train.sample_tokens": 0, "data.vocab_size": 4096, "train.recompute": args.recompute}
    if case == "full":
        return {**SHAPE, **train}
    lora = {"train.lora_rank": args.rank, "train.lora_alpha": args.alpha, "train.lora_targets": "q,k,v,o,gate,up,down"}
    if case == "lora-bf16-base":
        lora["train.lora_base_dtype"] = "bfloat16"
    return {**SHAPE, **train, **lora}


ALLOCATORS = {"glibc default": {}, "freed tensors returned": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def measure(case: str, args, allocator: dict) -> dict:
    """The case in a fresh process (its own peak, nothing left from another case)."""
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case_overrides(case, args)), str(args.steps)],
                         check=True, capture_output=True, text=True, env={**os.environ, **allocator}).stdout
    return json.loads(out.strip().splitlines()[-1])


def peaks_vs_full(results: dict) -> dict:
    """Each case's peak as a fraction of full fine-tuning's, per allocator setting."""
    return {allocator: {case: round(runs[allocator]["peak_rss_GiB"] / results["full"][allocator]["peak_rss_GiB"], 3)
                        for case, runs in results.items()} for allocator in ALLOCATORS}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--cases", default="full,lora", help="comma-separated: full, lora, lora-bf16-base")
    parser.add_argument("--recompute", default="none", choices=["none", "full", "selective"])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    import torch

    measured_at = commit()  # the code the figures come from (the tree may move on while they run)

    results = {case: {name: measure(case, args, env) for name, env in ALLOCATORS.items()}
               for case in args.cases.split(",")}
    report = {
        "benchmark": "lora_memory", "date": datetime.date.today().isoformat(), "commit": measured_at,
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
        "shape": SHAPE, "batch": "1 x 512 tokens, fp32", "recompute": args.recompute, "lora": {"rank": args.rank, "alpha": args.alpha},
        "cases": results,
    }
    if "full" in results:
        report["peak_vs_full"] = peaks_vs_full(results)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
