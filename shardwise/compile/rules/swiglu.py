"""SwiGLU's gate: silu(a) * b -> the same product, recomputed in backward instead of kept.

The product is the down projection's input, so a compiled block would keep it for the weight
gradient beside a and b, which silu's and the product's own backward keep anyway: 3 hidden-width
activations where 2 suffice. The rule tags the product for recomputation (`Rule.recompute`), so
backward rebuilds it from a and b inside a kernel it already runs, and inductor still fuses
silu and the multiply into one pass, forward and backward."""

import torch.nn.functional as F

from shardwise.compile.rules.rule import Rule, example


def pattern(a, b):
    return F.silu(a) * b


def replacement(a, b):
    return F.silu(a) * b


def same_shape(bound) -> bool:
    a, b = example(bound["a"]), example(bound["b"])
    return a is not None and b is not None and a.shape == b.shape


RULE = Rule("swiglu", pattern, replacement, constraints=(same_shape,), recompute=True,
            description="silu(a) * b with a, b of one shape -> the same, recomputed in backward (keeps a, b only)")
