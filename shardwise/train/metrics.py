"""Per-step metrics: throughput, model FLOPs utilisation, memory; written one JSON line a step."""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense peak FLOP/s from the vendors' datasheets (SXM parts, no sparsity): (bf16, fp32).
# fp32 is the non-tensor-core figure; matmuls may run faster with TF32 enabled.
ACCELERATOR_PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L4": (121e12, 30.3e12),
    "A10": (125e12, 31.2e12),
    "V100": (125e12, 15.7e12),
}


@dataclass(frozen=True)
class PeakFlops:
    flops_per_s: float
    source: str
    """Where the figure comes from: a datasheet entry, or a measurement (approximate)."""


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, *, trial_s: float = 0.05, trials: int = 3) -> float:
    """Achieved FLOP/s of a square matmul, best of a few short timed trials: the CPU has no
    datasheet entry, so this stands in for its peak. It is approximate: another busy process
    lowers it (and so raises the MFU shown), and a model's smaller matmuls rarely reach it.
    Some CPUs emulate bf16 at ~1 GFLOP/s, so the size stays small when one matmul is slow."""

    def sync():
        if device.type != "cpu":
            torch.accelerator.synchronize()

    for size in (256, 1024):  # large enough to be compute-bound, unless even 256 is slow
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        start = time.perf_counter()
        a @ b
        sync()
        if time.perf_counter() - start > trial_s / 4:
            break
    best = 0.0
    for _ in range(trials):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < trial_s:
            a @ b
            sync()
            count += 1
        best = max(best, 2 * size**3 * count / elapsed)
    return best


@functools.cache
def peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """The device's peak FLOP/s: its datasheet's, or measured once per process (the measurement
    spins the CPU for ~0.2 s; a process that trains many runs, as the test session, pays it once)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in ACCELERATOR_PEAK_FLOPS.items():
            if key in name:
                return PeakFlops(bf16 if dtype == torch.bfloat16 else fp32, f"datasheet ({key})")
    measured = measure_matmul_flops(device, dtype)
    return PeakFlops(measured, f"measured {device.type} matmul throughput (approximate)")


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """Peak memory and what it measures: the allocator's peak on an accelerator, else the
    process's peak resident set (which includes the interpreter and libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda max_memory_allocated"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bytes_used = kib if sys.platform == "darwin" else kib * 1024
    return bytes_used / 2**30, "process peak RSS"


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl, flushed, so a crash loses nothing logged."""

    def __init__(self, path: Path, *, resume_from_step: int):
        self.path = Path(path)
        self.drop_after(resume_from_step)
        self.file = self.path.open("a")

    def drop_after(self, step: int) -> None:
        """On resume, lines of steps after the checkpoint were never made durable: drop them."""
        if not self.path.exists():
            return
        kept = [line for line, record in read_metrics_log(self.path) if record["step"] <= step] if step > 0 else []
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics_log(path: Path, *, warn: bool = True) -> list[tuple[str, dict]]:
    """(line, record) of each step in metrics.jsonl. A last line that is not a record was cut short by
    a crash while it was written: it is dropped, with a warning if `warn` (its step is redone after
    the resume). A damaged line before it is an error naming the line: what follows may not be this run's."""
    lines = [(number, raw) for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1) if raw.strip()]
    records = []
    for index, (number, raw) in enumerate(lines):
        record = metrics_record(raw)
        if record is not None:
            records.append((raw.decode("utf-8"), record))
        elif index == len(lines) - 1:
            if warn:
                print(f"shardwise: warning: {path}: dropped its last line, cut short by a crash while it was written "
                      f"({len(raw)} bytes, not a JSON record)", file=sys.stderr, flush=True)
        else:
            raise ValueError(f"{path}: line {number} is damaged (not a JSON record with a step); "
                             "delete that line, or move the file aside to start the run's metrics afresh")
    return records


def metrics_record(raw: bytes) -> dict | None:
    """One line's record, or None if it is not a JSON object with an integer step."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return None
    return record
