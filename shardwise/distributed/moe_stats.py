"""Mixture-of-experts across ranks: the per-step expert statistics (load, drops, aux losses)
summed over ranks, and the aux-loss-free router bias update that needs them.

Statistics: each MoE layer records sums over its calls (shardwise.models.common.moe). A rank
holds some layers (pipeline stages) and sees some tokens (data, context and expert parallel
ranks see different ones; tensor-parallel ranks of one data rank see the same). One all-reduce
(sum) over every rank of a [n_layers, n_experts + 5] table, divided by tp, gives every rank
the global figures, so the bias update that follows is identical everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from shardwise.models.common.moe import moe_layers

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
