"""LoRA adapters (Hu et al., 2021) beside a model's frozen linear layers, in plain torch.nn.

An adapted linear computes

    y = base(x) + (lora_alpha / lora_rank) * B(A(dropout(x)))      A: [r, in], B: [out, r]

with B = 0 at the start (the adapted model equals its base at step 0) and A kaiming-uniform
(a = sqrt(5), torch's nn.Linear default and PEFT's), drawn from a generator seeded by (seed, the
parameter's name), so a sharded layout computes the same full tensor as one process and keeps its
part. Dropout (train.lora_dropout) acts on the adapter's input in training only.

Names follow PEFT under our module names: the base keeps its own (`layers.0.attn.q_proj.weight`:
checkpoints of the base, Hugging Face conversion and init_from read it unchanged) and the adapter
adds `layers.0.attn.q_proj.lora_A.weight` and `...lora_B.weight`. Which linears get one is the
family's data: role names (`q,k,v,o,gate,up,down`) map to module names within a block through
the plan's `lora_roles`.

The base is frozen (requires_grad False; no gradient, no optimizer state) and may be held in a
narrower dtype (train.lora_base_dtype = bfloat16): the adapted linears' base weights (and biases)
are stored in it and their matmul runs in it, its output cast back to the input's dtype, so no
full-precision copy of a weight is made or kept for backward. Adapters stay in full precision.

Nothing here knows about distribution: the layout step (distributed/lora_layout.py) adds the
adapters to the meta model before tensor parallelism, whose styles split A and B as the base
linear is split.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.common.decoder import seeded_generator

ADAPTER_FACTORS = ("lora_A", "lora_B")
ADAPTER_SUFFIXES = tuple(f"{factor}.weight" for factor in ADAPTER_FACTORS)


@dataclass(frozen=True)
class LoraOptions:
    """What an adapter is: its rank and scale numerator, its input dropout, the roles that get one
    and the dtype the base weights are held in."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    base_dtype: torch.dtype = torch.float32

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """A linear layer with its base weight (and bias) frozen, plus the low-rank update B A.
    Still an nn.Linear (its `weight` and `bias` are the base's), so layouts that treat linears by
    type keep doing so; `lora_A` and `lora_B` are bias-free linears of their own (PEFT's shape)."""

    @classmethod
    def adapting(cls, base: nn.Linear, options: LoraOptions) -> LoRALinear:
        """An adapted copy of `base` sharing its parameters (cast to the base dtype), on its device
        (meta: the layout materialises and initialises the adapters with the rest)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = base.in_features, base.out_features
        module.weight = frozen_as(base.weight, options.base_dtype)
        module.bias = None if base.bias is None else frozen_as(base.bias, options.base_dtype)
        device = base.weight.device
        module.lora_A = nn.Linear(base.in_features, options.rank, bias=False, device=device)
        module.lora_B = nn.Linear(options.rank, base.out_features, bias=False, device=device)
        module.lora_dropout = nn.Dropout(options.dropout) if options.dropout else nn.Identity()
        module.scale = options.scale
        module.adapters_on = True
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        if not self.adapters_on:
            return out
        return out + self.scale * self.lora_B(self.lora_A(self.lora_dropout(x)))

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen base's output; a base held in another dtype multiplies in it."""
        if self.weight.dtype == x.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    @torch.no_grad()
    def merged(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """A plain linear whose weight is W + scale * B A, in `dtype` (no adapter left to run)."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        update = self.lora_B.weight.to(dtype) @ self.lora_A.weight.to(dtype)
        linear.weight = nn.Parameter(self.weight.to(dtype) + self.scale * update, requires_grad=False)
        linear.bias = None if self.bias is None else nn.Parameter(self.bias.to(dtype), requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scale={self.scale}"


def frozen_as(param: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    data = param.detach() if param.dtype == dtype else param.detach().to(dtype)
    return nn.Parameter(data, requires_grad=False)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (by its full name) is an adapter's A or B."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_initial_value(name: str, shape, device, seed: int) -> torch.Tensor:
    """A: kaiming-uniform (a = sqrt(5): bound 1 / sqrt(in_features)) from (seed, name); B: zeros."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape, device=device)
    value = torch.empty(shape, device=device)
    return nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=seeded_generator(name, device, seed))


def initial_value_of(model: nn.Module, name: str, shape, device, seed: int) -> torch.Tensor:
    """The initial value of any parameter of a model that may hold adapters (the model's own rule
    for the rest)."""
    if is_adapter_name(name):
        return adapter_initial_value(name, shape, device, seed)
    return model.initial_value(name, shape, device, seed)


def adapted_modules(plan, model: nn.Module, targets) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """Full name -> (parent, attribute, linear) of every linear the `targets` roles name in the blocks
    `model` holds (a block without one, an MoE layer's MLP, is passed over)."""
    found = {}
    for stack, index, block in plan.all_blocks(model):
        modules = dict(block.named_modules())
        for role in targets:
            path = plan.lora_roles[role]
            linear = modules.get(path)
            if isinstance(linear, nn.Linear):
                parent_path, _, attribute = path.rpartition(".")
                found[f"{stack}.{index}.{path}"] = (modules[parent_path], attribute, linear)
    return found


def add_adapters(model: nn.Module, plan, options: LoraOptions, *, seed: int | None = None) -> list[str]:
    """Give the `options.targets` linears of `model` adapters, in place, and freeze everything else;
    the adapted linears' names. On a materialised model `seed` initialises the adapters at once."""
    unknown = [role for role in options.targets if role not in plan.lora_roles]
    assert not unknown, f"LoRA roles {unknown} are not the plan's ({', '.join(plan.lora_roles)})"
    found = adapted_modules(plan, model, options.targets)
    for parent, attribute, linear in found.values():
        setattr(parent, attribute, LoRALinear.adapting(linear, options))
    freeze_base(model)
    if seed is not None:
        init_adapters(model, seed)
    return list(found)


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(module, LoRALinear) for module in model.modules())


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train, where there are any (a layout's styles make new parameters, which
    start trainable: call it again after them)."""
    if not has_adapters(model):
        return
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter of a materialised, unsharded model at its initial value."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            param.copy_(adapter_initial_value(name, param.shape, param.device, seed))


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a run's checkpoint keeps of `model`: its state_dict, less the frozen base where the
    model holds adapters (its base is named by the run's train.init_from, or is the seeded init)."""
    state = model.state_dict()
    if not has_adapters(model):
        return state
    frozen = {name for name, param in model.named_parameters() if not is_adapter_name(name)}
    return {name: tensor for name, tensor in state.items() if name not in frozen}


def merge_adapters(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Fold each adapter into its base linear (W + scale * B A, in `dtype`), in place, leaving a
    plain model that generates at full speed; parameter names are the base's."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_path, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent_path), attribute, module.merged(dtype))
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run the base alone (the adapters skipped), e.g. a DPO reference pass, without a second copy."""
    adapted = [module for module in model.modules() if isinstance(module, LoRALinear)]
    for module in adapted:
        module.adapters_on = False
    try:
        yield model
    finally:
        for module in adapted:
            module.adapters_on = True
