"""`parallel.mode = "auto"`: the planner picks the layout for the launched world size.

`resolve_parallel(cfg, world_size)` is called once wherever a layout is turned into
`ParallelDims` (`shardwise train` before launching, `train()` in every worker): with mode
"manual" it returns the config untouched; with "auto" it plans for the model, the batch
(train.global_batch_size x train.seq_len tokens in micro-batches of train.micro_batch_size) and
the hardware (`parallel.hardware`: a preset or a `shardwise calibrate` file; empty = the cpu
preset on CPU, the GPU's preset on GPUs), and returns the config with the best layout that the
runtime accepts as concrete `parallel` degrees (mode "manual"), and `train.recompute` raised
if the layout needs it to fit. The plan is a pure function of these inputs, so every rank
derives the same layout without communicating. Rank 0 prints the choice and its predicted
figures.
"""

from __future__ import annotations

import dataclasses

from shardwise.config.schema import sequences_per_sample
from shardwise.core.units import GIB
from shardwise.planner.hardware import Hardware, resolve_hardware
from shardwise.planner.search import PlanRequest, plan, why_it_wins

GPU_PRESETS = (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100", "a100"))


def default_hardware(device_type: str) -> str:
    if device_type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    for key, preset in GPU_PRESETS:
        if key in name:
            if preset == "a100":
                memory = torch.cuda.get_device_properties(0).total_memory
                return "a100-40gb" if memory < 60 * GIB else "a100-80gb"
            return preset
    raise ValueError(f"parallel.hardware = '' is invalid on {name}: no preset matches; run `shardwise calibrate` "
                     f"and set parallel.hardware to its file, or name a preset")


def planning_hardware(cfg, device_type: str) -> Hardware:
    return resolve_hardware(cfg.parallel.hardware or default_hardware(device_type))


def plan_request(cfg, world_size: int, hardware: Hardware) -> PlanRequest:
    bf16 = cfg.train.autocast_dtype == "bfloat16"
    sequences = sequences_per_sample(cfg)  # a DPO pair runs two
    return PlanRequest(model=cfg.model, model_name=cfg.model.preset, hardware=hardware, devices=world_size,
                       global_batch_tokens=cfg.train.global_batch_size * sequences * cfg.train.seq_len,
                       seq_len=cfg.train.seq_len, dtype="fp32", compute_dtype="bf16" if bf16 else "",
                       micro_batches=(cfg.train.micro_batch_size * sequences,),
                       compile=cfg.train.compile and cfg.train.rewrite_rules, chunked_loss=cfg.train.chunked_loss,
                       lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets,
                       lora_base_dtype=cfg.train.lora_base_dtype, lora_dropout=cfg.train.lora_dropout,
                       packed=cfg.data.packing or cfg.data.document_mask)


def config_with_layout(cfg, layout):
    """cfg with `parallel` set to the layout's degrees (mode manual) and its recomputation."""
    parallel = dataclasses.replace(cfg.parallel, mode="manual", dp=layout.dp, dp_replicate=layout.dp_replicate,
                                   zero=layout.zero, tp=layout.tp, sp=layout.sp, cp=layout.cp, cp_mode=layout.cp_mode,
                                   pp=layout.pp, pp_schedule=layout.pp_schedule,
                                   pp_virtual_stages=layout.virtual_stages, ep=layout.ep)
    train = cfg.train
    if layout.recompute != "none" and getattr(train, "recompute", "none") == "none":
        train = dataclasses.replace(train, recompute=layout.recompute)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def runtime_accepts(cfg, world_size: int) -> bool:
    from shardwise.distributed.dims import ParallelDims

    try:
        cfg.parallel.validate()
        cfg.validate_post_training()  # what DPO, packing and document masks refuse (e.g. DPO under pp)
        ParallelDims.from_config(cfg.parallel, world_size).check(cfg)
    except ValueError:
        return False
    return True


def resolve_parallel(cfg, world_size: int, *, device_type: str = "cpu", announce: bool = False):
    """The config with concrete parallel degrees: unchanged for mode "manual", planned for "auto";
    `announce` (the trainer's rank 0) prints the choice."""
    if cfg.parallel.mode != "auto":
        return cfg
    hardware = planning_hardware(cfg, device_type)
    results, considered = plan(plan_request(cfg, world_size, hardware))
    for rank, result in enumerate(results):
        chosen = config_with_layout(cfg, result.layout)
        if runtime_accepts(chosen, world_size):
            if announce:
                print(f"parallel.mode = auto on {world_size} x {hardware.name}: {considered} layouts considered, "
                      f"{len(results)} fit; chose {result.layout.describe()} (rank {rank + 1}): predicted "
                      f"{result.step_time_s:.3g} s/step, {result.tokens_per_s_per_device:,.0f} tokens/s/device, "
                      f"peak {result.memory.peak / GIB:.2f} GiB per rank. {why_it_wins(results[rank:])}", flush=True)
            return chosen
    raise ValueError(f"parallel.mode = 'auto' is invalid here: none of the {considered} layouts of {world_size} "
                     f"processes fits {hardware.name} and runs in this runtime; use more processes, a smaller "
                     f"train.micro_batch_size or a smaller model")
