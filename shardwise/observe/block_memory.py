"""What one block keeps for backward, eager and compiled, in elements per token per model width
(h): the measure of issue 16 and of `shardwise rules --memory`.

The block is the model's own, scaled down with its proportions kept (heads, kv heads, FFN
width per h), so the count in units of h is the full-size block's: every activation a block
saves is h, a head-width multiple or an FFN-width multiple per token (RoPE's tables and
per-token norm statistics are the exceptions, and come out slightly larger relative to h at
the scaled width). Counted with `observe.activations.saved_activation_bytes`, which sees what
compiled graphs save too (they save through autograd like any function).
"""

from __future__ import annotations

import dataclasses

import torch

MODES = ("eager", "compiled", "compiled+rules")
HEAD_WIDTH = 32
"""The scaled block's head width (Llama 3's is 128): wide enough for a fused attention kernel,
small enough to compile in seconds."""


def scaled(model_cfg, head_width: int = HEAD_WIDTH):
    """The model's blocks at `head_width` per head, every width divided by the same factor."""
    head_dim = model_cfg.head_dim or model_cfg.dim // model_cfg.n_heads
    factor = head_dim / head_width
    return dataclasses.replace(
        model_cfg, dim=round(model_cfg.dim / factor), head_dim=head_width if model_cfg.head_dim else 0,
        ffn_dim=round(model_cfg.ffn_dim / factor), moe_ffn_dim=round(model_cfg.moe_ffn_dim / factor))


def saved_per_token(model_cfg, mode: str, *, layer: int = 0, dtype=torch.bfloat16, batch: int = 2,
                    seq_len: int = 128) -> float:
    """Elements (of `dtype`'s size) block `layer` saves for backward per token, divided by h."""
    from shardwise.compile.regional import compile_blocks
    from shardwise.models.common.rope import RopeSpec, rope_cos_sin
    from shardwise.models.build import plan_of
    from shardwise.models.llama.model import Block
    from shardwise.observe.activations import saved_activation_bytes

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    small = scaled(model_cfg)
    torch.manual_seed(0)
    block = Block(small, layer)
    for param in block.parameters():
        torch.nn.init.normal_(param, mean=1.0 if param.dim() == 1 else 0.0, std=0.02)
    block = block.to(dtype)
    holder = torch.nn.Module()
    setattr(holder, plan_of(small).blocks, torch.nn.ModuleDict({str(layer): block}))
    if mode != "eager":
        compile_blocks([holder], plan_of(small), rules=mode == "compiled+rules")
    cos, sin = rope_cos_sin(RopeSpec.of(small), torch.arange(seq_len), dtype)

    def block_input():  # an activation (not a leaf), as a block's input is in a model
        return torch.randn(batch, seq_len, small.dim, dtype=dtype) * torch.ones(1, dtype=dtype, requires_grad=True)

    if mode != "eager":
        block(block_input(), cos, sin)  # compile first: what compiling holds is not the block's
    _, num_bytes = saved_activation_bytes(block, block_input(), cos, sin)
    return num_bytes / dtype.itemsize / (batch * seq_len) / small.dim


def memory_report(model_cfg) -> str:
    """`shardwise rules --memory`: what one block of each kind keeps for backward per token, in bf16."""
    from shardwise.compile.rules.report import block_kinds

    lines = ["saved activations per token per block, bf16, elements / h (h = model.dim; "
             "Korthikanti et al.'s count without dropout: 16)"]
    for kind, layer in block_kinds(model_cfg).items():
        figures = ", ".join(f"{mode} {saved_per_token(model_cfg, mode, layer=layer):.1f}h" for mode in MODES)
        lines.append(f"  {kind} block: {figures}")
    return "\n".join(lines)
