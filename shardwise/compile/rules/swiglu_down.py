"""SwiGLU with its down projection: down(silu(a) * b) -> one op whose backward recomputes the
product instead of keeping it (the MLP keeps 2 hidden-width activations, not 3)."""

import torch.nn.functional as F

from shardwise.compile import fused
from shardwise.compile.rules.rule import Rule
from shardwise.compile.rules.swiglu import same_shape


def pattern(a, b, weight):
    return F.linear(F.silu(a) * b, weight, None)


def replacement(a, b, weight):
    return fused.swiglu_down(a, b, weight)


RULE = Rule("swiglu_down", pattern, replacement, constraints=(same_shape,),
            description="linear(silu(a) * b, w) -> fused swiglu_down (backward recomputes silu(a) * b)")
