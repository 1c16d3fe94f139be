"""Compiler speed on this machine, side by side in one process (issue 16 item 5).

    python benchmarks/compile_speed.py rmsnorm [--dtype float32|bfloat16] [--repeats 50] [--device cuda]
    python benchmarks/compile_speed.py step [--preset demo] [--layers N --dim D --vocab V]
                                            [--batch 8] [--seq-len 128] [--steps 15] [--autocast bfloat16]
                                            [--device cuda] [--models shardwise_compiled,transformers_eager]

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

`--device cuda` (issue 16 item 6): the same on the GPU, each model built, warmed up and timed in
turn and freed before the next (a 1B model's five copies with their AdamW states would not fit
together; a GPU's step time does not drift as this shared CPU's does, so turns are fair there),
timed with `torch.cuda.synchronize`; the step report adds the model FLOP utilisation against the
GPU's dense bf16 peak (`--peak-tflops`, 989 for the H100/H200 SXM datasheet) and peak memory.
`--models` picks which of the five to run.

`--floor` (CPU): also times, alternating with the models, the work any implementation of the step
must do, each part alone at the step's shapes: its matmuls (3 per linear: forward, input
gradient, weight gradient; `step_matmuls`), attention forward and backward (SDPA, causal, GQA,
as both shardwise and HF run it) and the optimizer (clip + fused AdamW over the same parameter
shapes). The report adds each model's step over that floor: what is left for compilation to
remove is the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from shardwise.models.common.attention import attention_kernel_order
from shardwise.models.families import counts_of


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")


def cpu_flags() -> list[str]:
    """The CPU features that decide bf16 speed (AMX: bf16 matrix units; avx512_bf16: bf16 dot
    products in the vector units)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [flag for flag in BF16_FLAGS if flag in flags]


