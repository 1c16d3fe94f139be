"""ParallelDims: the validated degrees of a layout and the DeviceMesh that carries them.

One object, built once from the `parallel` config and the launched world size, passed as an
argument to whatever needs a degree, a rank or a process group. Nothing here is global.

Every mesh and process group of a run is built here (`build_meshes`), and nowhere else:

  world     ("pp", "dp_replicate", "dp_shard", "cp", "tp"), plus "dp_shard_cp" flattened when
            cp > 1. `dp_shard` is the data axis that ZeRO shards over (stages 1-3) or
            replicates over (stage 0); with HSDP, `dp_replicate` groups hold full replicas of a
            `dp_shard`-sharded model; `dims.dp` = dp_replicate x dp_shard counts them all.
  experts   ("pp", "dp_replicate", "edp", "ep", "tp") over the same ranks when ep > 1: the ep
            axis is carved from the dp_shard x cp ranks (see expert_parallel.py)
  tied      the group of the first and last pipeline rank of each (dp, cp, tp) coordinate,
            when a pipeline splits a model with tied embeddings

Axes of size 1 are kept so code can always name them. Each axis name means one thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.config.schema import Config, ParallelConfig

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "dp_replicate", "edp", "ep", "tp")


@dataclass(frozen=True)
class Meshes:
    """The meshes of one run (all None in a single process, where no group exists)."""

    world: DeviceMesh | None = None
    experts: DeviceMesh | None = None
    """The (pp, dp_replicate, edp, ep, tp) mesh when parallel.ep > 1."""
    tied: object | None = None
    """The process group of the pipeline's first and last ranks holding a tied embedding table."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    """Data-parallel ranks inside one replicate group (all of them unless HSDP)."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0

    @property
    def dp(self) -> int:
        """All data-parallel ranks: the global batch is split this many ways."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_axis(self) -> str:
        """The mesh axis over which gradients of replicated parameters are averaged (and ZeRO
        shards): dp_shard, or dp_shard and cp flattened into "dp_shard_cp" (context-parallel ranks hold the same
        parameters and different tokens of the same sequences)."""
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    @property
    def num_grad_ranks(self) -> int:
        """Ranks on `grad_axis` (within one HSDP replicate group)."""
        return self.dp_shard * self.cp

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> "ParallelDims":
        others = parallel.tp * parallel.cp * parallel.pp
        dp = parallel.dp or world_size // others
        if not parallel.dp and dp * others != world_size:
            raise ValueError(
                f"parallel: tp*cp*pp = {parallel.tp}*{parallel.cp}*{parallel.pp} = {others} does not divide the "
                f"process count {world_size}; use degrees whose product divides {world_size}, "
                f"or launch a multiple of {others} processes (--nproc)"
            )
        if dp < 1 or dp * others != world_size:
            raise ValueError(
                f"parallel: dp*tp*cp*pp = {dp}*{parallel.tp}*{parallel.cp}*{parallel.pp} = {dp * others} "
                f"but {world_size} processes were launched; make the product equal the process count "
                f"(parallel.dp = 0 fills it when {world_size} divides by tp*cp*pp = {others})"
            )
        if dp % parallel.dp_replicate:
            raise ValueError(f"parallel.dp_replicate = {parallel.dp_replicate} is invalid: "
                             f"use a divisor of the data-parallel degree ({dp})")
        return cls(
            world_size=world_size, dp_replicate=parallel.dp_replicate, dp_shard=dp // parallel.dp_replicate,
            tp=parallel.tp, cp=parallel.cp, pp=parallel.pp, ep=parallel.ep, zero=parallel.zero,
        )

    def describe(self) -> str:
        """A short name of the layout, e.g. "1 process", "dp4 zero1", "hsdp 2x2 zero3"."""
        if not self.is_distributed:
            return "1 process"
        data = f"hsdp {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp}"
        others = "".join(f" {name}{getattr(self, name)}" for name in ("tp", "cp", "pp", "ep") if getattr(self, name) > 1)
        return f"{data} zero{self.zero}{others}"

    def check(self, cfg: Config) -> None:
        """Everything about the model and batch the layout needs, before any work starts."""
        from shardwise.core.layout_checks import (
            check_context_parallel,
            check_expert_parallel,
            check_pipeline,
            check_tensor_parallel,
        )
        from shardwise.compile.regional import check_compile
        from shardwise.distributed.pipeline_parallel import schedule_unavailable
        from shardwise.models.families import spec_of

        spec = spec_of(cfg.model.family)
        self.check_batch(cfg)
        check_tensor_parallel(cfg.model, spec, tp=self.tp, sp=cfg.parallel.sp, seq_len=cfg.train.seq_len,
                              length_multiple=cfg.data.length_multiple)
        check_context_parallel(cfg, spec, cp=self.cp, tp=self.tp)
        check_pipeline(cfg, spec, pp=self.pp, num_micro_batches=self.num_micro_batches(cfg),
                       schedule_unavailable=schedule_unavailable(cfg.parallel.pp_schedule))
        check_expert_parallel(cfg, ep=self.ep, dp_shard=self.dp_shard, cp=self.cp, dp_replicate=self.dp_replicate)
        check_compile(cfg, tp=self.tp)

    def check_batch(self, cfg: Config) -> None:
        """The global batch must split evenly over data-parallel ranks and micro-batches."""
        per_step = cfg.train.micro_batch_size * self.dp
        if cfg.train.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size = {cfg.train.global_batch_size} is invalid: use a multiple of "
                f"train.micro_batch_size x dp = {cfg.train.micro_batch_size} x {self.dp} = {per_step}"
            )

    def num_micro_batches(self, cfg: Config) -> int:
        return cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.dp)

    def build_meshes(self, device_type: str, *, tied_embeddings: bool = False) -> Meshes:
        """Every mesh and group of this layout (collectives: every rank calls this, once)."""
        if not self.is_distributed:
            return Meshes()
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        if self.cp > 1:
            world["dp_shard", "cp"]._flatten(self.grad_axis)
        experts = None
        if self.ep > 1:
            expert_shape = (self.pp, self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            experts = init_device_mesh(device_type, expert_shape, mesh_dim_names=EXPERT_MESH_AXES)
        tied = None
        if self.pp > 1 and tied_embeddings:
            ends = world.mesh.reshape(self.pp, -1)  # [pp rank, every other coordinate]
            pairs = [[int(ends[0, j]), int(ends[-1, j])] for j in range(ends.shape[1])]
            tied, _ = dist.new_subgroups_by_enumeration(pairs)
        return Meshes(world=world, experts=experts, tied=tied)

    def dp_rank(self, meshes: Meshes) -> int:
        """This rank's index among all data-parallel ranks (replicate-major), for the data loader."""
        if meshes.world is None:
            return 0
        return meshes.world["dp_replicate"].get_local_rank() * self.dp_shard + meshes.world["dp_shard"].get_local_rank()
