"""Hardware specs for the cost model: peak FLOP/s, memory, and collective bandwidths.

A `Hardware` is plain data. Bandwidths are *bus* bandwidths in the nccl-tests convention
(bytes/s), so that for a collective over n ranks of a message of S bytes

    all-reduce:      t = latency + 2 (n-1)/n * S / busbw_all_reduce
    all-gather:      t = latency +   (n-1)/n * S / busbw_all_gather      (S = the gathered size)
    reduce-scatter:  t = latency +   (n-1)/n * S / busbw_reduce_scatter  (S = the input size)
    all-to-all:      t = latency +   (n-1)/n * S / busbw_all_to_all
    point-to-point:  t = latency +             S / bw_p2p

(the Ultra-Scale Playbook's and NCCL's definitions). "intra" is within one node (NVLink);
"inter" is the bus bandwidth one GPU's NIC gives a collective whose ranks span nodes. A group
with k ranks in each node it spans drives k NICs at once (NCCL gives each rank's channel its
own NIC), so it gets k x inter, at most intra: data parallelism over all 8 GPUs of each node
runs at the node's 8 x 50 GB/s, data parallelism beside tp = 8 at one NIC's 50 GB/s
(`step_time.collective_time`).

Presets carry datasheet peaks and bandwidths as measured by nccl-tests-style benchmarks on
typical systems: H100/H200 SXM nodes of 8 with NVLink 4 (~450 GB/s all-reduce bus bandwidth
in a node, the figure in ../shared/data/playbook_runs.csv's `ar_intra`) and 8x400 Gb/s
InfiniBand/EFA between nodes (~50 GB/s per GPU); A100 SXM with NVLink 3 (~230 GB/s) and
8x200 Gb/s HDR (~25 GB/s per GPU). `memory_bytes` is what the device reports as total
(e.g. torch.cuda.get_device_properties().total_memory), `reserved_bytes` what the runtime
takes before the first tensor (CUDA context, NCCL buffers, cuBLAS workspace).

A preset can be overridden field by field, or read from a TOML/JSON file of the same fields
(`shardwise calibrate` writes one for this machine):

    name = "my-h100"
    base = "h100-80gb"              # optional: start from a preset
    peak_flops_bf16 = 9.0e14
    [inter]
    all_reduce = 4.0e10
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.core.units import GIB

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
DEVICES = ("cuda", "cpu")
GB = 1e9


def bandwidths(all_reduce: float, all_gather: float, reduce_scatter: float, all_to_all: float, p2p: float) -> dict:
    """Bus bandwidths in GB/s -> {collective: bytes/s}."""
    values = (all_reduce, all_gather, reduce_scatter, all_to_all, p2p)
    return {name: value * GB for name, value in zip(COLLECTIVES, values)}


@dataclass(kw_only=True)
class Hardware:
    name: str
    peak_flops_bf16: float
    """Dense bf16 FLOP/s of one device (datasheet, no sparsity)."""
    peak_flops_fp32: float
    """Dense fp32 FLOP/s of one device."""
    memory_bytes: float
    """Device memory, bytes."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s (bounds elementwise ops: norms, activations, optimizer)."""
    gpus_per_node: int
    intra: dict = field(default_factory=dict)
    """Bus bandwidth per collective inside a node, bytes/s (keys: COLLECTIVES)."""
    inter: dict = field(default_factory=dict)
    """Bus bandwidth per collective across nodes, bytes/s."""
    latency_intra_s: float = 10e-6
    latency_inter_s: float = 30e-6
    reserved_bytes: float = 0.0
    """Memory the runtime holds before any tensor (context, communicator buffers)."""
    matmul_efficiency: float = 0.0
    """Measured fraction of peak a large matmul reaches; 0 = use the planner's default constant.
    `shardwise calibrate` sets it to 1 and puts the measured FLOP/s in the peaks instead."""
    device: str = "cuda"
    """"cuda" (an accelerator) or "cpu": the runtime sizes some buffers by device type (the chunked
    loss's chunk, `config.units.LOSS_CHUNK_ELEMENTS`), and the memory model follows it."""

    def validate(self) -> "Hardware":
        for name in ("peak_flops_bf16", "peak_flops_fp32", "memory_bytes", "memory_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"hardware.{name} = {value!r} is invalid: use a positive number")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware.gpus_per_node = {self.gpus_per_node!r} is invalid: use a positive integer")
        for where in ("intra", "inter"):
            table = getattr(self, where)
            for name in COLLECTIVES:
                value = table.get(name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"hardware.{where}.{name} = {value!r} is invalid: "
                                     f"give a positive bus bandwidth in bytes/s")
            unknown = set(table) - set(COLLECTIVES)
            if unknown:
                raise ValueError(f"hardware.{where}.{sorted(unknown)[0]} is invalid: "
                                 f"use one of {', '.join(COLLECTIVES)}")
        if not 0 <= self.matmul_efficiency <= 1:
            raise ValueError(f"hardware.matmul_efficiency = {self.matmul_efficiency!r} is invalid: "
                             f"use 0 (planner default) or a fraction in (0, 1]")
        if self.device not in DEVICES:
            raise ValueError(f"hardware.device = {self.device!r} is invalid: use one of {', '.join(DEVICES)}")
        return self

    def peak_flops(self, dtype: str) -> float:
        return self.peak_flops_bf16 if dtype == "bf16" else self.peak_flops_fp32

    def bandwidth(self, collective: str, *, spans_nodes: bool) -> float:
        return (self.inter if spans_nodes else self.intra)[collective]

    def latency(self, *, spans_nodes: bool) -> float:
        return self.latency_inter_s if spans_nodes else self.latency_intra_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _local_cpu() -> Hardware:
    """This machine's CPU, from its core count and memory, with guessed per-core throughput;
    `shardwise calibrate` replaces the guesses by measurements."""
    cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 * GIB
    # ~50 GFLOP/s fp32 per core (AVX2/AVX-512 FMA at realistic clocks); bf16 is often emulated.
    shared = bandwidths(2, 2, 2, 2, 2)  # gloo over shared memory/loopback, GB/s
    return Hardware(
        name="cpu", peak_flops_bf16=25e9 * cores, peak_flops_fp32=50e9 * cores, memory_bytes=float(memory),
        memory_bandwidth=20 * GB, gpus_per_node=cores, intra=shared, inter=dict(shared),
        latency_intra_s=50e-6, latency_inter_s=100e-6, reserved_bytes=0.0, device="cpu",
    )


