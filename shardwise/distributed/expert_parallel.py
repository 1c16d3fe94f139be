"""Mixture-of-experts across ranks: the per-step expert statistics (load, drops, aux losses)
summed over ranks, and the aux-loss-free router bias update that needs them.

Statistics: each MoE layer records sums over its calls (shardwise.models.common.moe). A rank
holds some layers (pipeline stages) and sees some tokens (data, context and expert parallel
ranks see different ones; tensor-parallel ranks of one data rank see the same). One all-reduce
(sum) over every rank of a [n_layers, n_experts + 5] table, divided by tp, gives every rank
the global figures, so the bias update that follows is identical everywhere.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.config.errors import invalid
from shardwise.models.common.moe import grouped_swiglu, moe_layers

_EXTRA = ("dropped", "assigned", "aux_loss", "z_loss", "calls")


@dataclass
class MoEStepStats:
    tokens_per_expert: dict[int, list[int]]
    """Assignments routed to each expert (before dropping), per MoE layer, over the whole step."""
    dropped_fraction: float
    """Assignments dropped past capacity / all assignments, over all MoE layers."""
    aux_loss: float
    """aux_loss_coef x load-balancing loss, summed over layers, mean over micro-batches: what the step's loss includes."""
    z_loss: float
    """z_loss_coef x router z-loss, likewise."""

    def metrics(self) -> dict:
        return {"moe_aux_loss": self.aux_loss, "moe_z_loss": self.z_loss,
                "moe_dropped_fraction": self.dropped_fraction,
                "moe_tokens_per_expert": {str(k): v for k, v in self.tokens_per_expert.items()}}


def layer_index(module_name: str) -> int:
    """`layers.3.mlp` (or `parts.0.layers.3.mlp` on a pipeline rank) -> 3."""
    return int(module_name.split("layers.")[1].split(".")[0])


def collect_moe_stats(model, cfg, *, tp: int = 1, distributed: bool = False) -> MoEStepStats | None:
    """The step's statistics over all ranks (a collective when `distributed`); resets the layers' records."""
    if not cfg.n_experts:
        return None
    layers = moe_layers(model)
    device = next(model.parameters()).device
    table = torch.zeros(cfg.n_layers, cfg.n_experts + len(_EXTRA), dtype=torch.float64, device=device)
    for name, layer in layers.items():
        stats = layer.take_stats()
        if stats:
            row = table[layer_index(name)]
            row[:cfg.n_experts] = stats["tokens"].to(row)
            for j, key in enumerate(_EXTRA):
                row[cfg.n_experts + j] = stats[key].to(row)
    if distributed:
        dist.all_reduce(table)
        table /= tp
    moe_rows = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    extra = {key: table[moe_rows, cfg.n_experts + j] for j, key in enumerate(_EXTRA)}
    calls = extra["calls"].clamp(min=1)  # layers that never ran (no step yet) count as 0
    assigned = float(extra["assigned"].sum())
    return MoEStepStats(
        tokens_per_expert={i: [round(float(x)) for x in table[i, :cfg.n_experts]] for i in moe_rows},
        dropped_fraction=float(extra["dropped"].sum()) / assigned if assigned else 0.0,
        aux_loss=float((extra["aux_loss"] / calls).sum()),
        z_loss=float((extra["z_loss"] / calls).sum()),
    )


def update_router_biases(model, cfg, stats: MoEStepStats) -> None:
    """Aux-loss-free balancing: move each router's selection bias against its global load (the
    same figures on every rank, so every replica of a router stays equal)."""
    if not cfg.router_bias_update_rate:
        return
    for name, layer in moe_layers(model).items():
        load = torch.tensor(stats.tokens_per_expert[layer_index(name)], dtype=torch.float32)
        layer.update_bias(load, cfg.router_bias_update_rate)


# -- expert parallelism ------------------------------------------------------------------------
#
# Layout. The `ep` axis is carved from the ranks that average gradients (dp, or dp x cp: the
# ranks that hold the same dense parameters and different tokens): their index j = dp * cp + c
# splits as (j // ep, j % ep) = (edp, ep). An `ep` group of ranks holds the n_experts experts
# between them, n_experts / ep each, as DTensors Shard(0) on the `ep` axis (so checkpoints stay
# keyed by name and reshard); ranks with the same ep index and different edp index hold the
# same experts. Tensor parallelism splits only the dense parts: a MoE layer (router, experts,
# shared experts) is replicated over `tp` ranks, which route the same tokens.
#
# One MoE layer's experts on rank r of an ep group (k assignments per token, sorted by expert):
#   1. counts c[r, e] of rank r's assignments to expert e; all-to-all so that rank d learns
#      c[s, e] for its experts e from every source s (equal splits, n_experts / ep integers);
#   2. dispatch: rows for the experts of rank d go to rank d (all-to-all, uneven splits
#      sum_e c[r, e] over d's experts); received rows are ordered (source, expert), and are
#      regrouped to (expert, source) for one grouped matmul over the local experts;
#   3. combine: the inverse regrouping, and the transposed all-to-all back to the sources.
# Both all-to-alls are `AllToAll` below; autograd runs the transposed exchange in backward.
#
# Gradients. An expert's gradient on its rank sums the contributions of the tokens of all ep
# ranks (each already scaled by its own rank's 1/micro-batches), so the data-parallel mean
# is: sum over the edp group, divided by all gradient-averaging ranks (dp x cp), not by edp.
# ZeRO-0: `reduce_expert_grads` does that after the last micro-batch; ZeRO-3: the experts are
# their own FSDP2 unit on the edp axis (as torchtitan does), whose reduce-scatter averages over
# edp, and the expert weights' gradients are scaled by 1/ep on the way (`ScaleGrad`):
# torchtitan's `set_gradient_divide_factor(dp x cp)` needs ReduceOp.PREMUL_SUM, which gloo lacks.
# ZeRO-1/2: the dense parameters are row-sharded as usual; the experts are left out of it and
# reduced as with ZeRO-0 (data_parallel.ZeroDP). HSDP is refused.


