"""Mixture of experts: step time dense vs MoE at equal active parameters, and the all-to-all
bytes of expert parallelism per step against their formula.

    python benchmarks/moe.py [--steps 10] [--out FILE]

1. Step time (one process, fp32): the `demo` shapes (dim 256, 4 blocks, SwiGLU 704, vocabulary
   4096) dense, against MoE twins with the same active parameters per token up to the router:
   8 experts of width 352 (top-2), 16 of width 176 (top-4); dropless, and with capacity 1.25.
   Forward + backward + AdamW of 8 x 128 tokens; median of `--steps` after 2 warm-up steps.
2. All-to-all bytes (ep = 2 on 2 gloo processes, the `moe-debug` model, 1 step of 8 x 64 tokens
   in 2 micro-batches per rank): the communication log's all-to-all payload on rank 0, against
       4 D (2 S + 2 R) + 8 E   per MoE layer and micro-batch, summed,
   where S = rows rank 0 sends (its tokens x k, dropless), R = rows it receives (the load of its
   experts, from the step's metrics), D = model width in bytes / 4: dispatch and combine in
   forward, their transposes in backward, and the int64 count exchange. With balanced routing
   R = S, i.e. 16 D T k bytes per layer and step for T tokens per rank.
Prints one JSON object; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from shardwise.models.llama.model import build_model
from shardwise.config.presets import model_config
from shardwise.models.families import counts_of

VARIANTS = {
    "dense": dict(),
    "moe 8x352 top-2": dict(n_experts=8, experts_per_token=2, moe_ffn_dim=352),
    "moe 8x352 top-2, capacity 1.25": dict(n_experts=8, experts_per_token=2, moe_ffn_dim=352, capacity_factor=1.25),
    "moe 16x176 top-4": dict(n_experts=16, experts_per_token=4, moe_ffn_dim=176),
}


def step_times(steps: int) -> dict:
    """Variants alternate step by step (after 2 warm-up steps each), so a load change on the
    machine touches them all alike; medians."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (8, 129), generator=gen)
    runs = {}
    for name, overrides in VARIANTS.items():
        cfg = model_config("demo", **overrides)
        model = build_model(cfg).train()
        runs[name] = (cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), [])
    for i in range(steps + 2):
        for cfg, model, optimizer, times in runs.values():
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i >= 2:
                times.append(time.perf_counter() - start)
    return {name: {"params": counts_of(cfg).num_params(), "active_params": counts_of(cfg).num_active_params(),
                   "flops_per_token": counts_of(cfg).flops_per_token(128), "step_time_s": statistics.median(times)}
            for name, (cfg, _, _, times) in runs.items()}


def ep_job(overrides: dict) -> None:
    from shardwise.config.loader import load_config
    from shardwise.train.trainer import train

    train(load_config(overrides=overrides))


def all_to_all_bytes() -> dict:
    from shardwise.runtime.worker_pool import WorkerPool

    run_dir = tempfile.mkdtemp(prefix="moe-bench-")
    overrides = {"model.preset": "moe-debug", "data.vocab_size": 512, "data.max_corpus_bytes": 200_000,
                 "train.steps": 1, "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.seq_len": 64,
                 "train.sample_tokens": 0, "train.device": "cpu", "checkpoint.at_end": False,
                 "run.dir": run_dir, "run.progress": False, "parallel.ep": 2}
    with WorkerPool(2) as pool:
        pool.run(ep_job, overrides)
    record = json.loads(open(f"{run_dir}/metrics.jsonl").readline())
    cfg = model_config("moe-debug")
    ep, k, width = 2, cfg.experts_per_token, 4 * cfg.dim
    micro_batches, tokens_per_rank = 2, 8 // ep * 64
    local_experts = range(cfg.n_experts // ep)
    layers = record["moe_tokens_per_expert"]
    sent = len(layers) * tokens_per_rank * k
    received = sum(load[e] for load in layers.values() for e in local_experts)
    counts = len(layers) * micro_batches * 8 * cfg.n_experts
    formula = width * 2 * (sent + received) + counts
    balanced = len(layers) * 4 * width * tokens_per_rank * k + counts
    return {"measured_bytes": record["comm"]["all_to_all"]["bytes"], "formula_bytes": formula,
            "balanced_formula_bytes": balanced, "calls": record["comm"]["all_to_all"]["calls"],
            "rows_sent": sent, "rows_received": received, "loads": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "step_time": step_times(args.steps), "all_to_all": all_to_all_bytes()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
