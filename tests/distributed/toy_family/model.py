"""The toy family's model, deliberately unlike Llama: other module names everywhere (`wte`, `trunk`,
`ln_out`, `unembed`; `mixer.query/key/value/out`; `ff.expand/contract`), LayerNorm instead of
RMSNorm, a GELU MLP instead of SwiGLU, learned absolute positions instead of RoPE, an untied head."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.common.attention import causal_attention


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 96
    width: int = 32
    heads: int = 4
    hidden: int = 64
    depth: int = 4
    max_len: int = 64


class Mixer(nn.Module):
    core_attention = staticmethod(causal_attention)

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.head_dim = cfg.width // cfg.heads
        self.query, self.key, self.value = (nn.Linear(cfg.width, cfg.width) for _ in range(3))
        self.out = nn.Linear(cfg.width, cfg.width)

    def forward(self, x):
        B, S, _ = x.shape
        # -1 heads: all of them in one process, 1/tp of them on a tensor-parallel rank
        q, k, v = (proj(x).view(B, S, -1, self.head_dim).transpose(1, 2) for proj in (self.query, self.key, self.value))
        return self.out(self.core_attention(q, k, v).transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.expand = nn.Linear(cfg.width, cfg.hidden)
        self.contract = nn.Linear(cfg.hidden, cfg.width)

    def forward(self, x):
        return self.contract(F.gelu(self.expand(x)))


class Layer(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.pre_mix, self.mixer = nn.LayerNorm(cfg.width), Mixer(cfg)
        self.pre_ff, self.ff = nn.LayerNorm(cfg.width), FeedForward(cfg)

    def forward(self, x):
        x = x + self.mixer(self.pre_mix(x))
        return x + self.ff(self.pre_ff(x))


class ToyLM(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.max_len, cfg.width)
        self.trunk = nn.ModuleDict({str(i): Layer(cfg) for i in range(cfg.depth)})
        self.ln_out = nn.LayerNorm(cfg.width)
        self.unembed = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens, where=None):
        if tokens.is_floating_point():  # a later pipeline stage: the previous stage's hidden state
            h = tokens
        else:
            where = torch.arange(tokens.shape[1], device=tokens.device) if where is None else where
            h = self.wte(tokens) + self.wpe(where)
        for layer in self.trunk.values():
            h = layer(h)
        if self.unembed is None:
            return h
        return self.unembed(self.ln_out(h))

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if ".pre_" in f".{name}" or name.startswith("ln_out"):
            return torch.ones(shape, device=device)
        gen = torch.Generator(device=device).manual_seed(seed * 7919 + zlib.crc32(name.encode()))
        return torch.empty(shape, device=device).normal_(0.0, 0.5 / math.sqrt(self.cfg.width), generator=gen)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            tensor.copy_(self.initial_value(name, tensor.shape, tensor.device, seed))
