"""RMSNorm as Llama/HF write it (normalise in fp32, cast back, scale) -> one fused RMSNorm."""

import torch

from shardwise.compile import fused
from shardwise.compile.rules.rule import Rule, at_most_fp32, casts_back, is_number, last_dim_of


def pattern(x, weight, eps, dtype):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype)


def replacement(x, weight, eps, dtype):
    return fused.rms_norm(x, weight, eps)


CONSTRAINTS = (is_number("eps"), at_most_fp32("x"), casts_back("dtype", "x"), last_dim_of("x", "weight"))
RULE = Rule("rms_norm", pattern, replacement, constraints=CONSTRAINTS,
            description="x * rsqrt(mean(x^2) + eps) * w in fp32 -> fused rms_norm (saves x and 1/rms, not an fp32 copy)")
