"""RoPE in the rotate-half layout: x * cos + rotate_half(x) * sin -> fused.rope, the seat of a device
kernel; on CPU that is the composition itself, which inductor already fuses best (fused.py says why)."""

import torch

from shardwise.compile import fused
from shardwise.compile.rules.rule import Rule, example


def pattern(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def replacement(x, cos, sin):
    return fused.rope(x, cos, sin)


def tables_fit(bound) -> bool:
    """cos and sin are [..., S, head_dim] tables as wide as x's last dimension."""
    x, cos, sin = (example(bound[name]) for name in ("x", "cos", "sin"))
    return all(t is not None for t in (x, cos, sin)) and cos.shape == sin.shape and cos.shape[-1] == x.shape[-1]


RULE = Rule("rope", pattern, replacement, constraints=(tables_fit,),
            description="x * cos + rotate_half(x) * sin -> rope (on CPU: inductor's own kernel of it)")
