"""Norms: RMSNorm (Zhang & Sennrich, 2019): y = x / sqrt(mean(x^2) + eps) * weight (Llama), and
LayerNorm with a bias, y = (x - mean) / sqrt(var + eps) * weight + bias (GPT-2), which is torch's
own: autocast already runs it in fp32, as HF does, so it needs nothing of ours."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the scale, as HF Llama does, so bf16 runs
        # and converted checkpoints agree with the reference implementation.
        x_fp32 = x.float()
        x_normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_normed.to(x.dtype)


LayerNorm = nn.LayerNorm
