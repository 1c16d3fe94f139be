"""`parallelize(model, plan, dims, cfg, ...)`: a model built on the meta device, laid out over
the ranks by its plan, materialised and initialised, in one fixed order:

  1. pipeline split      this rank's stages (`ModelParts`); every later step works per part
  2. LoRA adapters       `train.lora_rank`: adapters beside the targeted linears, the base frozen
                         (lora_layout.py)
  2b. float8             `train.float8`: the blocks' linears swapped for torchao's Float8Linear
                         (compile/float8.py)
  3. tensor + sequence   DTensor styles on the parts' linear layers, embedding and head
  4. context parallel    the attention core swapped, positions given to each part
  5. expert parallel     the experts sharded over ep, their class swapped for the all-to-all one
  6. recomputation       each block recomputes its activations in backward
  7. compile             `train.compile`: each block compiled in place (regional)
  8. data parallel       the gradient-sync strategy (grad_sync.py): FSDP shards the meta model
                         here; then the model is materialised and initialised, and DDP or ZeRO
                         wrap the real parameters

Why this order. The pipeline split comes first because every other step applies to the
modules a rank keeps, and a stage must be cut from whole modules, before any is replaced by
DTensors. Adapters come before tensor parallelism, whose styles split each adapter as its base
linear (and re-create the parameters they split, trainable: the base is frozen again after the
styles, before FSDP records which parameters train). Tensor parallelism precedes context and
expert parallelism because those act on what runs inside a block (attention core, experts) and
must see the blocks' final input/output layouts; expert parallelism shards the experts before
recomputation wraps the blocks that contain them. Recomputation wraps each block as a whole (its
collectives rerun in backward in the same order on every rank), and compilation must see the
block as it will run, recomputation included, so it comes next. Data parallelism is last: FSDP shards the
parameters as the earlier steps left them (DTensors over tp or ep become 2-D shards), and
DDP/ZeRO need the final, materialised parameters. Materialising after FSDP means no rank ever
holds the full model. The initial values come from the model's `initial_value(name, ...)` per
parameter name (an adapter's from models/common/lora.py), so every layout starts from the
single-process weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.compile.float8 import apply_float8
from shardwise.compile.regional import compile_blocks
from shardwise.core.layout_rules import SPLIT_BACKWARD_SCHEDULES
from shardwise.distributed.context_parallel import ContextParallel, apply_cp
from shardwise.distributed.dims import Meshes, ParallelDims
from shardwise.distributed.expert_parallel import apply_ep
from shardwise.distributed.grad_sync import STRATEGIES, GradSync, local, strategy_key
from shardwise.distributed.lora_layout import apply_lora, refreeze_base
from shardwise.distributed.pipeline_parallel import TiedEmbeddingSync, apply_pp, parts_of
from shardwise.distributed.pipeline_schedule import Pipeline
from shardwise.distributed.recompute import apply_recompute
from shardwise.distributed.tensor_parallel import apply_tp, tensor_parallel_context
from shardwise.models.build import build_on_meta, plan_of
from shardwise.models.common.lora import init_adapters, initial_value_of


@dataclass
class ParallelModel:
    """A model laid out over the ranks, and what the training step needs of the layout."""

    model: nn.Module
    """The whole model, or this rank's pipeline stages (`ModelParts`)."""
    sync: GradSync
    dims: ParallelDims
    meshes: Meshes
    plan: object
    context: ContextParallel | None = None
    """This rank's share of each sequence when cp > 1 (splits the batches)."""
    pipeline: Pipeline | None = None
    """The schedule that runs forward and backward when pp > 1."""

    @property
    def module(self) -> nn.Module:
        """What forward is called on (DDP's wrapper, or the model)."""
        return self.sync.module

    def targets_kwarg(self, cfg) -> str | None:
        """The model's keyword that makes it return the loss (chunked), when this layout can use it."""
        if self.plan.needs_targets or (cfg.train.chunked_loss and self.pipeline is None):
            return self.plan.targets_kwarg
        return None

    def loss_context(self):
        """Around forward, loss and backward under tensor parallelism: loss_parallel, which takes the
        cross-entropy of vocabulary-sharded logits where the loss is not chunked (the chunked loss
        works on local tensors, which it leaves alone)."""
        return tensor_parallel_context() if self.dims.tp > 1 else contextlib.nullcontext()


