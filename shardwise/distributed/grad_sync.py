"""Gradient synchronisation over the data-parallel ranks: one small interface, one class per
strategy, picked from `STRATEGIES` by `strategy_key(dims)`.

| key        | class               | who reduces what                                                  |
|------------|---------------------|-------------------------------------------------------------------|
| local      | `GradSync`          | nothing: one process, or no two ranks hold the same parameters    |
| zero0      | `DDPSync`           | torch DDP: bucketed all-reduce overlapped with backward, skipped on non-final micro-batches |
| zero0-flat | `AllReduceSync`     | ZeRO-0 where DDP does not fit (tensor-parallel DTensors, a pipeline schedule, experts): one coalesced all-reduce of the local gradients per step |
| zero1/2    | `ZeroSync`          | reduce-scatter, sharded AdamW, all-gather (by hand, zero.py); ZeRO-2 after every micro-batch |
| zero3      | `FullyShardedSync`  | FSDP2 `fully_shard` per block (and HSDP on the 2-D dp mesh); each pipeline part a root |

Expert-parallel experts (sharded over ep already) are synchronised by `ExpertGrads`
(expert_parallel.py) beside the dense strategy under ZeRO-0/1/2; under ZeRO-3 they are FSDP
units of their own on the edp axis. With a pipeline, FSDP's stages reduce on their last
backward; ZeRO-1 reduces once after the schedule (ZeRO-2 is refused: it would free gradients
the schedule still accumulates).

The interface, as the trainer uses it, per step:

    for each micro-batch (or once around the whole pipeline schedule, is_last=False):
        with sync.micro_batch(is_last): forward, loss, backward
        sync.after_backward(is_last)         # (after the schedule: is_last=True)
    norm = sync.clip_grad_norm_(max_norm)    # the global norm, one function (grad_norm.py)
    optimizer.step(); sync.after_step()      # ZeRO: all-gather the updated rows
    sync.zero_grad(optimizer)

`named_optimizer_params()` says what the optimizer updates (ZeRO: row shards) under which
parameter name, and how each state tensor is saved (ZeRO: a DTensor of its rows), so
checkpoints stay keyed by name and reshard between strategies.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardwise.core.units import MIB
from shardwise.distributed.dims import Meshes, ParallelDims
from shardwise.distributed.expert_parallel import ExpertGrads, shard_experts_fsdp
from shardwise.distributed.grad_norm import clip_grad_norm_
from shardwise.distributed.tensor_parallel import align_grad_placements
from shardwise.distributed.zero import ZeroShardedState


def keep(value: torch.Tensor) -> torch.Tensor:
    return value


class GradSync:
    """The interface, and the local strategy: gradients stay where backward put them."""

    def __init__(self, model: nn.Module, plan, dims: ParallelDims, meshes: Meshes, *, bucket_mb: float):
        self.model, self.plan, self.dims, self.meshes = model, plan, dims, meshes
        self.module: nn.Module = model
        """What the trainer calls for forward (DDP's wrapper, or the model)."""
        self.experts = ExpertGrads(model, plan, meshes.experts, dims.num_grad_ranks) \
            if meshes.experts is not None and dims.zero != 3 else None

    @classmethod
    def shard(cls, parts, plan, dims: ParallelDims, meshes: Meshes) -> None:
        """Called on the meta model, before it is materialised (FSDP shards there)."""

    def micro_batch(self, is_last: bool):
        """Wraps one micro-batch's forward and backward."""
        return contextlib.nullcontext()

    def after_backward(self, is_last: bool) -> None:
        if self.dims.tp > 1:
            align_grad_placements(self.model)
        if is_last and self.experts is not None:
            self.experts.reduce()

    def named_optimizer_params(self):
        """(parameter name, tensor the optimizer updates, how to save one of its state tensors)."""
        for name, param in self.model.named_parameters():
            yield name, param, keep

    def pp_group(self):
        """Pipeline stages hold disjoint parameters: a global norm sums over this group."""
        return self.meshes.world["pp"].get_group() if self.dims.pp > 1 else None

    def tied_table_copy(self):
        """A pipeline rank's copy of a tied table that another rank also holds (counted once in norms)."""
        return self.model.tied_table_copy() if self.dims.pp > 1 else None

    def clip_grad_norm_(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        skip = self.tied_table_copy()
        return clip_grad_norm_([p.grad for p in params], max_norm, counted=[p.grad for p in params if p is not skip],
                               sum_over=(self.pp_group(),))

    def after_step(self) -> None:
        pass

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]


class DDPSync(GradSync):
    """ZeRO-0: PyTorch DDP. Its comm hook goes through `dist.all_reduce`, so the communication
    log sees the traffic."""

    def __init__(self, model, plan, dims, meshes, *, bucket_mb):
        super().__init__(model, plan, dims, meshes, bucket_mb=bucket_mb)
        group = meshes.world[dims.grad_axis].get_group()
        self.module = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb,
                                              gradient_as_bucket_view=True)
        self.module.register_comm_hook(group, default_hooks.allreduce_hook)

    def micro_batch(self, is_last: bool):
        # Gradients of non-final micro-batches accumulate locally; one all-reduce per step.
        return contextlib.nullcontext() if is_last else self.module.no_sync()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AllReduceSync(GradSync):
    """ZeRO-0 over parameters DDP does not take (tensor-parallel DTensors, pipeline stages run
    by a schedule, expert-parallel layouts): after the last micro-batch each rank all-reduces
    its local gradient shards over the gradient axis, coalesced into one flat buffer per step
    (not overlapped with backward, unlike DDP)."""

    def after_backward(self, is_last: bool) -> None:
        super().after_backward(is_last)
        if not is_last:
            return
        experts = set(map(id, self.experts.params)) if self.experts is not None else set()
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None and id(p) not in experts]
        if not grads:  # nothing trains here (a frozen LoRA base without adapters on this rank's part)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.meshes.world[self.dims.grad_axis].get_group())
        flat /= self.dims.num_grad_ranks
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class ZeroSync(GradSync):
    """ZeRO-1/2: replicated parameters, row-sharded optimizer state (and gradients at stage 2);
    expert-parallel experts stay out of the row sharding (see `ExpertGrads`)."""

    def __init__(self, model, plan, dims, meshes, *, bucket_mb):
        super().__init__(model, plan, dims, meshes, bucket_mb=bucket_mb)
        experts = self.experts.names if self.experts is not None else set()
        self.dp_mesh = meshes.world[dims.grad_axis]
        self.zero = ZeroShardedState(model, stage=dims.zero, group=self.dp_mesh.get_group(),
                                     bucket_bytes=int(bucket_mb * MIB), skip=lambda name: name in experts)

    def micro_batch(self, is_last: bool):
        self.zero.begin_micro_batch(is_last=is_last)
        return contextlib.nullcontext()

    def after_backward(self, is_last: bool) -> None:
        if is_last and not self.zero.sync_now:  # after a pipeline schedule: reduce everything now
            self.zero.begin_micro_batch(is_last=True)
        self.zero.after_backward()
        if is_last and self.experts is not None:
            self.experts.reduce()

    def named_optimizer_params(self):
        for s in self.zero.shards:
            yield s.name, s.shard, lambda value, s=s: self.zero.as_dtensor(s, value, self.dp_mesh)
        if self.experts is not None:
            yield from self.experts.named_params()

    def clip_grad_norm_(self, max_norm: float) -> float:
        skip = self.tied_table_copy()
        shards = [s.shard.grad for s in self.zero.shards if s.shard.grad is not None]
        counted = [s.shard.grad for s in self.zero.shards if s.shard.grad is not None and s.param is not skip]
        experts, extra_squared = [], None
        if self.experts is not None:
            experts, extra_squared = self.experts.grads(), self.experts.squared_share()
        return clip_grad_norm_(shards + experts, max_norm, counted=counted, extra_squared=extra_squared,
                               sum_over=(self.zero.group, self.pp_group()))

    def after_step(self) -> None:
        self.zero.all_gather_params()

    def zero_grad(self, optimizer) -> None:
        self.zero.zero_grad()
        if self.experts is not None:
            self.experts.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.zero.grad_tensors() + (self.experts.grads() if self.experts is not None else [])


