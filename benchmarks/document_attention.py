"""Attention over packed batches (document masks) with each kernel of
`shardwise.models.common.document_mask`, beside plain causal attention on the same (unmasked)
batch: forward + backward of one attention call at a model's shapes.

    python benchmarks/document_attention.py [--device cpu|cuda] [--repeats N] [--shapes demo,...]

Kernels timed (each where it runs):
  causal         SDPA `is_causal=True` on the same q, k, v: the reference cost of an unmasked batch
  sdpa_mask      SDPA with the boolean [B, 1, S, S] document mask, eager (the CPU's kernel)
  flex_compiled  FlexAttention with a block mask, `torch.compile`d (on a CPU forward only: torch 2.13
                 has no FlexAttention backward there)
  varlen         `torch.nn.attention.varlen.varlen_attn` (flash attention over the documents as one
                 ragged batch; CUDA, 16-bit only)

Prints one JSON line per shape as it is measured, then one JSON object: per shape, milliseconds
per forward + backward (and per forward) of each kernel (the median of --repeats calls), the
milliseconds to build its mask (once per model forward, shared by every layer), each output's
largest difference from sdpa_mask's, and the kernel `document_kernel` picks for the device. Documents' lengths are drawn uniformly from 1..2 x `mean_document` and packed
into rows back to back (the last one of a row cut), seeded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time

import torch

from shardwise.models.common.attention import sdpa
from shardwise.models.common.document_mask import document_kernel, document_mask

SHAPES = {  # name: (batch, seq, query heads, kv heads, head dim, mean document length)
    "demo": (8, 512, 8, 4, 32, 64),
    "demo-long-docs": (8, 512, 8, 4, 32, 256),
    "llama3-1b": (8, 2048, 32, 8, 64, 256),
    "llama3-1b-long-docs": (8, 2048, 32, 8, 64, 1024),
}
DEVICE_SHAPES = {"cpu": "demo,demo-long-docs", "cuda": "llama3-1b,llama3-1b-long-docs"}


def packed_document_ids(batch: int, seq_len: int, mean_document: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] document ids: lengths uniform in 1..2*mean, packed back to back per row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq_len:
            lengths.append(int(torch.randint(1, 2 * mean_document + 1, (1,), generator=gen)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows.append(ids[:seq_len])
    return torch.stack(rows)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """The median of `repeats` timed calls after two warm-ups: a shared CPU's other work lengthens
    some calls, and the median leaves them out where a mean would not."""
    for _ in range(2):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention_calls(mask_of, causal: bool = False):
    """(forward, forward + backward) closures over q, k, v for one kernel's attention."""
    def forward(q, k, v):
        if causal:
            return sdpa(q, k, v, is_causal=True)
        return mask_of().attend(q, k, v)

    def forward_backward(q, k, v, grad):
        for t in (q, k, v):
            t.grad = None
        forward(q, k, v).backward(grad)
    return forward, forward_backward


def measure_kernel(name, q, k, v, grad, ids, window, repeats, *, backward: bool) -> dict:
    device = q.device
    kernel = {"sdpa_mask": "sdpa", "flex_compiled": "flex", "varlen": "varlen"}.get(name)
    mask = document_mask(ids, window=window, kernel=kernel) if kernel else None
    forward, forward_backward = attention_calls(lambda: mask, causal=kernel is None)
    result = {}
    # Forward alone on inputs that need no gradient (CPU FlexAttention refuses ones that do).
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    with torch.no_grad():
        result["forward_ms"] = round(time_ms(lambda: forward(q0, k0, v0), device, repeats), 3)
        out = forward(q0, k0, v0)
    if backward:
        result["forward_backward_ms"] = round(time_ms(lambda: forward_backward(q, k, v, grad), device, repeats), 3)
    else:
        result["forward_backward_ms"] = None
    if kernel:
        result["mask_build_ms"] = round(time_ms(lambda: document_mask(ids, window=window, kernel=kernel),
                                                device, repeats), 3)
    return result, out


def measure_shape(shape, device, dtype, repeats, window) -> dict:
    batch, seq, heads, kv_heads, head_dim, mean_document = shape
    torch.manual_seed(0)
    make = lambda h: torch.randn(batch, h, seq, head_dim, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)
    ids = packed_document_ids(batch, seq, mean_document).to(device)
    kernels = ["causal", "sdpa_mask", "flex_compiled"]
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        kernels.append("varlen")
    results, reference = {}, None
    for name in kernels:
        try:
            result, out = measure_kernel(name, q, k, v, grad, ids, window, repeats,
                                         backward=device.type == "cuda" or name != "flex_compiled")
        except Exception as error:  # noqa: BLE001 - a kernel this torch or device cannot run is reported
            results[name] = {"unsupported": str(error).splitlines()[0][:200]}
            continue
        if name == "sdpa_mask":
            reference = out
        elif reference is not None:
            result["max_diff_vs_sdpa_mask"] = float((out.float() - reference.float()).abs().max())
        results[name] = result
    return {"batch_seq_heads_kv_dim_meandoc": list(shape), "documents": int(ids.max(dim=1).values.sum()) + batch,
            "window": window, "results": results}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--window", type=int, default=0, help="a sliding window (0 = none)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    names = (args.shapes or DEVICE_SHAPES.get(device.type, "demo")).split(",")
    report = {"date": datetime.date.today().isoformat(), "commit": git_commit(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
              "document_kernel_picks": document_kernel(device), "shapes": {}}
    for name in names:
        report["shapes"][name] = measure_shape(SHAPES[name], device, dtype, args.repeats, args.window)
        print(json.dumps({name: report["shapes"][name]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
