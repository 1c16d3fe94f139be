"""The estimator against the runtime on this machine: predicted vs measured memory and step time.

    python benchmarks/estimator_validation.py [--hardware FILE] [--steps 6] [--out FILE] [--markdown]

Runs each layout of LAYOUTS with the ordinary trainer on one pool of 2 gloo processes (one
CPU thread each), on the demo model (and a 4-expert MoE variant for expert parallelism), and
compares rank 0's figures with the planner's for the same model, layout and hardware:

- memory: measured = parameter + gradient + optimizer bytes (`observe.memory.state_memory`, in
  metrics.jsonl) + the activation bytes held for backward at their peak (`observe.activations`:
  autograd's saved tensors for one forward + loss; over the whole schedule for pipelines; with
  recomputation, whose caches saved-tensor hooks cannot see, the tensors left alive after
  forward less those alive but not held for backward, measured without recomputation). Predicted = params + grads + grad_accum_buffer + optimizer + activations + logits of
  `planner.memory.rank_memory` for pipeline rank 0. The transient terms (loss and backward
  workspace, allocator overhead) are left out of both: torch keeps no allocation statistics on
  CPU, so there is no measured peak to hold them against.
- step time: measured = median `step_time_s` of steps 2..N; predicted = `planner.step_time`
  with the hardware measured by `shardwise calibrate` (run first, unless --hardware is given).

Prints one JSON object (and with --markdown the table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardwise.config.loader import load_config  # noqa: E402
from shardwise.runtime.worker_pool import WorkerPool  # noqa: E402
from shardwise.planner.hardware import resolve_hardware  # noqa: E402
from shardwise.planner.layout import Layout  # noqa: E402
from shardwise.planner.memory import rank_memory  # noqa: E402
from shardwise.planner.step_time import step_time  # noqa: E402
from shardwise.train.trainer import train  # noqa: E402

MOE = {"model.n_experts": 4, "model.experts_per_token": 2}
LAYOUTS = {
    "dp2 zero0": {},
    "dp2 zero1": {"parallel.zero": 1},
    "dp2 zero2": {"parallel.zero": 2},
    "dp2 zero3": {"parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "tp2 sp": {"parallel.tp": 2, "parallel.sp": True},
    "pp2 1f1b": {"parallel.pp": 2},
    "pp2 gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
    "pp2 interleaved v2": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2},
    "cp2 ring": {"parallel.cp": 2},
    "cp2 all-to-all": {"parallel.cp": 2, "parallel.cp_mode": "alltoall"},
    "dp2 recompute full": {"train.recompute": "full"},
    "dp2 recompute selective": {"train.recompute": "selective"},
    "dp2 (MoE, no ep)": dict(MOE),
    "dp2 ep2 (MoE)": {"parallel.ep": 2, **MOE},
    "dp2 zero3 ep2 (MoE)": {"parallel.ep": 2, "parallel.zero": 3, **MOE},
    "dp2 zero1 ep2 (MoE)": {"parallel.ep": 2, "parallel.zero": 1, **MOE},
}


def overrides_for(out: Path, name: str, extra: dict, *, steps: int, micro_batch: int, seq_len: int) -> dict:
    world, values = 2, dict(extra)
    split = values.get("parallel.tp", 1) * values.get("parallel.pp", 1) * values.get("parallel.cp", 1)
    dp = world // split
    accumulation = 4 if values.get("parallel.pp", 1) > 1 else 2
    return {
        "model.preset": "demo", "train.steps": steps, "train.micro_batch_size": micro_batch,
        "train.global_batch_size": micro_batch * dp * accumulation, "train.seq_len": seq_len,
        "train.sample_tokens": 0, "train.device": "cpu", "checkpoint.at_end": False,
        "run.dir": str(out / name.replace(" ", "-").replace("(", "").replace(")", "")), "run.progress": False,
        "train.log_every": 10_000, **values,
    }


def run_training(overrides: dict) -> None:
    train(load_config(overrides=overrides))


def measure_activations(overrides: dict) -> int:
    """This rank's peak activation bytes for the layout (see the module docstring)."""
    from shardwise.observe.activations import layout_activation_bytes, pipeline_peak_activation_bytes

    cfg = load_config(overrides=overrides)
    if cfg.parallel.pp > 1:
        return pipeline_peak_activation_bytes(cfg)["peak_bytes"]
    if cfg.train.recompute != "none":
        # Saved-tensor hooks miss a selective-recompute cache; count what stays alive instead, less
        # what stays alive without being held for backward (the logits, ...), measured on the same
        # layout without recomputation as alive - saved.
        plain = load_config(overrides={**overrides, "train.recompute": "none"})
        not_held = alive_after_forward_bytes(plain) - layout_activation_bytes(plain)
        return alive_after_forward_bytes(cfg) - not_held
    return layout_activation_bytes(cfg)


