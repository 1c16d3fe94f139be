"""ZeRO-1 and ZeRO-2 (Rajbhandari et al., 2020), written by hand.

Why by hand: PyTorch has no faithful ZeRO-1/2. `ZeroRedundancyOptimizer` partitions whole
parameters and broadcasts them (3Ψ moved per step, uneven shards); FSDP2 with
`reshard_after_forward=False` keeps parameters sharded at rest (ZeRO-3 memory, not ZeRO-2).

Layout: every parameter is cut along dim 0 into `n` chunks the way DTensor's `Shard(0)` cuts
it (chunk = ceil(rows / n) rows; the last ranks may hold fewer or none), so optimizer
states are DTensor shards and `torch.distributed.checkpoint` can reshard them.
Rank r owns rows [start_r, end_r) of every parameter and runs AdamW on those rows only:

    grads:  G_r = (1/n) Σ_k G^(k)[start_r:end_r]         (reduce-scatter, per bucket)
    update: W_r ← AdamW(W_r, G_r)                         (local, 8Ψ/n of optimizer state)
    params: W = [W_0; W_1; …; W_{n-1}]                    (all-gather, per bucket)

so each step moves 2·(n-1)/n·Ψ elements per rank, the same as an all-reduce (Ψ = parameters).
ZeRO-1 keeps full local gradients and reduce-scatters once, after the last micro-batch;
ZeRO-2 reduce-scatters after every micro-batch into the owned rows and frees the full
gradients, so only Ψ/n gradient elements live between micro-batches.

Buckets group parameters in reverse definition order (the order backward produces their
gradients); a bucket's reduce-scatter starts, asynchronously, when the last of its gradients
is accumulated, so communication overlaps the rest of the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def reduce_scatter(output, input, *, group, async_op):
    """torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single; 2.11 has only the old
    name. Looked up on each call, so the communication log's wrappers see it."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def all_gather(output, input, *, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