def machine(device: str = "cpu") -> dict:
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fns: dict, repeats: int, warmup: int = 3, device: str = "cpu") -> dict[str, float]:
    """Median seconds of each function, calls alternating so all see the same machine state."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def composed_rms_norm(x, weight, eps: float = 1e-5):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def library_rms_norm(x, weight, eps: float = 1e-5):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def candidate_error(fn, device: str, dtype) -> str:
    """'' when `fn` runs forward and backward and agrees with the composition; else why not."""
    try:
        x = torch.randn(64, 4096, device=device, dtype=dtype, requires_grad=True)
        weight = torch.randn(4096, device=device, dtype=dtype, requires_grad=True)
        fn(x, weight).sum().backward()
        got = (fn(x, weight).float(), x.grad.float(), weight.grad.float())
        x.grad = weight.grad = None
        composed_rms_norm(x, weight).sum().backward()
        want = (composed_rms_norm(x, weight).float(), x.grad.float(), weight.grad.float())
        errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
        return "" if max(errors) < 2e-2 else f"differs from the composition: relative errors {errors}"
    except Exception as error:  # a candidate, not a dependency: report and go on
        return f"{type(error).__name__}: {error}"


def rmsnorm(args) -> dict:
    from shardwise.compile.rules.backend import FIRED, rules_backend

    dtype = getattr(torch, args.dtype)
    variants = {
        "composed_eager": composed_rms_norm,
        "F.rms_norm": library_rms_norm,
        "torch.compile": torch.compile(composed_rms_norm, dynamic=False),
        "rule": torch.compile(composed_rms_norm, backend=rules_backend, dynamic=False),
    }
    if args.device == "cuda":  # item 3's question: does a hand-written Triton kernel beat inductor's?
        from triton_rms_norm import AVAILABLE, triton_rms_norm
        if AVAILABLE:
            variants["triton_kernel"] = triton_rms_norm
            triton_error = candidate_error(triton_rms_norm, args.device, dtype)
            if triton_error:
                print(json.dumps({"triton_kernel_left_out": triton_error}), flush=True)
                del variants["triton_kernel"]
    # On a GPU the CPU's shapes take microseconds (launch-bound): there, a 1B-8B model's tokens x width.
    shapes = ((8192, 256), (4096, 1024), (2048, 4096)) if args.device == "cpu" else \
        ((16384, 2048), (8192, 4096), (16384, 8192))
    results = []
    for tokens, dim in shapes:
        torch.manual_seed(0)
        x = torch.randn(tokens, dim, dtype=dtype, device=args.device, requires_grad=True)
        weight = torch.randn(dim, dtype=dtype, device=args.device, requires_grad=True)
        grad = torch.randn(tokens, dim, dtype=dtype, device=args.device)

        def fwd_bwd(fn):
            def run():
                x.grad = weight.grad = None
                fn(x, weight).backward(grad)
            return run

        median = timed({name: fwd_bwd(fn) for name, fn in variants.items()}, args.repeats, device=args.device)
        results.append({"shape": [tokens, dim], "median_ms": {k: round(v * 1e3, 3) for k, v in median.items()},
                        "rule_speedup": {k: round(v / median["rule"], 2) for k, v in median.items() if k != "rule"}})
        if args.device == "cuda":  # the GPU's own time, without the host's launch and autograd overhead
            kernel = {name: top_kernels(fwd_bwd(fn), args.device, calls=args.repeats)["kernel_ms_per_call"]
                      for name, fn in variants.items()}
            results[-1]["kernel_ms"] = kernel
            results[-1]["rule_kernel_speedup"] = {k: round(v / kernel["rule"], 2) for k, v in kernel.items()
                                                  if k != "rule"}
    assert FIRED["rms_norm"] >= 3, f"the rms_norm rule did not fire on every shape: {dict(FIRED)}"
    return {"bench": "rmsnorm forward+backward", "dtype": args.dtype, **machine(args.device), "shapes": results}


def step_cfg(args):
    from shardwise.config.presets import model_config

    cfg = model_config(args.preset)
    changes = {"n_layers": args.layers, "dim": args.dim, "vocab_size": args.vocab}
    changes = {k: v for k, v in changes.items() if v}
    if args.dim:  # the demo's proportions at another width: head_dim 32, ffn ~2.75 dim
        changes.update(n_heads=args.dim // 32, n_kv_heads=args.dim // 64, ffn_dim=args.dim * 11 // 4)
    return dataclasses.replace(cfg, **changes)


MODELS = ("shardwise_compiled", "shardwise_compiled_no_rules", "shardwise_compiled_torch_attention_order",
          "shardwise_eager", "transformers_eager", "transformers_compiled")
"""shardwise's models run under the trainer's attention kernel order (cuDNN first on Hopper,
`attention_kernel_order`); `shardwise_compiled_torch_attention_order` under torch's own (flash first),
as HF's models do."""


