"""A residual add feeding an RMSNorm -> one fused add + RMSNorm (both results: the sum is the
next residual)."""

import torch

from shardwise.compile import fused
from shardwise.compile.rules.rule import Rule, at_most_fp32, casts_back, is_number, last_dim_of


def pattern(x, residual, weight, eps, dtype):
    h = x + residual
    h32 = h.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * normed.to(dtype)


def replacement(x, residual, weight, eps, dtype):
    return fused.add_rms_norm(x, residual, weight, eps)


RULE = Rule("add_rms_norm", pattern, replacement,
            constraints=(is_number("eps"), at_most_fp32("x"), casts_back("dtype", "x"), last_dim_of("x", "weight")),
            description="h = x + r; rms_norm(h) -> fused add_rms_norm returning (h, normed)")
