"""`train.float8`: training with FP8 matmuls, through torchao's float8 training (`torchao.float8`).

torchao swaps each chosen `nn.Linear` for its `Float8Linear` (same parameters, same names: the
initial values, checkpoints and HF conversion see the same model), whose forward casts the input,
the weight and, in backward, the output gradient to float8 with dynamic scales (one per tensor,
"tensorwise", or one per row of each operand, "rowwise") and multiplies them with `torch._scaled_mm`.
Only the casts are new work, so the gain needs `torch.compile` to fuse them into the neighbouring
kernels (torchtitan measured +25-28% tokens/s at 8B on H100 with both; without compile, float8 is
slower than bf16). Small matmuls gain nothing or lose: torchao's own guidance, which torchtitan
follows, keeps linears whose widths do not divide by 16 (a requirement of `_scaled_mm`) in high
precision, and so do we; the embedding and the output head stay too.

Why here, in compile/: like the rewrite rules, this changes how the model's math runs, not what it
computes or how it is split, and it is applied from outside by `parallelize` (step 2b, before
tensor parallelism and compilation), to the model built on the meta device. The model knows
nothing of it (DESIGN.md, principle 1).

Refused, each with one line before any work: a device without FP8 tensor cores (a CPU, a GPU of
compute capability below 8.9), torchao not installed, tensor parallelism (config validation) and
LoRA (config validation).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.errors import invalid

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada: L4, L40S; Hopper: H100, H200; later)."""
FP8_WIDTH_MULTIPLE = 16
"""`torch._scaled_mm` takes float8 operands whose widths are multiples of 16."""


def check_float8_device(recipe: str, device: torch.device) -> None:
    """Raises the one-line error for a float8 run on a device that cannot run it, or without torchao."""
    if recipe == "none":
        return
    fix = 'set train.float8 = "none"'
    if device.type != "cuda":
        raise invalid("train.float8", recipe, f"FP8 training needs an NVIDIA GPU with FP8 tensor cores (compute "
                      f"capability {'.'.join(map(str, FP8_CAPABILITY))} or newer: L4, L40S, H100, H200, B200); this "
                      f"run trains on {device.type}: {fix}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise invalid("train.float8", recipe, f"FP8 training needs FP8 tensor cores (compute capability "
                      f"{'.'.join(map(str, FP8_CAPABILITY))} or newer); {torch.cuda.get_device_name(device)} has "
                      f"{'.'.join(map(str, capability))}: {fix}")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise invalid("train.float8", recipe, "FP8 training uses torchao, which is not installed: "
                      f"pip install 'shardwise[float8]' (or {fix})") from None


def float8_eligible(module: nn.Module, name: str, blocks: str) -> bool:
    """Whether the linear `name` computes in float8: inside the blocks, both widths multiples of 16."""
    return (isinstance(module, nn.Linear) and name.startswith(f"{blocks}.")
            and module.in_features % FP8_WIDTH_MULTIPLE == 0 and module.out_features % FP8_WIDTH_MULTIPLE == 0)


def apply_float8(parts: list[nn.Module], plan, recipe: str) -> int:
    """Swap the eligible linears of each part for torchao's `Float8Linear`, in place (on meta, before
    the layout and compilation); how many were swapped."""
    if recipe == "none":
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    swapped = 0
    for part in parts:
        chosen = {name for name, module in part.named_modules() if float8_eligible(module, name, plan.blocks)}
        convert_to_float8_training(part, config=config, module_filter_fn=lambda module, name: name in chosen)
        swapped += len(chosen)
    return swapped