def step_models(cfg, device: str, tokens, targets) -> dict:
    """name -> a function building (model, loss of the model) on `device`."""
    from shardwise.compile.regional import compile_blocks
    from shardwise.models.build import plan_of
    from shardwise.models.llama.model import build_model

    def full_loss(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def shardwise_compiled(rules: bool):
        model = build_model(cfg, device=device, seed=0).train()
        compile_blocks([model], plan_of(cfg), rules=rules)
        return model, lambda m: m(tokens, targets_BS=targets)

    def transformers_compiled():
        model = hf_model(cfg, device)
        compiled = torch.compile(model, dynamic=False)
        return model, lambda m: full_loss(compiled(input_ids=tokens).logits)

    return {
        "shardwise_compiled": lambda: shardwise_compiled(True),
        "shardwise_compiled_torch_attention_order": lambda: shardwise_compiled(True),
        "shardwise_compiled_no_rules": lambda: shardwise_compiled(False),
        "shardwise_eager": lambda: (build_model(cfg, device=device, seed=0).train(), lambda m: full_loss(m(tokens))),
        "transformers_eager": lambda: (hf_model(cfg, device), lambda m: full_loss(m(input_ids=tokens).logits)),
        "transformers_compiled": transformers_compiled,
    }


def step_matmuls(cfg, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every matmul in a training step of the Llama `cfg` over `tokens` tokens: each
    block's q, k, v, o, gate, up, down and the head, each forward (tokens x in -> out), input
    gradient (tokens x out -> in) and weight gradient (out x tokens -> in)."""
    from shardwise.core.model_counts import kv_width, q_width

    q, kv, f = q_width(cfg), kv_width(cfg), cfg.ffn_dim
    linears = [(cfg.dim, q), (cfg.dim, kv), (cfg.dim, kv), (q, cfg.dim), (cfg.dim, f), (cfg.dim, f), (f, cfg.dim)]
    linears = linears * cfg.n_layers + [(cfg.dim, cfg.vocab_size)]
    return [shape for d_in, d_out in linears
            for shape in ((tokens, d_in, d_out), (tokens, d_out, d_in), (d_out, tokens, d_in))]


def step_floor(cfg, batch: int, seq_len: int) -> dict:
    """name -> a function running one part of the step's irreducible work (see the module
    docstring, `--floor`), on CPU in fp32."""
    torch.manual_seed(0)
    matrices = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in step_matmuls(cfg, batch * seq_len)]
    q = torch.randn(batch, cfg.n_heads, seq_len, cfg.head_size, requires_grad=True)
    k, v = (torch.randn(batch, cfg.n_kv_heads, seq_len, cfg.head_size, requires_grad=True) for _ in "kv")
    grad_out = torch.randn_like(q)
    params = [torch.nn.Parameter(torch.randn_like(p)) for p in hf_model(cfg, "cpu").parameters()]
    for p in params:  # made once: the floor holds no allocation of them
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def matmuls():
        for a, b in matrices:
            torch.mm(a, b)

    def attention():
        for _ in range(cfg.n_layers):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out)

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return {"floor_matmuls": matmuls, "floor_attention": attention, "floor_optimizer": optimizer_step}


def hf_model(cfg, device: str):
    from step_vs_hf import hf_model as build_hf

    with torch.device(device):
        return build_hf(cfg)


def train_step(model, loss_of, autocast: bool, device: str, kernel_order=contextlib.nullcontext):
    # fused AdamW for all: shardwise's default, and HF Trainer's (adamw_torch_fused) since torch 2.8
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def run():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), kernel_order():
            loss = loss_of(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


def top_kernels(fn, device: str, calls: int = 2, top: int = 25) -> dict:
    """The GPU kernels of `calls` calls of `fn` by total time: the top ones' milliseconds per call and
    share, and the share of each kind (matmul, attention, the rest)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    launched_by = {}  # kernel name -> {the op that launched it, with its input shapes: milliseconds}
    for event in prof.events():
        for kernel in getattr(event, "kernels", []):
            ops = launched_by.setdefault(kernel.name, {})
            op = f"{event.name} {event.input_shapes}"[:120]
            ops[op] = ops.get(op, 0.0) + kernel.duration / 1e3 / calls
    kernels = {}
    for event in prof.events():  # kernel_ms_per_call keeps 3 decimals: an RMSNorm takes ~0.1 ms
        # kernels only: not the annotations the profiler also puts on the GPU's timeline
        # ("## Call CompiledFxGraph ...", "Optimizer.step#AdamW.step"), which span kernels
        if event.device_type == torch.autograd.DeviceType.CUDA and "#" not in event.name:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3 / calls
    total = sum(kernels.values())
    kinds = {"matmul": ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas"), "attention": ("flash", "fmha", "cudnn",
                                                                                          "attention")}
    by_kind = {kind: 0.0 for kind in (*kinds, "other")}
    for name, ms in kernels.items():
        kind = next((k for k, marks in kinds.items() if any(m in name.lower() for m in marks)), "other")
        by_kind[kind] += ms
    ranked = sorted(kernels.items(), key=lambda item: -item[1])[:top]
    return {"kernel_ms_per_call": round(total, 3),
            "share_by_kind": {k: round(v / total, 3) for k, v in by_kind.items()},
            "top": [[name[:90], round(ms, 3), round(ms / total, 3),
                     sorted(launched_by.get(name, {}).items(), key=lambda item: -item[1])[:2]] for name, ms in ranked]}


