"""Single-device training-step throughput: shardwise's Llama vs HF `transformers` LlamaForCausalLM
with the same shapes, batch, loss and optimizer, timed alternately in one process.

    python benchmarks/step_vs_hf.py [--preset demo] [--batch 8] [--seq-len 128] [--steps 20]

Prints one JSON object; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from shardwise.models.llama.hf_adapter import config_to_hf
from shardwise.models.llama.model import build_model
from shardwise.config.presets import model_config
from shardwise.models.families import counts_of


def hf_model(cfg):
    import transformers

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config_to_hf(cfg).items()
                                          if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    return transformers.LlamaForCausalLM(hf_cfg).train()


def step_fn(model, logits_of, optimizer, tokens, targets):
    def step():
        loss = F.cross_entropy(logits_of(model, tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model (after 3 warm-up steps)")
    args = parser.parse_args()

    cfg = model_config(args.preset)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    models = {"shardwise": build_model(cfg, seed=0).train(), "transformers": hf_model(cfg)}
    logits_of = {"shardwise": lambda m, x: m(x), "transformers": lambda m, x: m(input_ids=x).logits}
    steps = {}
    for name, model in models.items():
        assert sum(p.numel() for p in model.parameters()) == counts_of(cfg).num_params(), name
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
        steps[name] = step_fn(model, logits_of[name], opt, tokens, targets)
        for _ in range(3):
            steps[name]()
    times = {name: [] for name in models}
    for _ in range(args.steps):  # alternate so both see the same machine state
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    tokens_per_step = args.batch * args.seq_len
    median = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "preset": args.preset, "params": counts_of(cfg).num_params(), "batch": args.batch, "seq_len": args.seq_len,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "median_step_s": median,
        "tokens_per_s": {name: tokens_per_step / s for name, s in median.items()},
        "speedup_vs_transformers": median["transformers"] / median["shardwise"],
    }, indent=2))


if __name__ == "__main__":
    main()
