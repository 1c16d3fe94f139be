"""`shardwise estimate`, `shardwise plan` and `shardwise calibrate`: argument parsing and output.

estimate and plan import no torch (the planner is pure Python), so `estimate --jsonl` answers
thousands of lines a minute; calibrate imports torch only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardwise.cli.flag_types import finite_above, integer_at_least, positive_int, probability_below_one
from shardwise.models.families import counts_of
from shardwise.planner.estimate import estimate_from_specs
from shardwise.planner.adapters import trainable_params
from shardwise.planner.hardware import resolve_hardware
from shardwise.planner.layout import Layout
from shardwise.planner.memory import GIB
from shardwise.planner.model_resolution import resolve_model, resolve_model_and_name


def add_estimate_parser(sub) -> None:
    p = sub.add_parser("estimate", help="predict whether a layout fits and how fast it runs (no torch, no devices)",
                       description="Predict per-rank peak memory and step time of a layout, with breakdowns. "
                                   "--jsonl reads {\"model\", \"layout\", \"hardware\"} objects, one per line, "
                                   "from standard input and writes one result per line.")
    p.add_argument("--model", help="a preset name, a shardwise model config or HF config.json (JSON object or file)")
    p.add_argument("--layout", help="a JSON object (or file) of dp, tp, pp, cp, ep, zero, micro_batch, grad_accum, "
                                    "seq_len, recompute, pp_schedule, virtual_stages, sp, dtype, grad_accum_dtype, "
                                    "compile, chunked_loss, lora_rank, lora_targets, lora_base_dtype, lora_dropout, "
                                    "packed")
    p.add_argument("--hardware", default="h100-80gb",
                   help="a preset (h100-80gb, h200-141gb, a100-40gb, a100-80gb, cpu), a JSON object or a "
                        ".toml/.json file, e.g. from `shardwise calibrate` (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--jsonl", action="store_true", help="batch mode: JSON lines in on stdin, JSON lines out")
    p.set_defaults(func=cmd_estimate)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank every layout of N devices for a model and a batch",
                       description="Enumerate the layouts of --devices for the model and batch, drop those that "
                                   "do not fit, rank the rest by predicted tokens/s per device.")
    p.add_argument("--model", required=True, help="a preset name, a shardwise model config or HF config.json")
    p.add_argument("--devices", type=positive_int, required=True, help="number of devices (GPUs or processes)")
    p.add_argument("--hardware", default="h100-80gb", help="a preset, a JSON object or a file (default: %(default)s)")
    p.add_argument("--global-batch-tokens", type=positive_int, required=True, help="tokens per optimizer step")
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="parameter dtype (default: %(default)s)")
    p.add_argument("--grad-accum-dtype", default="", choices=["", "fp32", "bf16"],
                   help="gradient-accumulation buffer dtype ('' = the parameter dtype)")
    p.add_argument("--compile", action="store_true",
                   help="blocks compiled with the rewrite rules (train.compile): dense blocks keep fewer activations")
    p.add_argument("--full-logits", action="store_true",
                   help="model the loss on full logits (train.chunked_loss = false); by default the loss is "
                        "chunked where the runtime chunks it (no pp), as the trainer's default")
    p.add_argument("--lora-rank", type=integer_at_least(0, "use 0 (no LoRA) or a rank, e.g. 8"), default=0,
                   help="LoRA (train.lora_rank): only rank-r adapters train, the base is frozen (default: 0, no LoRA)")
    p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down",
                   help="roles that get adapters (train.lora_targets; default: %(default)s)")
    p.add_argument("--lora-base-dtype", default="", choices=["", "fp32", "bf16", "float32", "bfloat16"],
                   help="dtype of the adapted linears' frozen weights (train.lora_base_dtype; '' = --dtype)")
    p.add_argument("--lora-dropout", type=probability_below_one("use a probability in [0, 1)"), default=0.0,
                   help="train.lora_dropout: above 0 each adapter keeps its dropped-out input (default: 0)")
    p.add_argument("--packed", action="store_true",
                   help="packed sequences with document masks (data.packing, data.document_mask): no padding; "
                        "masked attention counted at causal attention's FLOPs (every score on a CPU)")
    p.add_argument("--all-layouts", action="store_true",
                   help="also layouts the shardwise runtime refuses today (e.g. ZeRO-1 with tensor parallelism)")
    p.add_argument("--top", type=integer_at_least(1, "use a positive number of rows"), default=10, help="rows to show (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_plan)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (matmul FLOP/s, memory and collective bandwidth)",
                       description="Measure matmul FLOP/s, memory bandwidth and collective bus bandwidth over "
                                   "N local processes (gloo on CPU, NCCL on GPUs) and write a hardware file "
                                   "that --hardware and parallel.mode = auto accept.")
    p.add_argument("--out", default="hardware.toml", help="file to write, .toml or .json (default: %(default)s)")
    p.add_argument("--nproc", type=integer_at_least(2, "collectives need at least 2 processes"), default=2, help="processes for the collective measurements (default: 2)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    p.add_argument("--size-mb", type=finite_above(0, "use a size in MiB above 0, at most 1 TiB", at_most=2**20), default=16.0, help="message size of the collectives (default: 16)")
    p.add_argument("--name", default="", help="name written into the file (default: local-<device>)")
    p.set_defaults(func=cmd_calibrate)


def format_estimate(result: dict) -> str:
    fits = "fits" if result["fits"] else "DOES NOT FIT"
    memory = result["memory_gib"]
    trainable = f", {result['trainable_params']:,} trainable" if "trainable_params" in result else ""
    lines = [f"{result['layout']} on {result['world_size']} devices: {fits} "
             f"(peak {result['peak_memory_gib']:.2f} GiB of {memory['device'] - memory['reserved_by_runtime']:.1f} usable"
             f"{trainable})",
             f"step {result['step_time_s']:.4g} s, {result['tokens_per_s_per_device']:,.0f} tokens/s/device, "
             f"MFU {result['mfu']:.1%}",
             "memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in memory.items()
                                         if v and k not in ("device", "reserved_by_runtime")),
             "time (s/step): " + ", ".join(f"{k} {v:.4g}" for k, v in result["time_s"].items() if v)]
    return "\n".join(lines)


def cmd_estimate(args: argparse.Namespace) -> None:
    if args.jsonl:
        if args.model or args.layout:
            raise ValueError("--jsonl reads model, layout and hardware from each input line: "
                             "leave out --model and --layout")
        run_jsonl(sys.stdin, sys.stdout, default_hardware=args.hardware)
        return
    for flag in ("model", "layout"):
        if not getattr(args, flag):
            raise ValueError(f"--{flag} is missing: give it (or use --jsonl)")
    result = estimate_from_specs(args.model, args.layout, args.hardware).to_json()
    print(json.dumps(result, indent=2) if args.json else format_estimate(result))


def run_jsonl(lines, out, *, default_hardware: str) -> int:
    """One result per input line, in order; a bad line gets {"error": ...} and the rest go on.
    Models and hardware seen before are reused (resolving them is most of the cost of a line)."""
    models, hardwares, count = {}, {}, 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        count += 1
        try:
            try:
                request = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--jsonl line {number} is not JSON: {err}") from None
            if not isinstance(request, dict) or "model" not in request or "layout" not in request:
                raise ValueError(f"--jsonl line {number} is invalid: give an object with model, layout (and hardware)")
            model_key = json.dumps(request["model"], sort_keys=True)
            if model_key not in models:
                models[model_key] = resolve_model(request["model"])
            hardware_spec = request.get("hardware", default_hardware)
            hardware_key = json.dumps(hardware_spec, sort_keys=True)
            if hardware_key not in hardwares:
                hardwares[hardware_key] = resolve_hardware(hardware_spec)
            result = estimate_from_specs(models[model_key], request["layout"], hardwares[hardware_key]).to_json()
        except (ValueError, FileNotFoundError) as err:
            result = {"error": str(err)}
        out.write(json.dumps(result) + "\n")
    out.flush()
    return count


def cmd_plan(args: argparse.Namespace) -> None:
    from shardwise.planner.search import PlanRequest, plan, why_it_wins

    model, name = resolve_model_and_name(args.model)
    request = PlanRequest(model=model, model_name=name, hardware=resolve_hardware(args.hardware),
                          devices=args.devices, global_batch_tokens=args.global_batch_tokens, seq_len=args.seq_len,
                          dtype=args.dtype, grad_accum_dtype=args.grad_accum_dtype,
                          compile=args.compile, chunked_loss=not args.full_logits,
                          runtime_only=not args.all_layouts, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                          lora_base_dtype=args.lora_base_dtype, lora_dropout=args.lora_dropout,
                          packed=args.packed).validate()
    results, considered = plan(request)
    top = results[: args.top]
    if args.json:
        print(json.dumps({"considered": considered, "fitting": len(results), "why": why_it_wins(results),
                          "layouts": [{**r.to_json(), "layout": r.layout.to_dict(), "description": r.layout.describe()}
                                      for r in top]}, indent=2))
        return
    print(f"{request.model_name}: {counts_of(request.model).num_params() / 1e9:.2f}B parameters{adaptation_note(request)} "
          f"on {args.devices} x {request.hardware.name}, {args.global_batch_tokens:,} tokens per step of "
          f"{args.seq_len}-token sequences; {considered} layouts considered, {len(results)} fit")
    print(format_plan_table(top))
    print(why_it_wins(results))


def adaptation_note(request) -> str:
    """What `plan`'s first line adds for LoRA (the trainable count) and packing (what it assumes)."""
    note = ""
    if request.lora_rank:
        trainable = trainable_params(request.model, request.lora_rank, Layout(**request.adaptation()).lora_roles)
        note += (f" ({trainable:,} trainable: LoRA rank {request.lora_rank} on {request.lora_targets}, "
                 f"the base frozen)")
    if request.packed:
        note += (" in packed sequences (no padding; document-masked attention at causal attention's FLOPs, "
                 "every score on a CPU)")
    return note


