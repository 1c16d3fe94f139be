"""`shardwise calibrate`: measure this machine and write a hardware file for the planner.

Measured, per rank of `nproc` local processes (gloo on CPU, NCCL on GPUs), each with its share
of the CPU threads as the trainer's worker processes have:

- matmul FLOP/s in fp32 and bf16: `train.metrics.measure_matmul_flops` (best of short trials of
  a square matmul); written as the peaks, with matmul_efficiency = 1 (the planner then takes
  the measured rate as what a training matmul reaches);
- memory bandwidth: a large tensor copy, 2 x bytes / time;
- bus bandwidth of all-reduce, all-gather, reduce-scatter, all-to-all (nccl-tests' formulas:
  busbw = S/t x 2(n-1)/n for all-reduce, S/t x (n-1)/n for the others) and point-to-point
  (rank 0 -> 1, S/t), median of a few timed repetitions of an S-byte message;
- latency: the median time of an 8-byte all-reduce.

All processes run on this machine, so the same figures are written for "intra" and "inter".
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from shardwise.planner.hardware import COLLECTIVES, Hardware

REPEATS = 5


def _timed(fn, repeats: int = REPEATS) -> float:
    import torch.distributed as dist

    fn()  # warm-up (connections, buffers)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_collectives(size_bytes: int, device_type: str) -> dict:
    """Runs on every rank of a pool: {collective: bus bytes/s, "latency_s": seconds}."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, rank if device_type == "cuda" else 0) if device_type != "cpu" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    elements = max(n, size_bytes // 4 // n * n)
    x = torch.ones(elements, device=device)
    gathered = torch.empty(elements * n, device=device)
    shard = torch.empty(elements // n, device=device)
    swapped = torch.empty_like(x)
    tiny = torch.ones(2, device=device)
    size = elements * 4

    def run(fn):
        def call():
            fn()
            sync()
        return _timed(call)

    factor = (n - 1) / n
    result = {
        "all_reduce": size / run(lambda: dist.all_reduce(x)) * 2 * factor,
        "all_gather": size * n / run(lambda: dist.all_gather_into_tensor(gathered, x)) * factor,
        "reduce_scatter": size / run(lambda: dist.reduce_scatter_tensor(shard, x)) * factor,
        "all_to_all": size / run(lambda: dist.all_to_all_single(swapped, x)) * factor,
    }

    def p2p():
        if rank == 0:
            dist.send(x, 1)
        elif rank == 1:
            dist.recv(x, 0)

    result["p2p"] = size / run(p2p)
    result["latency_s"] = run(lambda: dist.all_reduce(tiny))
    return result


def measure_device(device_type: str, threads: int) -> dict:
    import torch

    from shardwise.train.metrics import measure_matmul_flops

    torch.set_num_threads(threads)
    device = torch.device(device_type)
    fp32 = measure_matmul_flops(device, torch.float32, trial_s=0.2)
    bf16 = measure_matmul_flops(device, torch.bfloat16, trial_s=0.2)
    a = torch.empty(32 * 2**20, device=device)
    b = torch.empty_like(a)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        a.copy_(b)
        sync()
        best = min(best, time.perf_counter() - start)
    return {"fp32": fp32, "bf16": bf16, "memory_bandwidth": 2 * a.numel() * 4 / best}


def device_memory(device_type: str, nproc: int) -> float:
    if device_type == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / nproc  # the processes share the machine's memory


def to_toml(values: dict) -> str:
    def scalar(v):
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)

    flat = [f"{k} = {scalar(v)}" for k, v in values.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "\n".join(f"{kk} = {scalar(vv)}" for kk, vv in v.items())
              for k, v in values.items() if isinstance(v, dict)]
    return "\n".join(flat) + "\n" + "\n".join(tables) + "\n"


def calibrate(*, out: str, nproc: int, device: str, size_mb: float, name: str) -> Hardware:
    import json

    import torch

    from shardwise.runtime.worker_pool import WorkerPool

    path = Path(out)
    if path.suffix not in (".toml", ".json"):
        raise ValueError(f"--out = {out!r} is invalid: name a .toml or .json file")
    if nproc < 2:
        raise ValueError(f"--nproc = {nproc} is invalid: collectives need at least 2 processes")
    if not size_mb > 0:
        raise ValueError(f"--size-mb = {size_mb} is invalid: use a positive message size")
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"--device = {device!r} is invalid: use auto, cpu or cuda")
    if device_type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc = {nproc} is invalid: only {torch.cuda.device_count()} GPUs here")
    threads = max(1, (os.cpu_count() or 1) // nproc) if device_type == "cpu" else 1
    backend = "nccl" if device_type == "cuda" else "gloo"
    with WorkerPool(nproc, backend=backend, threads=threads) as pool:
        measured = pool.run(measure_collectives, int(size_mb * 2**20), device_type)
        compute = pool.run(measure_device, device_type, threads)
    bus = {k: min(r[k] for r in measured) for k in COLLECTIVES}
    latency = max(r["latency_s"] for r in measured)
    hardware = Hardware(
        name=name or f"local-{device_type}", peak_flops_fp32=min(r["fp32"] for r in compute),
        peak_flops_bf16=min(r["bf16"] for r in compute), memory_bytes=device_memory(device_type, nproc),
        memory_bandwidth=min(r["memory_bandwidth"] for r in compute), gpus_per_node=nproc,
        intra=dict(bus), inter=dict(bus), latency_intra_s=latency, latency_inter_s=latency,
        reserved_bytes=0.0, matmul_efficiency=1.0, device=device_type,
    ).validate()
    values = hardware.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(values, indent=2) + "\n" if path.suffix == ".json" else to_toml(values))
    os.replace(tmp, path)
    print(f"wrote {path}: {hardware.peak_flops_fp32 / 1e9:.1f} GFLOP/s fp32, {hardware.peak_flops_bf16 / 1e9:.1f} bf16 "
          f"per rank, memory {hardware.memory_bandwidth / 1e9:.1f} GB/s; bus GB/s over {nproc} {backend} ranks: "
          + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in bus.items()) + f"; latency {latency * 1e6:.0f} us")
    return hardware
