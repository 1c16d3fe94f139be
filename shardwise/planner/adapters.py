"""LoRA in the planner: which linears of a block get adapters, and how many parameters each adds
to the model, to one rank and to one rank's largest block.

The runtime is models/common/lora.py (the adapted linear) and distributed/lora_layout.py (its
tensor-parallel split); the roles are the family's data (`FamilySpec.lora_roles`, role -> linear
of a block). An adapted linear W [out, in] gains A [r, in] and B [out, r]: r x (in + out)
trainable parameters, the only ones of the model (`trainable_params`). MoE layers' MLP roles have
no linear (their experts are passed over, as the runtime does), so only dense blocks count them.

Tensor parallelism splits an adapter as its base linear: a colwise base (split by output
features) keeps A whole on every rank and splits B, a rowwise base (split by input features)
splits A and keeps B whole.

What a frozen base costs and saves, in memory and time, is planner/memory.py's and
planner/step_time.py's (their docstrings); this module only counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.core.model import ModelConfig
from shardwise.core.model_counts import kv_width, q_width
from shardwise.models.families import spec_of
from shardwise.planner.layout import Layout

ATTENTION_ROLES = ("q", "k", "v", "o")
COLUMN_ROLES = ("q", "k", "v", "gate", "up")
"""Roles whose linear tensor parallelism splits by output features (the plans' colwise); o and
down are rowwise."""


@dataclass(frozen=True)
class AdaptedLinear:
    role: str
    in_features: int
    out_features: int
    has_bias: bool

    @property
    def colwise(self) -> bool:
        return self.role in COLUMN_ROLES

    def adapter_params(self, rank: int) -> int:
        return rank * (self.in_features + self.out_features)

    def adapter_params_per_tp_rank(self, rank: int, tp: int) -> float:
        """A and B as distributed/lora_layout.py splits them: the factor on the split side of the base."""
        if self.colwise:
            return rank * (self.in_features + self.out_features / tp)
        return rank * (self.in_features / tp + self.out_features)

    @property
    def base_params(self) -> int:
        """The frozen weight and bias the runtime holds in train.lora_base_dtype."""
        return self.in_features * self.out_features + (self.out_features if self.has_bias else 0)


def role_shape(model: ModelConfig, role: str) -> tuple[int, int]:
    """(in_features, out_features) of the linear a role names."""
    h, f = model.dim, model.ffn_dim
    shapes = {"q": (h, q_width(model)), "k": (h, kv_width(model)), "v": (h, kv_width(model)),
              "o": (q_width(model), h), "gate": (h, f), "up": (h, f), "down": (f, h)}
    return shapes[role]


def role_has_bias(model: ModelConfig, role: str) -> bool:
    spec = spec_of(model.family)
    return spec.linear_biases or (model.qkv_bias and role in ("q", "k", "v"))


def adapted_linears(model: ModelConfig, roles: tuple[str, ...], layer: int) -> tuple[AdaptedLinear, ...]:
    """The linears of block `layer` that the roles give adapters (an MoE layer has no MLP linears)."""
    moe = model.is_moe_layer(layer)
    return tuple(AdaptedLinear(role, *role_shape(model, role), role_has_bias(model, role))
                 for role in roles if not (moe and role not in ATTENTION_ROLES))


def trainable_params(model: ModelConfig, rank: int, roles: tuple[str, ...]) -> int:
    """The adapters' parameters over the whole model (what a LoRA run trains)."""
    return sum(linear.adapter_params(rank)
               for layer in range(model.n_layers) for linear in adapted_linears(model, roles, layer))


def layout_trainable_params(model: ModelConfig, layout: Layout) -> int | None:
    """The trainable parameters of a LoRA layout (None without LoRA: every parameter trains)."""
    return trainable_params(model, layout.lora_rank, layout.lora_roles) if layout.lora_rank else None


@dataclass(frozen=True)
class RankAdapters:
    """What LoRA adds and freezes on one rank (after pp and tp; before ZeRO)."""

    adapters: float = 0.0
    """Adapter parameters (the only trainable ones)."""
    adapted_base: float = 0.0
    """Parameters of the adapted linears' frozen weights and biases (held in the base dtype)."""
    largest_block_adapters: float = 0.0
    largest_block_adapted_base: float = 0.0


def rank_adapters(model: ModelConfig, layout: Layout, layers: tuple) -> RankAdapters:
    """The adapters and adapted base weights of the blocks `layers` on one tp rank."""
    if not layout.lora_rank:
        return RankAdapters()
    adapters = adapted_base = largest_adapters = largest_base = 0.0
    for i in layers:
        linears = adapted_linears(model, layout.lora_roles, i)
        block_adapters = sum(linear.adapter_params_per_tp_rank(layout.lora_rank, layout.tp) for linear in linears)
        block_base = sum(linear.base_params for linear in linears) / layout.tp
        adapters, adapted_base = adapters + block_adapters, adapted_base + block_base
        largest_adapters, largest_base = max(largest_adapters, block_adapters), max(largest_base, block_base)
    return RankAdapters(adapters, adapted_base, largest_adapters, largest_base)