EXPERT_MESH_AXES = ("pp", "dp_replicate", "edp", "ep", "tp")


def check_expert_parallel(cfg, dims) -> None:
    """Stop before any work when the model or the other degrees cannot form this layout."""
    ep, model = dims.ep, cfg.model
    if cfg.parallel.sp and model.n_experts:
        raise invalid("parallel.sp", True, "MoE layers take whole sequences, not sequence-parallel shards: set sp = false")
    if ep == 1:
        return
    if not model.n_experts:
        raise invalid("parallel.ep", ep, "expert parallelism needs a mixture-of-experts model (model.n_experts > 0)")
    if model.n_experts % ep:
        raise invalid("parallel.ep", ep, f"model.n_experts = {model.n_experts} must divide by it; use a divisor")
    ranks = dims.dp_shard * dims.cp
    if ranks % ep:
        raise invalid("parallel.ep", ep, f"ep is carved from the dp x cp = {ranks} data ranks: use a divisor of {ranks}")
    if dims.dp_replicate > 1:
        raise invalid("parallel.dp_replicate", dims.dp_replicate, "HSDP with parallel.ep > 1 is not supported: use 1")


def build_expert_mesh(dims, device_type: str) -> DeviceMesh:
    """The (pp, dp_replicate, edp, ep, tp) mesh over the same ranks as the main mesh."""
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard * dims.cp // dims.ep, dims.ep, dims.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_AXES)


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in f".{name}"


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


def expert_parallel_forward(self, x_sorted_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """`GroupedExperts.forward` for experts sharded over `self.ep_group` (see the layout notes)."""
    group, ep = self.ep_group, self.ep_size
    send_counts = counts_E.view(ep, -1).contiguous()  # [destination rank, its local expert]
    recv_counts = torch.empty_like(send_counts)  # [source rank, local expert]
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    x_recv = AllToAll.apply(x_sorted_ND, recv_splits, send_splits, group)
    num_local = recv_counts.shape[1]
    expert_of_row = torch.arange(num_local, device=counts_E.device).repeat(ep).repeat_interleave(recv_counts.flatten())
    by_expert = torch.argsort(expert_of_row, stable=True)  # (source, expert) order -> (expert, source)
    weights = (self.gate_proj, self.up_proj, self.down_proj)
    local_weights = [ScaleGrad.apply(w.to_local(), self.grad_scale) if self.grad_scale != 1 else w.to_local()
                     for w in weights]
    y = grouped_swiglu(x_recv[by_expert], recv_counts.sum(0), *local_weights)
    y_recv = torch.empty_like(y).index_copy(0, by_expert, y)
    return AllToAll.apply(y_recv, send_splits, recv_splits, group)


def apply_expert_parallel(model, expert_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over the `ep` axis (on meta, before materialising) and
    route their forward through the all-to-all dispatch/combine."""
    ep_mesh = expert_mesh["ep"]
    for layer in moe_layers(model).values():
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.ep_group, experts.ep_size = ep_mesh.get_group(), ep_mesh.size()
        experts.grad_scale = 1.0
        experts.forward = types.MethodType(expert_parallel_forward, experts)


def shard_experts_fsdp(model, expert_mesh: DeviceMesh) -> None:
    """ZeRO-3: each MoE layer's experts an FSDP2 unit over `edp`, which averages over edp; the
    1/ep that makes it a mean over all gradient-averaging ranks is applied in backward (see the
    layout notes). Call before the blocks are sharded."""
    from torch.distributed.fsdp import fully_shard

    for layer in moe_layers(model).values():
        fully_shard(layer.experts, mesh=expert_mesh["edp"], reshard_after_forward=True)
        layer.experts.grad_scale = 1.0 / expert_mesh["ep"].size()


def reduce_expert_grads(named_params, expert_mesh: DeviceMesh, num_grad_ranks: int) -> None:
    """ZeRO-0: average expert gradients: sum over the edp group, divide by dp x cp."""
    grads = [p.grad.to_local() for name, p in named_params if p.grad is not None and is_expert_param(name)]
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
