"""The fused operations the rewrite rules (compile/rules/) put in place of composed ones.

On CPU each is what measured best (docs/benchmarks.md, "Compiler"): torch's fused RMSNorm
(inductor decomposes it into one forward and one backward kernel that keep x and 1/rms), an
opaque `torch.library` custom op where its own backward keeps less than inductor's partitioner
would (swiglu_down: recomputes the product instead of keeping it), or the composition itself
where inductor's fusion of it is already the best kernel (rope). Each equals its composed
source up to float rounding (tests/compile/test_rules.py checks forward and backward). No
Triton kernel yet: no session so far had a GPU to measure one against inductor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.models.common.rope import rotate_half



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), computed in fp32 inside torch's fused kernel, which saves x and the
    per-token 1/rms for backward (the composed form also keeps an fp32 copy of x)."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual)): the residual stream and the next block input."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


@torch.library.custom_op("shardwise::swiglu", mutates_args=())
def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b; backward keeps a and b and recomputes silu and its derivative."""
    return (F.silu(a) * b).contiguous()


@swiglu.register_fake
def _(a, b):
    return a.new_empty(a.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    a, b = ctx.saved_tensors
    sig = torch.sigmoid(a)
    return grad * b * sig * (1 + a * (1 - sig)), grad * a * sig


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@torch.library.custom_op("shardwise::swiglu_down", mutates_args=())
def swiglu_down(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(a) * b): backward keeps a and b (and the weight, as the matmul would) and
    recomputes the product silu(a) * b for the weight gradient instead of keeping it: 2 of the
    MLP's 3 hidden-width activations. An opaque op on purpose: inductor's partitioner, seeing
    the composition, would keep the product it just computed."""
    return F.linear(F.silu(a) * b, weight)


@swiglu_down.register_fake
def _(a, b, weight):
    return a.new_empty((*a.shape[:-1], weight.shape[0]))


def _swiglu_down_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_down_backward(ctx, grad):
    a, b, weight = ctx.saved_tensors
    sig = torch.sigmoid(a)
    silu = a * sig
    grad_product = grad @ weight
    grad_weight = grad.flatten(0, -2).t() @ (silu * b).flatten(0, -2)
    return grad_product * b * sig * (1 + a * (1 - sig)), grad_product * silu, grad_weight


swiglu_down.register_autograd(_swiglu_down_backward, setup_context=_swiglu_down_setup)
for _device in ("cpu", "cuda"):  # under autocast, run in bf16 as the linear it replaces would
    torch.library.register_autocast("shardwise::swiglu_down", _device, torch.bfloat16)


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