def step(args) -> dict:
    cfg = step_cfg(args)
    device, autocast = args.device, args.autocast == "bfloat16"
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=device)
    builders = step_models(cfg, device, tokens, targets)
    names = args.models.split(",") if args.models else list(MODELS)
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models {','.join(unknown)} is invalid: use some of {','.join(MODELS)}")

    def built(name):
        model, loss_of = builders[name]()
        assert sum(p.numel() for p in model.parameters()) == counts_of(cfg).num_params(), name
        trainer_order = name.startswith("shardwise") and name != "shardwise_compiled_torch_attention_order"
        kernel_order = (lambda: attention_kernel_order(torch.device(device))) if trainer_order else contextlib.nullcontext
        return train_step(model, loss_of, autocast, device, kernel_order)

    if args.floor and (device != "cpu" or autocast):
        raise SystemExit("--floor is for the CPU fp32 step: drop --floor, or --device cuda / --autocast bfloat16")
    median, peak_gib, floor = {}, {}, {}
    if device == "cpu":  # alternating: this shared CPU's speed drifts within minutes
        floor = step_floor(cfg, args.batch, args.seq_len) if args.floor else {}
        median = timed({**{name: built(name) for name in names}, **floor}, args.steps)
        floor = {part: median.pop(part) for part in floor}
    else:  # one model at a time (memory); the GPU does not drift
        for name in names:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            run = built(name)
            median.update(timed({name: run}, args.steps, device=device))
            peak_gib[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            print(json.dumps({name: median[name], "peak_gib": peak_gib[name]}), flush=True)
            if args.profile:
                print(json.dumps({f"{name} kernels": top_kernels(run, device)}), flush=True)
            del run
            torch._dynamo.reset()  # its caches hold the model: free it before the next
            gc.collect()
    tokens_per_step = args.batch * args.seq_len
    report = {
        "bench": "train step", "autocast": args.autocast, "device": device, **machine(device),
        "transformers": __import__("transformers").__version__,
        "model": {"layers": cfg.n_layers, "dim": cfg.dim, "vocab": cfg.vocab_size, "params": counts_of(cfg).num_params()},
        "batch": args.batch, "seq_len": args.seq_len,
        "median_step_s": {k: round(v, 4) for k, v in median.items()},
        "tokens_per_s": {k: round(tokens_per_step / v) for k, v in median.items()},
    }
    if floor:
        total = sum(floor.values())
        report["floor_s"] = {**{k.removeprefix("floor_"): round(v, 4) for k, v in floor.items()}, "total": round(total, 4)}
        report["step_over_floor"] = {k: round(v / total, 3) for k, v in median.items()}
    if "shardwise_compiled" in median:
        report["shardwise_compiled_speedup"] = {k: round(v / median["shardwise_compiled"], 3)
                                                for k, v in median.items() if k != "shardwise_compiled"}
    if device == "cuda":
        flops = counts_of(cfg).flops_per_token(args.seq_len) * tokens_per_step
        report["mfu_vs_peak_tflops"] = args.peak_tflops
        report["mfu"] = {k: round(flops / v / (args.peak_tflops * 1e12), 4) for k, v in median.items()}
        report["peak_memory_gib"] = peak_gib
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    norm = sub.add_parser("rmsnorm")
    norm.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    norm.add_argument("--repeats", type=int, default=50)
    norm.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    train = sub.add_parser("step")
    train.add_argument("--preset", default="demo")
    train.add_argument("--layers", type=int, default=0)
    train.add_argument("--dim", type=int, default=0)
    train.add_argument("--vocab", type=int, default=0)
    train.add_argument("--batch", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=128)
    train.add_argument("--steps", type=int, default=15, help="timed steps per model (after 3 warm-up steps)")
    train.add_argument("--autocast", default="float32", choices=["float32", "bfloat16"])
    train.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    train.add_argument("--models", default="", help=f"comma-separated, of {','.join(MODELS)} (default: all)")
    train.add_argument("--profile", action="store_true", help="on cuda: print each model's top GPU kernels")
    train.add_argument("--peak-tflops", type=float, default=989.0,
                       help="the GPU's dense bf16 peak for the MFU figure (H100/H200 SXM: 989)")
    train.add_argument("--floor", action="store_true",
                       help="CPU, fp32: also time the step's matmuls, attention and optimizer alone")
    args = parser.parse_args()
    print(json.dumps(rmsnorm(args) if args.bench == "rmsnorm" else step(args), indent=2))


if __name__ == "__main__":
    main()
