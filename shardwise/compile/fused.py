"""The fused operations the rewrite rules (compile/rules/) put in place of composed ones.

Each is one node in the graph with its own backward that saves the least it needs: torch's
fused kernel (aten._fused_rms_norm, which saves x and 1/rms) or a `torch.library` custom op
whose CPU implementation is the reference maths below (inductor calls it as a kernel; it does
not fuse into it). Each equals its composed source up to float rounding
(tests/compile/test_rules.py checks forward and backward). No Triton kernel yet: this session had no GPU to measure one against inductor.
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


@torch.library.custom_op("shardwise::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; linear in x, so backward keeps only cos and sin (the
    transpose of rotate_half is rotate_half with the other sign). Contiguous, whatever x's
    strides, so that the fake kernel can say what the real one returns."""
    return (x * cos + rotate_half(x) * sin).contiguous()


@rope.register_fake
def _(x, cos, sin):
    return x.new_empty(torch.broadcast_shapes(x.shape, cos.shape), dtype=torch.promote_types(x.dtype, cos.dtype))


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    g1, g2 = (grad * sin).chunk(2, dim=-1)
    return grad * cos + torch.cat((g2, -g1), dim=-1), None, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup)
