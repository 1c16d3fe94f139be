"""Expert parallelism over the `ep` axis of the expert mesh (`ParallelDims.build_meshes`).

Layout. The `ep` axis is carved from the ranks that average gradients (dp, or dp x cp: the
ranks that hold the same dense parameters and different tokens): their index j = dp * cp + c
splits as (j // ep, j % ep) = (edp, ep). An `ep` group of ranks holds the n_experts experts
between them, n_experts / ep each, as DTensors Shard(0) on the `ep` axis (so checkpoints stay
keyed by name and reshard); ranks with the same ep index and different edp index hold the
same experts. Tensor parallelism splits only the dense parts: a MoE layer (router, experts,
shared experts) is replicated over `tp` ranks, which route the same tokens.

One MoE layer's experts on rank r of an ep group (k assignments per token, sorted by expert):
  1. counts c[r, e] of rank r's assignments to expert e; all-to-all so that rank d learns
     c[s, e] for its experts e from every source s (equal splits, n_experts / ep integers);
  2. dispatch: rows for the experts of rank d go to rank d (all-to-all, uneven splits
     sum_e c[r, e] over d's experts); received rows are ordered (source, expert), and are
     regrouped to (expert, source) for one grouped matmul over the local experts;
  3. combine: the inverse regrouping, and the transposed all-to-all back to the sources.
Both all-to-alls are `AllToAll` below; autograd runs the transposed exchange in backward.

Gradients. An expert's gradient on its rank sums the contributions of the tokens of all ep
ranks (each already scaled by its own rank's 1/micro-batches), so the data-parallel mean
is: sum over the edp group, divided by all gradient-averaging ranks (dp x cp), not by edp.
ZeRO-0: `reduce_expert_grads` does that after the last micro-batch; ZeRO-3: the experts are
their own FSDP2 unit on the edp axis (as torchtitan does), whose reduce-scatter averages over
edp, and the expert weights' gradients are scaled by 1/ep on the way (`ScaleGrad`):
torchtitan's `set_gradient_divide_factor(dp x cp)` needs ReduceOp.PREMUL_SUM, which gloo lacks.
ZeRO-1/2: the dense parameters are row-sharded as usual; the experts are left out of it and
reduced as with ZeRO-0 (grad_sync.py). HSDP is refused.

Attaching: each MoE layer's `experts` module gets its class swapped for an expert-parallel
subclass (as FSDP2's `fully_shard` does) whose forward exchanges tokens by all-to-all; its
parameters become DTensors sharded over ep, under the same names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.models.common.moe import moe_layers


class AllToAll(torch.autograd.Function):
    """Rows exchanged within `group` (p ranks): rank r sends X[r -> d] (in_splits[d] rows, in
    rank order) to each rank d and receives Y = [X[s -> r] for s in 0..p-1] (out_splits[s] rows).
    The exchange is a permutation of rows across ranks, so its transpose is the inverse
    exchange: dX = all_to_all(dY) with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


class ScaleGrad(torch.autograd.Function):
    """y = x; dx = scale * dy."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class ExpertParallel:
    """Mixed into an experts module's class: its forward for experts sharded over `ep_group`
    (see the layout notes); the experts' own `compute` runs on the local ones."""

    ep_group = None
    ep_size = 1
    grad_scale = 1.0

    def forward(self, x_sorted_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        group, ep = self.ep_group, self.ep_size
        send_counts = counts_E.view(ep, -1).contiguous()  # [destination rank, its local expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, local expert]
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        x_recv = AllToAll.apply(x_sorted_ND, recv_splits, send_splits, group)
        num_local = recv_counts.shape[1]
        expert_of_row = torch.arange(num_local, device=counts_E.device).repeat(ep).repeat_interleave(recv_counts.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)  # (source, expert) order -> (expert, source)
        local_weights = [ScaleGrad.apply(w.to_local(), self.grad_scale) if self.grad_scale != 1 else w.to_local()
                         for w in self.expert_weights()]
        y = self.compute(x_recv[by_expert], recv_counts.sum(0), local_weights)
        y_recv = torch.empty_like(y).index_copy(0, by_expert, y)
        return AllToAll.apply(y_recv, send_splits, recv_splits, group)


_EXPERT_PARALLEL_CLASSES: dict[type, type] = {}


def expert_parallel_class(cls: type) -> type:
    if cls not in _EXPERT_PARALLEL_CLASSES:
        _EXPERT_PARALLEL_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    return _EXPERT_PARALLEL_CLASSES[cls]


def apply_ep(parts, expert_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over the `ep` axis (on meta, before materialising) and
    route their forward through the all-to-all dispatch/combine."""
    ep_mesh = expert_mesh["ep"]
    for layer in (layer for part in parts for layer in moe_layers(part).values()):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.__class__ = expert_parallel_class(type(experts))
        experts.ep_group, experts.ep_size = ep_mesh.get_group(), ep_mesh.size()


def shard_experts_fsdp(parts, expert_mesh: DeviceMesh) -> None:
    """ZeRO-3: each MoE layer's experts an FSDP2 unit over `edp`, which averages over edp; the
    1/ep that makes it a mean over all gradient-averaging ranks is applied in backward (see the
    layout notes). Call before the blocks are sharded."""
    from torch.distributed.fsdp import fully_shard

    for layer in (layer for part in parts for layer in moe_layers(part).values()):
        fully_shard(layer.experts, mesh=expert_mesh["edp"], reshard_after_forward=True)
        layer.experts.grad_scale = 1.0 / expert_mesh["ep"].size()


def reduce_expert_grads(expert_params, expert_mesh: DeviceMesh, num_grad_ranks: int) -> None:
    """ZeRO-0: average expert gradients: sum over the edp group, divide by dp x cp."""
    grads = [p.grad.to_local() for p in expert_params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if expert_mesh["edp"].size() > 1:
        dist.all_reduce(flat, group=expert_mesh["edp"].get_group())
    flat /= num_grad_ranks
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class ExpertGrads:
    """The experts' gradients under ZeRO-0/1/2, beside the dense strategy (grad_sync.py): summed
    over the edp group and divided by dp x cp after the last micro-batch; their optimizer
    states are 1/ep per rank, replicated over edp, saved as the DTensors they are."""

    def __init__(self, model, plan, expert_mesh: DeviceMesh, num_grad_ranks: int):
        self.named = [(n, p) for n, p in model.named_parameters() if plan.is_expert_param(n)]
        self.params = [p for _, p in self.named]
        self.names = {n for n, _ in self.named}
        self.mesh, self.num_grad_ranks = expert_mesh, num_grad_ranks

    def reduce(self) -> None:
        reduce_expert_grads(self.params, self.mesh, self.num_grad_ranks)

    def grads(self) -> list[torch.Tensor]:
        """This rank's shards of the experts' gradients (plain tensors)."""
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def squared_share(self) -> torch.Tensor:
        """This rank's share of the experts' squared gradient norm when the sum runs over the whole
        dp x cp group: each expert is held by the edp ranks of its group, so count it 1/edp times."""
        total = sum((g.float().pow(2).sum() for g in self.grads()), torch.zeros((), device=self.params[0].device))
        return total / self.mesh["edp"].size()

    def named_params(self):
        for name, param in self.named:
            yield name, param, lambda value: value

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
