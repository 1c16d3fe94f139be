"""The fused operations the rewrite rules (compile/rules/) put in place of composed ones.

On CPU each is what measured best (docs/benchmarks.md, "Compiler"): torch's fused RMSNorm
(inductor decomposes it into one forward and one backward kernel that keep x and 1/rms), or the
composition itself where inductor's fusion of it is already the best kernel (rope). SwiGLU needs
no operation here: its rule keeps the composition and tags it for recomputation
(rules/swiglu.py); an opaque op that recomputed the product in its own backward (swiglu_down,
until commit 28c945e) kept as little but hid the element-wise work from inductor's fusion and was
4% slower on the CPU step. Each equals its composed source up to float rounding
(tests/compile/test_rules.py checks forward and backward). No hand-written Triton kernel: on
the GPUs lent so far one for RMSNorm (benchmarks/triton_rms_norm.py) came within 2-6% of
inductor's kernels for the rule, not enough to keep a second kernel (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from shardwise.models.common.rope import rotate_half


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), computed in fp32 inside torch's fused kernel, which saves x and the
    per-token 1/rms for backward (the composed form also keeps an fp32 copy of x)."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual)): the residual stream and the next block input."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin. On CPU the best kernel measured is inductor's own fusion
    of this composition: one kernel whose output keeps x's memory layout (so the attention
    output's reshape for o_proj stays a view), and a partitioner that keeps nothing of x for
    backward (RoPE is linear in x). Two replacements measured worse on a Llama block in bf16
    (docs/benchmarks.md, "Compiler"): an opaque custom op with a cos/sin-only backward kept one
    more h-wide tensor per token and ran slower, and a half-by-half form without the negated
    copy made q contiguous in [B, H, S, D], which made the o_proj input a copy (+1h). A device
    kernel (Triton, on CUDA) goes here where it beats inductor."""
    return x * cos + rotate_half(x) * sin
