"""Feed-forward blocks: SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x)), no biases (Llama);
GeluMLP: down(gelu(up(x))) with biases (GPT-2 with GELU's tanh approximation, BERT and ViT with
the exact erf GELU)."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """`approximate`: "tanh", GELU's tanh approximation, which GPT-2 was trained with (HF's
    "gelu_new"), or "none", the exact erf GELU (BERT's and ViT's "gelu"). The two differ by up to
    ~1e-3, enough to move converted logits past tolerance, so each family names its own."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