def _presets() -> dict[str, Hardware]:
    nvlink4 = bandwidths(450, 360, 360, 300, 400)
    nvlink3 = bandwidths(230, 200, 200, 160, 200)
    ib_400 = bandwidths(50, 45, 45, 35, 48)  # 8 x 400 Gb/s NICs per node: 50 GB/s per GPU
    ib_200 = bandwidths(25, 22, 22, 18, 24)
    return {
        "h100-80gb": Hardware(
            name="h100-80gb", peak_flops_bf16=989e12, peak_flops_fp32=67e12, memory_bytes=85_029_158_912,
            memory_bandwidth=3.35e12, gpus_per_node=8, intra=nvlink4, inter=ib_400, reserved_bytes=1.0 * GIB),
        "h200-141gb": Hardware(
            name="h200-141gb", peak_flops_bf16=989e12, peak_flops_fp32=67e12, memory_bytes=150_754_820_096,
            memory_bandwidth=4.8e12, gpus_per_node=8, intra=nvlink4, inter=ib_400, reserved_bytes=1.0 * GIB),
        "a100-40gb": Hardware(
            name="a100-40gb", peak_flops_bf16=312e12, peak_flops_fp32=19.5e12, memory_bytes=42_505_273_344,
            memory_bandwidth=1.555e12, gpus_per_node=8, intra=nvlink3, inter=ib_200, reserved_bytes=1.0 * GIB),
        "a100-80gb": Hardware(
            name="a100-80gb", peak_flops_bf16=312e12, peak_flops_fp32=19.5e12, memory_bytes=84_987_740_160,
            memory_bandwidth=2.039e12, gpus_per_node=8, intra=nvlink3, inter=ib_200, reserved_bytes=1.0 * GIB),
    }


PRESET_NAMES = ("h100-80gb", "h200-141gb", "a100-40gb", "a100-80gb", "cpu")


def preset(name: str) -> Hardware:
    if name == "cpu":
        return _local_cpu()
    presets = _presets()
    if name not in presets:
        raise ValueError(f"hardware = {name!r} is invalid: use a preset ({', '.join(PRESET_NAMES)}), "
                         f"a JSON object or a .toml/.json file")
    return presets[name]


def hardware_from_dict(values: dict) -> Hardware:
    """A Hardware from a dict of fields, starting from `base` (a preset name) when given."""
    if not isinstance(values, dict):
        raise ValueError(f"hardware = {values!r} is invalid: give a preset name or an object of fields")
    values = dict(values)
    base = values.pop("base", None)
    known = {f.name for f in dataclasses.fields(Hardware)}
    for key in values:
        if key not in known:
            raise ValueError(f"hardware.{key} is invalid: not a hardware field; use one of {', '.join(sorted(known))}")
    if base is None and "name" in values and values["name"] in PRESET_NAMES and len(values) < len(known):
        base = values["name"]
    if base is not None:
        start = preset(base).to_dict()
        for where in ("intra", "inter"):
            start[where] = {**start[where], **values.pop(where, {})}
        start.update(values)
        values = start
    missing = sorted(known - set(values) - {"latency_intra_s", "latency_inter_s", "reserved_bytes", "matmul_efficiency"})
    if missing:
        raise ValueError(f"hardware.{missing[0]} is missing: give it, or set base = a preset name to start from")
    values.setdefault("name", "custom")
    return Hardware(**values).validate()


def read_hardware_file(path: Path) -> Hardware:
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"hardware file {path} is invalid TOML: {err}") from None
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"hardware file {path} is invalid JSON: {err}") from None
    return hardware_from_dict(values)


def resolve_hardware(spec) -> Hardware:
    """A preset name, a dict of fields, a JSON object as text, or a .toml/.json file path."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, dict):
        return hardware_from_dict(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"hardware = {spec!r} is invalid: use a preset ({', '.join(PRESET_NAMES)}), "
                         f"a JSON object or a .toml/.json file")
    text = spec.strip()
    if text.startswith("{"):
        try:
            return hardware_from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise ValueError(f"hardware = {text[:40]!r} is invalid JSON: {err}") from None
    if text in PRESET_NAMES:
        return preset(text)
    path = Path(text)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"hardware = {text!r} is invalid: no such file")
        return read_hardware_file(path)
    return preset(text)
