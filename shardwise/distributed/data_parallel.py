"""The data-parallel family over the `dp` mesh axis, selected by `parallel.zero`:

| zero | module                       | who reduces what                                        |
|------|------------------------------|---------------------------------------------------------|
| 0    | torch DDP                    | all-reduce of bucketed gradients, overlapped with backward, skipped on non-final micro-batches |
| 1, 2 | `zero.ZeroShardedState`      | reduce-scatter of gradients, sharded AdamW, all-gather of parameters (by hand, see zero.py) |
| 3    | FSDP2 `fully_shard` per block | all-gather parameters per block in forward and backward, reduce-scatter gradients |
| HSDP | FSDP2 on the 2-D (dp_replicate, dp) mesh | ZeRO-3 inside a group, all-reduce across groups |
| 0 with tp > 1 | `AllReduceDP`            | one coalesced all-reduce of the local (tensor-parallel) gradient shards per step |
| 3 with tp > 1 | FSDP2 over the tensor-parallel model | as ZeRO-3, on the dp axis of a 2-D (dp, tp) layout |
| 0 with pp > 1 | `AllReduceDP`            | as above, after the pipeline schedule has run all micro-batches |
| 1 with pp > 1 | `zero.ZeroShardedState`  | one reduce-scatter per step after the schedule (ZeRO-2 is refused: it would free gradients the schedule still accumulates) |
| 3 with pp > 1 | FSDP2 per stage            | each stage its own root; the pipeline stage syncs gradients on its last backward |
| 0 with ep > 1 | `AllReduceDP`            | dense gradients as above; expert gradients (sharded over ep) summed over the edp group, divided by dp x cp (expert_parallel.py) |
| 1, 2 with ep > 1 | `zero.ZeroShardedState` for dense | dense parameters row-sharded as above; experts (sharded over ep) left out and reduced over edp as with ZeRO-0 |
| 3 with ep > 1 | FSDP2, experts their own units | dense parts on the dp axis, each MoE layer's experts on the edp axis (1/ep applied in backward) |

Every strategy exposes the same small interface to the trainer (`DataParallel`), so the loop
is one code path for one process and for N. Checkpoint tensors are keyed by parameter name
(`model/<name>`, `optim/<name>/<state>`), replicated tensors plain and sharded ones DTensors,
so a checkpoint written under one strategy loads under any other.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardwise.config.schema import Config
from shardwise.distributed.context_parallel import ContextParallel
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.expert_parallel import (
    apply_expert_parallel,
    build_expert_mesh,
    is_expert_param,
    reduce_expert_grads,
    shard_experts_fsdp,
)
from shardwise.distributed.pipeline_parallel import Pipeline, build_stage_parts, parts_of
from shardwise.distributed.tensor_parallel import (
    align_grad_placements,
    apply_tensor_parallel,
    tensor_parallel_context,
)
from shardwise.distributed.zero import ZeroShardedState
from shardwise.models.llama.model import Llama
from shardwise.train.recompute import apply_recompute
from shardwise.train.optim import build_optimizer


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros) before the first step, so a checkpoint can be loaded into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


class DataParallel:
    """One process, or replicated parameters (ZeRO-0). Subclasses change how gradients are
    reduced and where the optimizer state lives."""

    def __init__(self, model: Llama, cfg: Config, dims: ParallelDims, mesh):
        self.model, self.cfg, self.dims, self.mesh = model, cfg, dims, mesh
        self.module: nn.Module = model
        self.optimizer: torch.optim.Optimizer | None = None
        self.pipeline: Pipeline | None = None
        self.context: ContextParallel | None = None
        """This rank's share of each sequence when parallel.cp > 1 (the trainer splits batches with it)."""
        """The schedule that runs forward and backward when parallel.pp > 1 (then `model` is this rank's stages)."""

    def make_optimizer(self) -> torch.optim.Optimizer:
        """Called once the parameters hold their real (materialised, initialised) storage."""
        return build_optimizer(self.model.parameters(), self.cfg.train)

    def micro_batch(self, index: int, count: int):
        return contextlib.nullcontext()

    def loss_context(self):
        """Wraps forward, loss and backward (tensor parallelism needs loss_parallel there)."""
        return tensor_parallel_context() if self.dims.tp > 1 else contextlib.nullcontext()

    def after_backward(self) -> None:
        if self.dims.tp > 1:
            align_grad_placements(self.model)

    def pp_group(self):
        """Pipeline stages hold disjoint parameters: a global norm sums over this group."""
        return self.mesh["pp"].get_group() if self.dims.pp > 1 else None

    def tied_table_copy(self):
        """A pipeline rank's copy of a tied table that another rank also holds (counted once in norms)."""
        return self.model.tied_table_copy() if self.dims.pp > 1 else None

    expert_mesh = None
    """The (edp, ep) mesh of expert-parallel layouts (see expert_parallel.py)."""

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.dims.tp > 1 or self.dims.pp > 1 or self.dims.ep > 1:  # DTensors on several meshes, or stages on other ranks
            return clip_grad_norm_mixed(self.model.parameters(), max_norm, sum_over=self.pp_group(),
                                        skip=self.tied_table_copy())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # FSDP: a DTensor

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """model/ and optim/ tensors by parameter name (optimizer state created if still empty)."""
        init_adam_state(self.optimizer)
        tensors = {f"model/{name}": t for name, t in self.model.state_dict().items()}
        for name, param in self.model.named_parameters():
            for key, value in self.optimizer.state[param].items():
                tensors[f"optim/{name}/{key}"] = value
        return tensors

    def mean_over_dp(self, value: float) -> float:
        """The mean of a per-rank scalar (the loss) over data-parallel ranks, for logging. With
        pipeline parallelism only the last stage's ranks hold it; the others pass 0."""
        if not self.dims.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)  # over every rank: tensor-parallel ranks of one dp rank hold the same loss
        return float(t) / (self.dims.world_size // self.dims.pp)


def clip_grad_norm_mixed(params, max_norm: float, *, sum_over=None, skip=None) -> float:
    """clip_grad_norm_ for parameters that are DTensors on different meshes (tensor parallel,
    FSDP over tensor parallel) or plain tensors: each gradient's norm is reduced over its own
    mesh by DTensor, then the norms are combined here, and over the `sum_over` group (pipeline
    stages) when given. `skip`: a parameter whose gradient is clipped but counted elsewhere."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    squared = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for p, g in zip(params, grads):
        if p is skip:
            continue
        norm = torch.linalg.vector_norm(g.float())
        squared = squared + (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if sum_over is not None:
        dist.all_reduce(squared, group=sum_over)
    total = float(squared.sqrt())
    scale = min(1.0, max_norm / (total + 1e-6))
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total


class AllReduceDP(DataParallel):
    """ZeRO-0 over tensor-parallel (DTensor) parameters, which DDP does not take: after the last
    micro-batch each rank all-reduces its local gradient shards over the `dp` axis, coalesced
    into one flat buffer per step (not overlapped with backward, unlike DDP)."""

    def __init__(self, model, cfg, dims, mesh):
        super().__init__(model, cfg, dims, mesh)
        self.group = mesh[dims.grad_axis].get_group()
        self.is_last = True

    def micro_batch(self, index: int, count: int):
        self.is_last = index == count - 1
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        super().after_backward()
        if not self.is_last:
            return
        named = list(self.model.named_parameters())
        expert_parallel = self.expert_mesh is not None
        locals_ = [local(p.grad) for n, p in named if p.grad is not None and not (expert_parallel and is_expert_param(n))]
        if expert_parallel:  # expert gradients are averaged over another group
            reduce_expert_grads(named, self.expert_mesh, self.dims.num_grad_ranks)
        flat = torch.cat([g.reshape(-1) for g in locals_])
        dist.all_reduce(flat, group=self.group)
        flat /= self.dims.num_grad_ranks
        offset = 0
        for g in locals_:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ReplicatedDP(DataParallel):
    """ZeRO-0: PyTorch DDP. Its comm hook goes through `dist.all_reduce`, so the communication
    log sees the traffic."""

    def __init__(self, model, cfg, dims, mesh):
        super().__init__(model, cfg, dims, mesh)
        group = mesh[dims.grad_axis].get_group()
        self.module = DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=cfg.parallel.bucket_mb, gradient_as_bucket_view=True,
        )
        self.module.register_comm_hook(group, default_hooks.allreduce_hook)

    def micro_batch(self, index: int, count: int):
        # Gradients of non-final micro-batches accumulate locally; one all-reduce per step.
        return self.module.no_sync() if index < count - 1 else contextlib.nullcontext()


class ZeroDP(DataParallel):
    """ZeRO-1/2: replicated parameters, row-sharded optimizer state (and gradients at stage 2).
    With expert parallelism the experts (sharded over ep already) stay out of the row sharding:
    their gradients are averaged over edp after the last micro-batch as with ZeRO-0, and their
    optimizer states are 1/ep per rank, replicated over edp."""

    def __init__(self, model, cfg, dims, mesh, expert_mesh=None):
        super().__init__(model, cfg, dims, mesh)
        self.expert_mesh = expert_mesh
        is_expert = is_expert_param if expert_mesh is not None else (lambda name: False)
        self.zero = ZeroShardedState(model, stage=dims.zero, group=mesh[dims.grad_axis].get_group(),
                                     bucket_bytes=int(cfg.parallel.bucket_mb * 2**20), skip=is_expert)
        self.experts = [(n, p) for n, p in model.named_parameters() if is_expert(n)]
        self.is_last = True

    def make_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer([s.shard for s in self.zero.shards] + [p for _, p in self.experts], self.cfg.train)

    def micro_batch(self, index: int, count: int):
        self.is_last = index == count - 1
        self.zero.begin_micro_batch(is_last=self.is_last)
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        self.zero.after_backward()
        if self.experts and self.is_last:
            reduce_expert_grads(self.experts, self.expert_mesh, self.dims.num_grad_ranks)

    def expert_grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for _, p in self.experts if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> float:
        skip = {"embed_tokens.weight"} if self.tied_table_copy() is not None else set()
        grads = self.expert_grads()
        extra = None
        if grads:  # each expert is held by edp ranks of the group: count it once
            extra = sum(g.float().pow(2).sum() for g in grads) / self.expert_mesh["edp"].size()
        return self.zero.clip_grads(max_norm, sum_over=self.pp_group(), skip_names=skip, extra_squared=extra,
                                    extra_grads=grads)

    def step(self) -> None:
        self.optimizer.step()
        self.zero.all_gather_params()

    def zero_grad(self) -> None:
        self.zero.zero_grad()
        for _, p in self.experts:
            p.grad = None

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.zero.grad_tensors() + [p.grad for _, p in self.experts if p.grad is not None]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        init_adam_state(self.optimizer)
        tensors = {f"model/{name}": t for name, t in self.model.state_dict().items()}
        dp_mesh = self.mesh[self.dims.grad_axis]
        for s in self.zero.shards:
            for key, value in self.optimizer.state[s.shard].items():
                sharded = value.dim() > 0  # `step` is a replicated scalar
                tensors[f"optim/{s.name}/{key}"] = self.zero.as_dtensor(s, value, dp_mesh) if sharded else value
        for name, param in self.experts:  # DTensors over ep already
            for key, value in self.optimizer.state[param].items():
                tensors[f"optim/{name}/{key}"] = value
        return tensors


class FullyShardedDP(DataParallel):
    """ZeRO-3 (and HSDP on a 2-D mesh) with FSDP2: each block is its own all-gather unit, the
    root holds the embedding (tied to the output head), final norm and head. Each pipeline
    stage is a root of its own."""

    def __init__(self, model, cfg, dims, mesh):
        axis = dims.grad_axis
        dp_mesh = mesh["dp_replicate", axis] if dims.dp_replicate > 1 else mesh[axis]
        for part in parts_of(model):
            for block in part.layers.values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
            fully_shard(part, mesh=dp_mesh, reshard_after_forward=True)
        super().__init__(model, cfg, dims, mesh)


def init_sharded_weights(model: Llama, seed: int) -> None:
    """Initialise DTensor parameters with exactly the values a single process would get: each
    rank computes the full initial tensor (one at a time) and keeps its shard."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = model.initial_value(name, param.shape, param.device, seed)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            local(param).copy_(local(full))
        for name, buffer in model.named_buffers():  # MoE router biases: replicated
            buffer.copy_(model.initial_value(name, buffer.shape, buffer.device, seed))


def build_data_parallel(cfg: Config, dims: ParallelDims, mesh, device: torch.device) -> DataParallel:
    """Build the model for this layout and wrap it, in DESIGN.md's order: meta -> pipeline
    stages -> tensor parallel -> context parallel -> recomputation -> data parallel (FSDP for
    ZeRO-3) -> materialise -> init -> optimizer (which must see the parameters' final storage)."""
    if dims.pp > 1:
        model = build_stage_parts(cfg, pp_rank=mesh["pp"].get_local_rank(), pp=dims.pp)
    else:
        with torch.device("meta"):
            model = Llama(cfg.model)
    if dims.tp > 1:
        for part in parts_of(model):
            apply_tensor_parallel(part, mesh["tp"], sp=cfg.parallel.sp)
    context = None
    if dims.cp > 1:
        context = ContextParallel(cfg, mesh["cp"])
        context.apply(parts_of(model))
    apply_recompute(parts_of(model), cfg.train.recompute)
    expert_mesh = build_expert_mesh(dims, device.type) if dims.ep > 1 else None
    if expert_mesh is not None:
        for part in parts_of(model):
            apply_expert_parallel(part, expert_mesh)
    replicas = dims.dp * dims.cp  # ranks holding the same parameters (and different tokens)
    if replicas > 1 and dims.zero == 3:
        if expert_mesh is not None:  # the experts first: their own FSDP units, on the edp axis
            for part in parts_of(model):
                shard_experts_fsdp(part, expert_mesh)
        strategy = FullyShardedDP(model, cfg, dims, mesh)
    elif replicas > 1 and dims.zero == 0 and (dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        strategy = AllReduceDP(model, cfg, dims, mesh)
    else:
        strategy = None
    model.to_empty(device=device)
    if dims.is_distributed and (dims.tp > 1 or dims.zero == 3 or dims.ep > 1):
        init_sharded_weights(model, cfg.train.seed)
    else:
        model.init_weights(cfg.train.seed)
    if strategy is None:
        if replicas == 1:
            strategy = DataParallel(model, cfg, dims, mesh)
        else:
            strategy = ReplicatedDP(model, cfg, dims, mesh) if dims.zero == 0 else \
                ZeroDP(model, cfg, dims, mesh, expert_mesh=expert_mesh)
    strategy.optimizer = strategy.make_optimizer()
    strategy.context = context
    strategy.expert_mesh = expert_mesh
    if dims.pp > 1:
        strategy.pipeline = Pipeline(model, cfg, mesh=mesh, num_micro_batches=dims.num_micro_batches(cfg),
                                     device=device)
    return strategy