def alive_after_forward_bytes(cfg) -> int:
    """Bytes of the tensors a forward + loss leaves alive (LiveOutputBytes), minus the inputs."""
    import torch
    import torch.distributed as dist

    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    from shardwise.models.common.loss import loss_of
    from shardwise.observe.activations import LiveOutputBytes

    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    device = torch.device("cpu")
    dp = parallelize_config(cfg, dims, device=device)
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.train.seq_len)
    inputs, targets = (torch.randint(0, cfg.model.vocab_size, shape, generator=gen) for _ in range(2))
    with LiveOutputBytes() as live:
        with dp.loss_context():
            loss = loss_of(dp.module, inputs, targets, autocast_dtype=cfg.train.autocast_dtype, device=device)
        held = live.sample()
    del loss
    return held


def planner_layout(cfg, world: int) -> Layout:
    p, t = cfg.parallel, cfg.train
    dp = world // (p.tp * p.pp * p.cp)
    return Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, dp_replicate=p.dp_replicate,
                  micro_batch=t.micro_batch_size, grad_accum=t.global_batch_size // (t.micro_batch_size * dp),
                  seq_len=t.seq_len, recompute=t.recompute, pp_schedule=p.pp_schedule,
                  virtual_stages=p.pp_virtual_stages, sp=p.sp, cp_mode=p.cp_mode, dtype="fp32",
                  compute_dtype="bf16" if t.autocast_dtype == "bfloat16" else "",
                  chunked_loss=t.chunked_loss).validate()


def compare(name: str, overrides: dict, activation_bytes: list[int], hardware) -> dict:
    cfg = load_config(overrides=overrides)
    records = [json.loads(line) for line in (Path(overrides["run.dir"]) / "metrics.jsonl").read_text().splitlines()]
    measured_states = sum(records[0][f"{k}_bytes"] for k in ("params", "grads", "optimizer"))
    measured_memory = measured_states + activation_bytes[0]
    measured_time = statistics.median(r["step_time_s"] for r in records[1:])
    model = cfg.model
    layout = planner_layout(cfg, 2)
    memory = rank_memory(model, layout, 0).breakdown
    predicted_states = sum(memory[k] for k in ("params", "grads", "grad_accum_buffer", "optimizer"))
    predicted_memory = predicted_states + memory["activations"] + memory["logits"]
    predicted_time = step_time(model, layout, hardware).step
    return {
        "layout": name, "planner_layout": layout.describe(),
        "measured_states_mib": measured_states / 2**20, "predicted_states_mib": predicted_states / 2**20,
        "measured_activations_mib": activation_bytes[0] / 2**20,
        "predicted_activations_mib": (memory["activations"] + memory["logits"]) / 2**20,
        "measured_memory_mib": measured_memory / 2**20, "predicted_memory_mib": predicted_memory / 2**20,
        "memory_error": predicted_memory / measured_memory - 1,
        "measured_step_s": measured_time, "predicted_step_s": predicted_time,
        "time_error": predicted_time / measured_time - 1,
    }


def markdown(report: dict) -> str:
    lines = ["| layout | memory measured (MiB) | predicted | error | of which activations measured / predicted | "
             "step measured (s) | predicted | error |", "|---|---|---|---|---|---|---|---|"]
    for r in report["layouts"]:
        lines.append(f"| {r['layout']} | {r['measured_memory_mib']:.2f} | {r['predicted_memory_mib']:.2f} | "
                     f"{r['memory_error']:+.1%} | {r['measured_activations_mib']:.2f} / "
                     f"{r['predicted_activations_mib']:.2f} | {r['measured_step_s']:.3f} | "
                     f"{r['predicted_step_s']:.3f} | {r['time_error']:+.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", help="a hardware file from `shardwise calibrate` (default: calibrate now)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="layout names to run, each quoted (default: all)")
    parser.add_argument("--markdown", action="store_true", help="also print the table for docs/benchmarks.md")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    names = args.only or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:  # before calibrating: bad input stops before any work
        parser.exit(2, f"estimator_validation.py: error: --only {unknown[0]!r} is invalid: use one of {', '.join(LAYOUTS)}\n")
    out = Path(tempfile.mkdtemp(prefix="estimator-validation-"))
    if args.hardware:
        hardware = resolve_hardware(args.hardware)
    else:
        from shardwise.train.calibrate import calibrate

        hardware = calibrate(out=str(out / "hardware.toml"), nproc=2, device="cpu", size_mb=16, name="")
    results = []
    with WorkerPool(2) as pool:
        for name in names:
            overrides = overrides_for(out, name, LAYOUTS[name], steps=args.steps, micro_batch=args.micro_batch,
                                      seq_len=args.seq_len)
            pool.run(run_training, overrides)
            activation_bytes = pool.run(measure_activations, overrides)
            results.append(compare(name, overrides, activation_bytes, hardware))
            print(json.dumps(results[-1]), flush=True)
    memory_errors = [abs(r["memory_error"]) for r in results]
    time_errors = [abs(r["time_error"]) for r in results]
    report = {"hardware": hardware.to_dict(), "load_average_1_5_15": os.getloadavg(), "layouts": results,
              "memory_median_abs_error": statistics.median(memory_errors), "memory_max_abs_error": max(memory_errors),
              "layouts_within_10pct_memory": sum(e <= 0.10 for e in memory_errors),
              "time_median_abs_error": statistics.median(time_errors)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.markdown:
        print(markdown(report))


if __name__ == "__main__":
    main()
