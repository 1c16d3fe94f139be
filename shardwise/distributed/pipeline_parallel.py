"""Pipeline parallelism over the `pp` mesh axis: the stage split and this rank's stages.

The model's blocks are cut into `pp * virtual_stages` contiguous stages so that the most
expensive stage is as cheap as possible (`shardwise.core.stage_split`, the splitter the
planner uses too), by the costs the model's plan gives (`ModelPlan.stage_costs`). Each stage is
a copy of the model built on meta with what other stages own removed (`keep_stage`, by the
plan's `blocks`, `first_stage` and `last_stage` names); the model code is untouched, and
parameter names stay those of the full model, so checkpoints reshard across pipeline layouts
like any other.

With `parallel.pp_virtual_stages = v` rank r holds stages r, r+pp, ... (the loop placement of
interleaved 1F1B), or r and 2pp-1-r for the V-shaped zbv. A rank's stages are separate modules
(`ModelParts`), each its own FSDP root when zero = 3. The schedules are in pipeline_schedule.py.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from shardwise.core.stage_split import split_stage_costs
from shardwise.models.build import plan_of


def keep_stage(model, layer_ids: list[int], *, is_first: bool, is_last: bool, plan=None) -> None:
    """Drop from `model` (on meta, before materialising) what other stages own, by `plan` (the
    model family's, by default). With tied embeddings the last stage keeps a copy of the table
    for its head (see `TiedEmbeddingSync`)."""
    plan = plan or plan_of(model.cfg)
    keep = {str(i) for i in layer_ids}
    blocks = getattr(model, plan.blocks)
    for name in [name for name in blocks if name not in keep]:
        del blocks[name]
    if not is_first:
        for name in plan.first_stage:
            if not (is_last and name == plan.tied_table):
                setattr(model, name, None)
    if not is_last:
        for name in plan.last_stage:
            setattr(model, name, None)


ZBV_MIN_TORCH = "2.13"


def schedule_available(schedule: str) -> bool:
    """ZBV ran on torch 2.13 in our tests; on torch 2.11 its first P2P fails with gloo."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return schedule != "zbv" or version >= tuple(int(x) for x in ZBV_MIN_TORCH.split("."))


def schedule_unavailable(schedule: str) -> str:
    """Why this torch cannot run `schedule` ("" when it can): the fix for the config error."""
    if schedule_available(schedule):
        return ""
    return (f"torch {torch.__version__}'s ZBV schedule fails on gloo (a P2P pair is never connected); "
            f"use zero-bubble, or torch >= {ZBV_MIN_TORCH}")


def stage_ids_of(rank: int, *, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages rank `rank` of the pp axis holds, in the order its parts are built."""
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


class ModelParts(nn.Module):
    """This rank's pipeline stages seen as one model: parameters and state_dict under the full
    model's names (the parts are registered as children only so that `to_empty`/`train` reach them)."""

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], plan):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.stage_ids = stage_ids
        self.plan = plan

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        merged = {}
        for part in self.parts:
            merged.update(part.state_dict(*args, **kwargs))
        return merged

    def init_weights(self, seed: int) -> None:
        for part in self.parts:
            part.init_weights(seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        return self.parts[0].initial_value(name, shape, device, seed)

    def table_of(self, part: nn.Module) -> nn.Parameter | None:
        """The tied embedding table `part` holds (None without one)."""
        if self.plan.tied_table is None:
            return None
        module = getattr(part, self.plan.tied_table)
        return None if module is None else module.weight

    def tied_table_copy(self) -> nn.Parameter | None:
        """The embedding table this rank holds only for a tied head (another rank embeds with it)."""
        if 0 in self.stage_ids:
            return None
        tables = [table for part in self.parts if (table := self.table_of(part)) is not None]
        return tables[0] if tables else None


class TiedEmbeddingSync:
    """Tied embeddings across pipeline stages (as Megatron-LM does): the first stage embeds with
    the table, the last multiplies by it, each holding a copy with the same initial value. After
    backward the two copies' gradients are summed over `group` (the first and last pipeline
    ranks that share the other coordinates, built by `ParallelDims.build_meshes`), so both
    copies take the same optimizer step and stay equal. The copy on the last stage is left out
    of the gradient norm, which counts it once."""

    def __init__(self, parts: "ModelParts", group):
        self.group = group
        self.tables = [table for part in parts.parts if (table := parts.table_of(part)) is not None]

    def all_reduce_grads(self) -> None:
        if self.group is None:
            return
        for table in self.tables:
            if table.grad is None:  # a frozen table (LoRA): no copy trains
                continue
            grad = table.grad.to_local() if hasattr(table.grad, "to_local") else table.grad
            dist.all_reduce(grad, group=self.group)


def parts_of(model: nn.Module) -> list[nn.Module]:
    return list(model.parts) if isinstance(model, ModelParts) else [model]


def apply_pp(model: nn.Module, plan, cfg, *, pp_rank: int, pp: int) -> "ModelParts":
    """This rank's stages of `model` (built on meta; it is left untouched), as `ModelParts`."""
    par = cfg.parallel
    num_stages = pp * par.pp_virtual_stages
    split = split_stage_costs(plan.stage_costs(cfg.train.seq_len), num_stages=num_stages)
    ids = stage_ids_of(pp_rank, pp=pp, virtual=par.pp_virtual_stages, schedule=par.pp_schedule)
    parts = []
    for stage in ids:
        part = copy.deepcopy(model)
        keep_stage(part, split[stage], is_first=stage == 0, is_last=stage == num_stages - 1, plan=plan)
        parts.append(part)
    return ModelParts(parts, ids, plan)