class FullyShardedSync(GradSync):
    """ZeRO-3 (and HSDP on a 2-D mesh) with FSDP2: each block is its own all-gather unit, each
    model part (pipeline stage) a root holding the rest (embedding, final norm, head)."""

    @classmethod
    def shard(cls, parts, plan, dims, meshes) -> None:
        world = meshes.world
        if meshes.experts is not None:  # the experts first: their own FSDP units, on the edp axis
            shard_experts_fsdp(parts, meshes.experts)
        dp_mesh = world["dp_replicate", dims.grad_axis] if dims.dp_replicate > 1 else world[dims.grad_axis]
        for part in parts:
            for _, _, block in plan.all_blocks(part):
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
            fully_shard(part, mesh=dp_mesh, reshard_after_forward=True)


STRATEGIES: dict[str, type[GradSync]] = {
    "local": GradSync,
    "zero0": DDPSync,
    "zero0-flat": AllReduceSync,
    "zero1": ZeroSync,
    "zero2": ZeroSync,
    "zero3": FullyShardedSync,
}


def strategy_key(dims: ParallelDims) -> str:
    """The row of `STRATEGIES` for a layout: the ZeRO stage, unless nothing is replicated
    ("local"), or ZeRO-0 meets what DDP cannot take ("zero0-flat")."""
    if dims.dp * dims.cp == 1:
        return "local"
    ddp_unfit = dims.tp > 1 or dims.pp > 1 or dims.ep > 1
    return "zero0-flat" if dims.zero == 0 and ddp_unfit else f"zero{dims.zero}"


def mean_over_dp(value: float, dims: ParallelDims) -> float:
    """The mean of a per-rank scalar (the loss) over data-parallel ranks, for logging. With
    pipeline parallelism only the last stage's ranks hold it; the others pass 0."""
    if not dims.is_distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)  # over every rank: tensor-parallel ranks of one dp rank hold the same loss
    return float(t) / (dims.world_size // dims.pp)
