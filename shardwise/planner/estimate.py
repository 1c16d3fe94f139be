"""The estimator: (model, layout, hardware) -> fits?, peak memory and step time with breakdowns.

A pure function of its inputs (no torch, no I/O): the same code answers `shardwise estimate`,
its `--jsonl` batch mode, `shardwise plan` and `parallel.mode = "auto"`. A LoRA layout's JSON adds
`trainable_params` (the adapters'); `num_params` stays the whole model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.core.model import ModelConfig
from shardwise.core.model_counts import matmul_flops_per_token
from shardwise.models.families import counts_of, spec_of
from shardwise.planner.adapters import layout_trainable_params
from shardwise.planner.hardware import Hardware, resolve_hardware
from shardwise.planner.layout import Layout, layout_from_dict
from shardwise.planner.memory import GIB, MemoryEstimate, peak_memory
from shardwise.planner.model_resolution import resolve_model
from shardwise.planner.step_time import TimeEstimate, step_time


@dataclass(frozen=True)
class Estimate:
    model: ModelConfig
    layout: Layout
    hardware: Hardware
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def fits(self) -> bool:
        return self.memory.peak + self.hardware.reserved_bytes <= self.hardware.memory_bytes

    @property
    def step_time_s(self) -> float:
        return self.time.step

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.layout.tokens_per_step / self.step_time_s / self.layout.world_size

    @property
    def mfu(self) -> float:
        # the matmul weights' FLOPs (norms excluded), not ModelConfig.flops_per_token's (the trainer's MFU)
        flops = matmul_flops_per_token(self.model, spec_of(self.model.family), self.layout.seq_len)
        return flops * self.tokens_per_s_per_device / self.hardware.peak_flops(self.layout.matmul_dtype)

    @property
    def trainable_params(self) -> int:
        """The parameters training updates: every one, or with LoRA the adapters alone."""
        lora = layout_trainable_params(self.model, self.layout)
        return counts_of(self.model).num_params() if lora is None else lora

    def to_json(self) -> dict:
        result = {
            "fits": self.fits,
            "peak_memory_gib": self.memory.peak / GIB,
            "memory_gib": {**self.memory.gib(), "device": self.hardware.memory_bytes / GIB,
                           "reserved_by_runtime": self.hardware.reserved_bytes / GIB},
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "time_s": dict(self.time.breakdown),
            "layout": self.layout.describe(),
            "world_size": self.layout.world_size,
            "num_params": counts_of(self.model).num_params(),
            "peak_rank": {"pp_rank": self.memory.pp_rank},
        }
        if self.layout.lora_rank:  # kept out of the other outputs, which stay as they were
            result["trainable_params"] = self.trainable_params
        return result


def estimate(model: ModelConfig, layout: Layout, hardware: Hardware) -> Estimate:
    layout.check_against(model)
    return Estimate(model=model, layout=layout, hardware=hardware,
                    memory=peak_memory(model, layout, hardware.device), time=step_time(model, layout, hardware))


def estimate_from_specs(model_spec, layout_spec, hardware_spec) -> Estimate:
    """From the CLI's forms: preset names, dicts, JSON text or file paths."""
    model = resolve_model(model_spec)
    layout = layout_spec if isinstance(layout_spec, Layout) else layout_from_dict(_as_dict(layout_spec, "layout"))
    hardware = resolve_hardware(hardware_spec)
    return estimate(model, layout, hardware)


def _as_dict(spec, what: str) -> dict:
    import json
    from pathlib import Path

    if isinstance(spec, dict):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        if not text.startswith("{") and Path(text).is_file():
            text = Path(text).read_text()
        elif not text.startswith("{") and Path(text).suffix == ".json":
            raise FileNotFoundError(f"{what} = {spec!r} is invalid: no such file")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what} = {spec[:40]!r} is invalid JSON: {err}") from None
        if isinstance(value, dict):
            return value
    raise ValueError(f"{what} = {spec!r} is invalid: give a JSON object")
