"""What watching a run costs: the trainer's step against the bare step, side by side in one run (issue 36 item 9).

    python benchmarks/trainer_overhead.py [--compile both|true|false] [--steps 40] [--warmup 8]
                                          [--preset demo] [--batch 8] [--seq-len 128] [--threads N]
                                          [--console terminal] [--per-step]

The bare step is benchmarks/compile_speed.py's `step`: forward with the chunked loss, backward,
`clip_grad_norm_`, fused AdamW, `zero_grad`, on a model built and (with --compile) compiled as there,
nothing else. The trainer is `shardwise.train.trainer.train` on the same model preset, batch and dtype
(fp32), with everything it does by default: the data loader, the metrics line and metrics.jsonl, the
communication log and flight recorder, the memory reading, the non-finite check, the console. Its
global batch is one micro-batch (`--batch`), so one trainer step is one bare step's work.

One process (`train` in this process, no launcher: `shardwise train`'s default `--nproc auto` starts
2 data-parallel ranks on a CPU-only machine, which is another measurement). The two alternate: after
each trainer step its `after_step` hook runs one bare step, so the load of this shared machine falls
on both alike. Reported per mode, medians over the steps after `--warmup`:
the bare step's tokens/s; the trainer's loop (one iteration, from the end of one hook to the start of
the next: everything the trainer does for a step); the trainer's own step time as logged (metrics.jsonl
`step_time_s`, what its tokens/s line shows); and their ratios to the bare step. The load average before
and after says what else the cores were doing. Prints one JSON object; docs/benchmarks.md records it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from compile_speed import machine, step_models, train_step as bare_train_step
from shardwise.config.loader import load_config
from shardwise.models.common.attention import attention_kernel_order
from shardwise.train.trainer import train


def bare_step(model_cfg, compiled: bool, batch: int, seq_len: int):
    """compile_speed.py's step of shardwise's model: compiled (its `shardwise_compiled`), or the same model
    eager, both with the chunked loss the trainer uses by default (train.chunked_loss)."""
    from shardwise.models.llama.model import build_model

    torch.manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len))
    targets = torch.randint(0, model_cfg.vocab_size, (batch, seq_len))
    if compiled:
        model, loss_of = step_models(model_cfg, "cpu", tokens, targets)["shardwise_compiled"]()
    else:
        model = build_model(model_cfg, device="cpu", seed=0).train()
        loss_of = lambda m: m(tokens, targets_BS=targets)  # noqa: E731
    return bare_train_step(model, loss_of, autocast=False, device="cpu",
                           kernel_order=lambda: attention_kernel_order(torch.device("cpu")))


class Alternation:
    """The trainer's `after_step` hook: times the trainer's loop between calls and runs one bare step."""

    def __init__(self, bare):
        self.bare = bare
        self.bare_s: list[float] = []
        self.loop_s: list[float] = []
        self.left_at: float | None = None

    def __call__(self, step: int, record: dict) -> None:
        arrived = time.perf_counter()
        if self.left_at is not None:
            self.loop_s.append(arrived - self.left_at)
        started = time.perf_counter()
        self.bare()
        self.bare_s.append(time.perf_counter() - started)
        self.left_at = time.perf_counter()


def measure(args, compiled: bool, run_dir: Path) -> dict:
    cfg = load_config(overrides={
        "model.preset": args.preset, "train.compile": compiled, "train.steps": args.warmup + args.steps,
        "train.global_batch_size": args.batch, "train.micro_batch_size": args.batch, "train.seq_len": args.seq_len,
        "train.sample_tokens": 0, "run.dir": str(run_dir)})
    alternation = Alternation(bare_step(cfg.model, compiled, args.batch, args.seq_len))
    for _ in range(3):  # the bare model's compilation and first steps, before the trainer starts
        alternation.bare()
    # "terminal": the live progress bar `shardwise train` shows on a terminal, drawn to stderr
    console = Console(file=sys.stderr, force_terminal=True if args.console == "terminal" else None)
    train(cfg, console=console, after_step=alternation)
    logged = [json.loads(line)["step_time_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = args.batch * args.seq_len
    # loop_s[k] is the iteration of step k + 2 (the first has no hook before it)
    median = {"bare": statistics.median(alternation.bare_s[args.warmup:]),
              "trainer_loop": statistics.median(alternation.loop_s[args.warmup - 1:]),
              "trainer_logged": statistics.median(logged[args.warmup:])}
    result = {"compile": compiled, "timed_steps": args.steps, "progress_bar": console.is_terminal,
              "median_step_s": {k: round(v, 4) for k, v in median.items()},
              "tokens_per_s": {k: round(tokens / v) for k, v in median.items()},
              "trainer_over_bare": {k: round(v / median["bare"], 3) for k, v in median.items() if k != "bare"}}
    if args.per_step:  # from step 2 on, side by side: what a disturbed run looks like
        result["per_step_s"] = [[round(b, 4), round(loop, 4), round(log, 4)]
                                for b, loop, log in zip(alternation.bare_s[1:], alternation.loop_s, logged[1:])]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", default="both", choices=["both", "true", "false"])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per arm, after the warm-up")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--per-step", action="store_true", help="also print each step's bare, loop and logged times")
    parser.add_argument("--console", default="auto", choices=["auto", "terminal"],
                        help="terminal: draw the trainer's live progress bar (to stderr) even when it is no terminal")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = {"both": (False, True), "true": (True,), "false": (False,)}[args.compile]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="shardwise-overhead-") as tmp:
        results = [measure(args, compiled, Path(tmp) / f"compile-{compiled}") for compiled in modes]
    print(json.dumps({"bench": "trainer step vs bare step", "preset": args.preset, "batch": args.batch,
                      "seq_len": args.seq_len, "dtype": "float32", **machine(),
                      "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
                      "modes": results}, indent=2))


if __name__ == "__main__":
    main()