def apply_compile(parts, plan, cfg, *, tp: int) -> None:
    """`train.compile`: each block compiled in place (shardwise/compile/regional.py)."""
    if cfg.train.compile:
        split_backward = cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES
        compile_blocks(parts, plan, rules=cfg.train.rewrite_rules, backward_runs_twice=split_backward,
                       inside_checkpoint=tp > 1 and cfg.train.recompute == "full")


def parallelize(model: nn.Module, plan, dims: ParallelDims, cfg, *, meshes: Meshes, device: torch.device,
                num_micro_batches: int = 1) -> ParallelModel:
    """Lay out `model` (built on meta) by `plan` over `meshes`, then materialise it on `device`
    and initialise it from `cfg.train.seed`. `num_micro_batches`: per rank and step (the
    pipeline schedule runs them)."""
    if dims.pp > 1:
        model = apply_pp(model, plan, cfg, pp_rank=meshes.world["pp"].get_local_rank(), pp=dims.pp)
    parts = parts_of(model)
    apply_lora(parts, plan, cfg.train)
    apply_float8(parts, plan, cfg.train.float8)
    if dims.tp > 1:
        apply_tp(parts, plan, meshes.world["tp"], sp=cfg.parallel.sp)
    context = apply_cp(parts, plan, cfg, meshes.world["cp"]) if dims.cp > 1 else None
    if dims.ep > 1:
        apply_ep(parts, meshes.experts)
    apply_recompute(parts, plan, cfg.train.recompute)
    apply_compile(parts, plan, cfg, tp=dims.tp)
    refreeze_base(parts)
    strategy = STRATEGIES[strategy_key(dims)]
    strategy.shard(parts, plan, dims, meshes)
    materialize(model, dims, device=device, seed=cfg.train.seed)
    sync = strategy(model, plan, dims, meshes, bucket_mb=cfg.parallel.bucket_mb)
    pipeline = None
    if dims.pp > 1:
        tied = TiedEmbeddingSync(model, meshes.tied) if plan.tied_table is not None else None
        pipeline = Pipeline(model, cfg, pp_mesh=meshes.world["pp"], num_micro_batches=num_micro_batches,
                            device=device, tied=tied)
    return ParallelModel(model=model, sync=sync, dims=dims, meshes=meshes, plan=plan, context=context,
                         pipeline=pipeline)


def parallelize_config(cfg, dims: ParallelDims, *, device: torch.device, meshes: Meshes | None = None) -> ParallelModel:
    """The config's model (its family's model and plan) laid out over this process group
    (meshes built here when not given: a collective)."""
    if meshes is None:
        meshes = dims.build_meshes(device.type, tied_embeddings=cfg.model.tie_embeddings)
    torch.manual_seed(cfg.train.seed)
    return parallelize(build_on_meta(cfg.model), plan_of(cfg.model), dims, cfg, meshes=meshes, device=device,
                       num_micro_batches=dims.num_micro_batches(cfg))


def materialize(model: nn.Module, dims: ParallelDims, *, device: torch.device, seed: int) -> None:
    """Real storage on `device`, and the single-process initial values."""
    model.to_empty(device=device)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        init_sharded_weights(model, seed)
    else:
        model.init_weights(seed)
        init_adapters(model, seed)


def init_sharded_weights(model: nn.Module, seed: int) -> None:
    """Initialise DTensor parameters with exactly the values a single process would get: each
    rank computes the full initial tensor (one at a time) and keeps its shard."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = initial_value_of(model, name, param.shape, param.device, seed)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            local(param).copy_(local(full))
        for name, buffer in model.named_buffers():  # MoE router biases: replicated
            buffer.copy_(model.initial_value(name, buffer.shape, buffer.device, seed))
