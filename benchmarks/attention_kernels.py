"""SDPA's kernels side by side on a GPU: causal attention forward + backward at Llama training
shapes, for each kernel torch has (flash, cuDNN, memory-efficient), with the kv heads passed as
they are (`enable_gqa`) or repeated to the query heads. Each kernel runs alone (no fallback), so
a kernel that cannot take a case says so instead of silently timing another.

    python benchmarks/attention_kernels.py [--repeats 20]

Prints one JSON object: milliseconds per forward + backward (CUDA events over `--repeats` calls),
each result's largest difference from flash's (output and gradients), and the kernel
`shardwise.models.common.attention.attention_kernel_order` makes SDPA pick on this GPU. This is
the measurement behind that order (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.models.common.attention import attention_kernel_order, sdpa

SHAPES = {  # name: (batch, seq, query heads, kv heads, head dim)
    "llama3-1b": (8, 2048, 32, 8, 64),
    "llama3-8b": (2, 4096, 32, 8, 128),
}
KERNELS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def inputs(batch, seq, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    make = lambda h: torch.randn(batch, h, seq, head_dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                 requires_grad=True)
    return make(heads), make(kv_heads), make(kv_heads), torch.randn(batch, heads, seq, head_dim, device="cuda",
                                                                    dtype=torch.bfloat16)


def attend(q, k, v, gqa: str):
    if gqa == "native":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeats = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1),
                                          is_causal=True)


def forward_backward(fn, q, k, v, grad):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def picked_kernel(q, k, v) -> str:
    """The attention kernel `attention_kernel_order` leads SDPA to, read from the profiler."""
    with attention_kernel_order(q.device), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        sdpa(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if "scaled_dot_product" in e.key]
    return ", ".join(sorted(set(names)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "shapes": {}}
    for name, shape in SHAPES.items():
        q, k, v, grad = inputs(*shape)
        results, reference = {}, None
        for kernel in KERNELS:
            for gqa in ("native", "repeated"):
                label = f"{kernel.lower()}/{gqa}"
                fn = lambda: forward_backward(lambda a, b, c: attend(a, b, c, gqa), q, k, v, grad)  # noqa: E731
                try:
                    with sdpa_kernel([getattr(SDPBackend, kernel)]):
                        got = fn()
                        ms = time_ms(fn, args.repeats)
                except RuntimeError as error:  # this kernel cannot take the case
                    results[label] = {"unsupported": str(error).splitlines()[0][:160]}
                    continue
                reference = reference or got
                diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, reference))
                results[label] = {"ms": round(ms, 3), "max_diff_vs_first": diff}
        causal_flops = 4 * shape[0] * shape[2] * shape[1] ** 2 * shape[4] / 2 * 3.5  # fwd + bwd (2.5x fwd)
        for result in results.values():
            if "ms" in result:
                result["tflops"] = round(causal_flops / result["ms"] / 1e9, 1)
        report["shapes"][name] = {"batch_seq_heads_kv_dim": shape, "results": results,
                                  "attention_kernel_order_picks": picked_kernel(q, k, v)}
        print(json.dumps({name: report["shapes"][name]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
