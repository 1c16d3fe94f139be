"""A linear layer over 16-63 rows on a CPU: x @ W^T -> (W @ x^T)^T, the same product. Two rules:
`F.linear` without bias (the projections) and `x @ weight.t()` (a tied output head).

PyTorch stores a linear's weight as [out, in], so F.linear multiplies by its transpose. At 16-63
rows (a decode step of 16-63 running sequences) MKL's fp32 GEMM with that transposed operand took
3-5x as long on this CPU as the same product with the weight as the untransposed left operand
(x [16, 256] by a [704, 256] weight: 184 us vs 68 us; 1-15 and 64+ rows: within 1.2x; docs/benchmarks.md,
"Serving"). The rule is for the inference engine's compiled decode step on CPU (`DECODE_RULES`),
not for the training blocks, whose thousands of rows do not hit it.
"""

import torch
import torch.nn.functional as F

from shardwise.compile.rules.rule import Rule, example

ROWS = range(16, 64)
"""Rows of x (all dimensions but the last, multiplied) where the rewrite was measured faster."""


def pattern(x, weight):
    return F.linear(x, weight, None)  # as a bias-free nn.Linear calls it


def tied_head_pattern(x, weight):
    return x @ weight.t()


def replacement(x, weight):
    rows = x.flatten(0, -2)
    # contiguous: the consumers (norms, RoPE, attention) read rows; a transposed product slowed them
    return torch.mm(weight, rows.t()).t().contiguous().reshape(x.shape[:-1] + (weight.shape[0],))


def small_fp32_on_cpu(bound) -> bool:
    x, weight = example(bound["x"]), example(bound["weight"])
    if x is None or weight is None or x.dim() < 2 or weight.dim() != 2:
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # a symbolic row count (a step recompiled with dynamic shapes) would need a guard: left alone
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and isinstance(rows, int)
            and rows in ROWS)


RULE = Rule("small_batch_linear", pattern, replacement, constraints=(small_fp32_on_cpu,),
            description="F.linear of 16-63 fp32 rows on CPU -> (W @ x^T)^T (decode steps only)")
TIED_HEAD_RULE = Rule("small_batch_tied_head", tied_head_pattern, replacement, constraints=(small_fp32_on_cpu,),
                      description="x @ W.t() of 16-63 fp32 rows on CPU -> (W @ x^T)^T (decode steps only)")
