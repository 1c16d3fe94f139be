"""LoRA as a layout step: adapters added to the meta model before tensor parallelism, and the
tensor-parallel styles of an adapted linear.

`apply_lora` gives the plan's `train.lora_targets` linears their adapters (models/common/lora.py)
on the meta model, after the pipeline split and before tensor parallelism, so every later step
sees them as ordinary parameters: FSDP shards them with the frozen base in the same units (FSDP2
takes frozen parameters beside trainable ones and reduce-scatters only gradients that exist);
DDP and this repo's ZeRO-1/2 and flat all-reduce sync only parameters that have a gradient; the
optimizer holds only trainable ones; compilation traces the adapted forward. Every layout
initialises them by name (`initial_value_of`), so all start from the one-process values.

Tensor parallelism splits an adapter as its base linear is split, so the adapter's output has
the base output's layout and the two add without a collective of their own:

  base       W                  A [r, in]                  B [out, r]          y = W x + s B A x
  colwise    Shard(0) (by out)  Replicate                  Shard(0) (by out)   Shard(-1): B A x is
                                                                               this rank's features
  rowwise    Shard(1) (by in)   Shard(1) (by in features)  Replicate           Partial: A x is a
                                                                               partial sum over in

A colwise adapter's A sees the whole (replicated, with SP all-gathered) input, as its base does;
a rowwise one's A sees this rank's input features and its partial A x goes through B before the
base's own reduction (all-reduce, or reduce-scatter over the sequence with SP) sums both at once.
The styles are PyTorch's ColwiseParallel / RowwiseParallel (their input and output layouts
unchanged); only the placement of each parameter is written here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.config.schema import lora_target_names
from shardwise.models.build import build_on_meta, plan_of
from shardwise.models.common.lora import LoRALinear, LoraOptions, add_adapters, freeze_base

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lora_options(train_cfg) -> LoraOptions | None:
    """The run's adapters (None: train.lora_rank = 0, every weight trains)."""
    if not train_cfg.lora_rank:
        return None
    return LoraOptions(rank=train_cfg.lora_rank, alpha=train_cfg.lora_alpha, dropout=train_cfg.lora_dropout,
                       targets=tuple(lora_target_names(train_cfg.lora_targets)),
                       base_dtype=DTYPES[train_cfg.lora_base_dtype])


def apply_lora(parts, plan, train_cfg, *, seed: int | None = None) -> None:
    """Adapters on each model part (meta, or materialised and initialised from `seed`), its base frozen."""
    options = lora_options(train_cfg)
    if options is not None:
        for part in parts:
            add_adapters(part, plan, options, seed=seed)


def build_adapted_on_meta(cfg) -> nn.Module:
    """The config's model on meta with its adapters (if any): what a LoRA run's checkpoints belong to."""
    model = build_on_meta(cfg.model)
    apply_lora([model], plan_of(cfg.model), cfg.train)
    return model


def refreeze_base(parts) -> None:
    """After the layout's styles, which make their parameters anew and trainable."""
    for part in parts:
        freeze_base(part)


def distribute_params(module: nn.Module, mesh, placements: dict[str, list[Placement]], src_data_rank) -> None:
    """Each of `module`'s own parameters as a DTensor with its placements (by parameter name),
    keeping whether it trains."""
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, placements[name], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class AdaptedColwise(ColwiseParallel):
    """ColwiseParallel for a LoRALinear: base and B split by output features, A replicated."""

    PLACEMENTS = {"": {"weight": [Shard(0)], "bias": [Shard(0)]},
                  "lora_A": {"weight": [Replicate()]},
                  "lora_B": {"weight": [Shard(0)]}}

    def _partition_linear_fn(self, name, module, device_mesh):
        if name in self.PLACEMENTS:  # the dropout module has no parameters
            distribute_params(module, device_mesh, self.PLACEMENTS[name], self.src_data_rank)


class AdaptedRowwise(RowwiseParallel):
    """RowwiseParallel for a LoRALinear: base weight and A split by input features, B replicated
    (and the base's bias, added once after the reduction)."""

    PLACEMENTS = {"": {"weight": [Shard(1)], "bias": [Replicate()]},
                  "lora_A": {"weight": [Shard(1)]},
                  "lora_B": {"weight": [Replicate()]}}

    def _partition_linear_fn(self, name, module, device_mesh):
        if name in self.PLACEMENTS:
            distribute_params(module, device_mesh, self.PLACEMENTS[name], self.src_data_rank)


ADAPTED_STYLES = {ColwiseParallel: AdaptedColwise, RowwiseParallel: AdaptedRowwise}


def adapted_style(module: nn.Module, style):
    """`style` for `module` as its plan gives it, or its adapted twin for a LoRALinear (same input
    and output layouts)."""
    if not isinstance(module, LoRALinear):
        return style
    twin = ADAPTED_STYLES.get(type(style))
    if twin is None:
        raise ValueError(f"a LoRA adapter sits on a linear whose tensor-parallel style is {type(style).__name__}; "
                         "adapters follow colwise or rowwise linears only: drop its role from train.lora_targets")
    adapted = twin.__new__(twin)
    adapted.__dict__.update(style.__dict__)
    return adapted
