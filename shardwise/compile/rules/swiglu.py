"""SwiGLU's gate: silu(a) * b -> one fused op that keeps a and b for backward, not silu(a)."""

import torch.nn.functional as F

from shardwise.compile import fused
from shardwise.compile.rules.rule import Rule, example


def pattern(a, b):
    return F.silu(a) * b


def replacement(a, b):
    return fused.swiglu(a, b)


def same_shape(bound) -> bool:
    a, b = example(bound["a"]), example(bound["b"])
    return a is not None and b is not None and a.shape == b.shape


RULE = Rule("swiglu", pattern, replacement, constraints=(same_shape,),
            description="silu(a) * b with a, b of one shape -> fused swiglu")
