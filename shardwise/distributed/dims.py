"""ParallelDims: the validated degrees of a layout and the DeviceMesh that carries them.

One object, built once from the `parallel` config and the launched world size, passed as an
argument to whatever needs a degree, a rank or a process group. Nothing here is global.

Mesh axes, outermost first: ("pp", "dp_replicate", "dp", "cp", "tp"). `dp` is the data axis
that ZeRO shards over (stages 1-3) or replicates over (stage 0); with HSDP, `dp_replicate`
groups hold full replicas of a `dp`-sharded model. Axes of size 1 are kept so code can always
name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.config.schema import Config, ParallelConfig

MESH_AXES = ("pp", "dp_replicate", "dp", "cp", "tp")


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
        shards): dp, or dp and cp flattened into "dp_cp" (context-parallel ranks hold the same
        parameters and different tokens of the same sequences)."""
        return "dp_cp" if self.cp > 1 else "dp"

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
        from shardwise.distributed.context_parallel import check_context_parallel
        from shardwise.distributed.expert_parallel import check_expert_parallel
        from shardwise.distributed.pipeline_parallel import check_pipeline
        from shardwise.distributed.tensor_parallel import check_tensor_parallel

        self.check_batch(cfg)
        check_tensor_parallel(cfg.model, tp=self.tp, sp=cfg.parallel.sp, seq_len=cfg.train.seq_len)
        check_context_parallel(cfg, cp=self.cp, tp=self.tp)
        check_pipeline(cfg, pp=self.pp, num_micro_batches=self.num_micro_batches(cfg))
        check_expert_parallel(cfg, self)

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

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The DeviceMesh over all ranks (None in a single process, where no group exists)."""
        if not self.is_distributed:
            return None
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        if self.cp > 1:
            mesh["dp", "cp"]._flatten(self.grad_axis)  # a collective: every rank builds the group
        return mesh

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among all data-parallel ranks (replicate-major), for the data loader."""
        if mesh is None:
            return 0
        return mesh["dp_replicate"].get_local_rank() * self.dp_shard + mesh["dp"].get_local_rank()


def backend_for(device: torch.device) -> str:
    """gloo on CPU, nccl on CUDA, and whatever torch registers for other accelerators."""
    return dist.get_default_backend_for_device(device)