def format_plan_table(results) -> str:
    header = (f"{'#':>3} {'layout':<62} {'tok/s/dev':>10} {'MFU':>5} {'step s':>8} {'peak GiB':>8} "
              f"{'states':>7} {'activ':>7} {'compute':>8} {'comm':>7} {'bubble':>7}")
    lines = [header, "-" * len(header)]
    for rank, r in enumerate(results, 1):
        m, t = r.memory.breakdown, r.time.breakdown
        states = r.memory.peak - sum(m[k] for k in ("activations", "logits", "loss_workspace", "backward_workspace",
                                                      "allocator_overhead"))
        comm = sum(t[k] for k in ("tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm"))
        lines.append(f"{rank:>3} {r.layout.describe():<62} {r.tokens_per_s_per_device:>10,.0f} {r.mfu:>5.0%} "
                     f"{r.step_time_s:>8.3f} {r.memory.peak / GIB:>8.2f} {states / GIB:>7.2f} "
                     f"{(m['activations'] + m['logits']) / GIB:>7.2f} {t['compute'] + t['recompute']:>8.3f} "
                     f"{comm:>7.3f} {t['pipeline_bubble']:>7.3f}")
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from shardwise.train.calibrate import calibrate

    calibrate(out=args.out, nproc=args.nproc, device=args.device, size_mb=args.size_mb, name=args.name)