def chunk_rows(num_rows: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Rows [start, end) of chunk `index`, as DTensor Shard(0) / torch.chunk cut them."""
    size = math.ceil(num_rows / num_chunks)
    start = min(index * size, num_rows)
    return start, min(start + size, num_rows)


@dataclass
class ParamShard:
    name: str
    param: nn.Parameter
    rank: int
    world: int
    offset: int = 0
    """Where this parameter's chunk starts inside its bucket's per-rank segment."""
    shard: nn.Parameter = field(init=False)
    """This rank's rows of the parameter: a view, so the optimizer updates the model in place."""

    def __post_init__(self):
        start, end = chunk_rows(self.param.shape[0], self.world, self.rank)
        self.shard = nn.Parameter(self.param.data[start:end])

    @property
    def row_numel(self) -> int:
        return self.param[0].numel()

    @property
    def padded_numel(self) -> int:
        """Space one rank's chunk takes in a bucket segment (the largest chunk)."""
        return math.ceil(self.param.shape[0] / self.world) * self.row_numel

    def rows(self, rank: int) -> tuple[int, int]:
        return chunk_rows(self.param.shape[0], self.world, rank)


@dataclass
class Bucket:
    shards: list[ParamShard]
    segment_numel: int
    pending: set = field(default_factory=set)
    work: object = None
    reduced: torch.Tensor | None = None

    def pack_grads(self, world: int) -> torch.Tensor:
        """Rank-major layout: segment r holds every parameter's rows for rank r (zero-padded)."""
        first = self.shards[0].param
        packed = torch.zeros(world, self.segment_numel, dtype=first.dtype, device=first.device)
        for s in self.shards:
            grad = s.param.grad
            for r in range(world):
                start, end = s.rows(r)
                if grad is not None and end > start:
                    packed[r, s.offset:s.offset + (end - start) * s.row_numel] = grad[start:end].reshape(-1)
        return packed.view(-1)

    def unpack_rows(self, flat: torch.Tensor, s: ParamShard, rank: int) -> torch.Tensor:
        start, end = s.rows(rank)
        return flat[s.offset:s.offset + (end - start) * s.row_numel].view(end - start, *s.param.shape[1:])


class ZeroShardedState:
    """Gradient reduce-scatter, sharded optimizer step and parameter all-gather for ZeRO-1/2."""

    def __init__(self, model: nn.Module, *, stage: int, group, bucket_bytes: int, skip=lambda name: False):
        """`skip(name)`: parameters left to the caller (expert-parallel experts, sharded already)."""
        assert stage in (1, 2)
        self.stage, self.group = stage, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not skip(n)]
        self.shards = [ParamShard(n, p, self.rank, self.world) for n, p in named]
        self.buckets = self.build_buckets(reversed(self.shards), bucket_bytes)
        self.bucket_of = {id(s.param): b for b in self.buckets for s in b.shards}
        self.sync_now = True
        for s in self.shards:
            s.param.register_post_accumulate_grad_hook(self.on_grad_ready)

    def build_buckets(self, shards, bucket_bytes: int) -> list[Bucket]:
        buckets, current, size = [], [], 0
        for s in shards:
            s.offset = size
            current.append(s)
            size += s.padded_numel
            if size * s.param.element_size() >= bucket_bytes:
                buckets.append(Bucket(current, size))
                current, size = [], 0
        if current:
            buckets.append(Bucket(current, size))
        return buckets

    # -- gradients -------------------------------------------------------------------

    def begin_micro_batch(self, is_last: bool) -> None:
        """ZeRO-1 reduces once per step (after the last micro-batch); ZeRO-2 after every one."""
        self.sync_now = is_last or self.stage == 2
        for b in self.buckets:
            b.pending = {id(s.param) for s in b.shards}

    def on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync_now:
            return
        bucket = self.bucket_of[id(param)]
        bucket.pending.discard(id(param))
        if not bucket.pending:
            self.launch(bucket)

    def launch(self, bucket: Bucket) -> None:
        packed = bucket.pack_grads(self.world)
        bucket.reduced = torch.empty(bucket.segment_numel, dtype=packed.dtype, device=packed.device)
        bucket.work = reduce_scatter(bucket.reduced, packed, group=self.group, async_op=True)

    def after_backward(self) -> None:
        """Wait for this micro-batch's reductions and keep the owned rows of the mean gradient."""
        if not self.sync_now:
            return
        for bucket in self.buckets:
            if bucket.work is None:  # a parameter that got no gradient: reduce what there is
                self.launch(bucket)
            bucket.work.wait()
            bucket.work = None
            for s in bucket.shards:
                mean_rows = self.unpack_rows_mean(bucket, s)
                if self.stage == 1:
                    # Keep the mean rows inside the full local gradient: grads stay 4Ψ, not 4Ψ + 4Ψ/n.
                    start, end = s.rows(self.rank)
                    s.param.grad[start:end] = mean_rows
                    s.shard.grad = s.param.grad[start:end]
                else:
                    s.shard.grad = mean_rows.clone() if s.shard.grad is None else s.shard.grad.add_(mean_rows)
                    s.param.grad = None  # ZeRO-2: only the owned rows outlive the micro-batch
            bucket.reduced = None

    def unpack_rows_mean(self, bucket: Bucket, s: ParamShard) -> torch.Tensor:
        return bucket.unpack_rows(bucket.reduced, s, self.rank) / self.world

    def grad_norm(self, *, sum_over=None, skip_names=frozenset(), extra_squared=None) -> torch.Tensor:
        """Global L2 norm of the mean gradient: each rank sums the squares of its rows (and the
        `sum_over` group, pipeline stages, sums its members' parameters; `skip_names` are
        counted by another member). `extra_squared`: this rank's share of the squared norm of
        gradients it holds outside the shards, summed over the group with the rest."""
        local = sum((s.shard.grad.float().pow(2).sum() for s in self.shards
                     if s.shard.grad is not None and s.name not in skip_names),
                    torch.zeros((), device=self.shards[0].param.device))
        if extra_squared is not None:
            local = local + extra_squared
        dist.all_reduce(local, group=self.group)
        if sum_over is not None:
            dist.all_reduce(local, group=sum_over)
        return local.sqrt()

    def clip_grads(self, max_norm: float, *, sum_over=None, skip_names=frozenset(), extra_squared=None,
                   extra_grads=()) -> float:
        """As torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)); `extra_grads`
        (whose squares `extra_squared` brought into the norm) are scaled too."""
        norm = self.grad_norm(sum_over=sum_over, skip_names=skip_names, extra_squared=extra_squared)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in [s.shard.grad for s in self.shards if s.shard.grad is not None] + list(extra_grads):
            grad.mul_(scale)
        return float(norm)

    # -- parameters ------------------------------------------------------------------

    def all_gather_params(self) -> None:
        """After the optimizer updated the owned rows, every rank gets every row back."""
        for bucket in self.buckets:
            first = bucket.shards[0].param
            mine = torch.zeros(bucket.segment_numel, dtype=first.dtype, device=first.device)
            for s in bucket.shards:
                mine[s.offset:s.offset + s.shard.numel()] = s.shard.detach().reshape(-1)
            gathered = torch.empty(self.world * bucket.segment_numel, dtype=first.dtype, device=first.device)
            all_gather(gathered, mine, group=self.group)
            segments = gathered.view(self.world, bucket.segment_numel)
            with torch.no_grad():
                for s in bucket.shards:
                    for r in range(self.world):
                        start, end = s.rows(r)
                        if r != self.rank and end > start:
                            s.param[start:end] = bucket.unpack_rows(segments[r], s, r)

    def zero_grad(self) -> None:
        for s in self.shards:
            s.param.grad = None
            s.shard.grad = None

    def grad_tensors(self) -> list[torch.Tensor]:
        """Gradients this rank holds: full ones (ZeRO-1, shards are views) or only the rows (ZeRO-2)."""
        tensors = [s.param.grad for s in self.shards if s.param.grad is not None]
        return tensors + [s.shard.grad for s in self.shards if s.shard.grad is not None]

    def as_dtensor(self, s: ParamShard, local: torch.Tensor, mesh) -> DTensor:
        """A row-shard tensor of `s` as the DTensor it is, so checkpoints can reshard it."""
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=s.param.shape, stride=s.param.stride())
