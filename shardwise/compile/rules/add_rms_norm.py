"""A residual add feeding an RMSNorm -> one fused add + RMSNorm (both results: the sum is the
next residual)."""

from shardwise.compile import fused
from shardwise.compile.rules import rms_norm
from shardwise.compile.rules.rule import Rule


def pattern(x, residual, weight, eps, dtype):
    h = x + residual
    return h, rms_norm.pattern(h, weight, eps, dtype)


def replacement(x, residual, weight, eps, dtype):
    return fused.add_rms_norm(x, residual, weight, eps)


RULE = Rule("add_rms_norm", pattern, replacement, constraints=rms_norm.CONSTRAINTS,
            description="h = x + r; rms_norm(h) -> fused add_rms_norm returning (h, normed)")
