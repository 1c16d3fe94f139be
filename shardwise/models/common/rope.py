"""Rotary position embedding (Su et al., 2021) in the "rotate half" layout used by HF
`transformers`, so converted q/k weights need no permutation; with the optional Llama-3
frequency scaling (long-wavelength frequencies divided by `factor`, a smooth ramp between).

cos/sin are computed from explicit positions on every call: it is cheap (S x head_dim/2)
and lets generation with a KV cache, and later context-parallel chunking, pass any positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    head_dim: int
    theta: float = 10000.0
    scaling_factor: float = 0.0
    """0 disables Llama-3 scaling; otherwise the factor long wavelengths are stretched by."""
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    @classmethod
    def of(cls, cfg) -> "RopeSpec":
        """The RoPE of a model config (its head width and `rope_*` fields)."""
        return cls(head_dim=cfg.head_size, theta=cfg.rope_theta, scaling_factor=cfg.rope_scaling_factor,
                   low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_seq_len=cfg.rope_original_max_seq_len)


def inverse_frequencies(spec: RopeSpec, device=None) -> torch.Tensor:
    """inv_freq_i = theta^(-2i/d), i < d/2, optionally Llama-3 scaled."""
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64, device=device).float() / spec.head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.scaling_factor:
        inv_freq = llama3_scale(inv_freq, spec)
    return inv_freq


def llama3_scale(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Llama 3.1: keep short wavelengths, divide long ones by the factor, interpolate between."""
    low_freq_wavelen = spec.original_max_seq_len / spec.low_freq_factor
    high_freq_wavelen = spec.original_max_seq_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / spec.scaling_factor, inv_freq)
    smooth = (spec.original_max_seq_len / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.scaling_factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(spec: RopeSpec, positions_S: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [S, head_dim] (each frequency repeated for both halves); [B, S, head_dim]
    for positions [B, S]."""
    inv_freq = inverse_frequencies(spec, positions_S.device)
    angles = positions_S.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    return x_BHSD * cos_SD + rotate_half(x_BHSD) * sin_SD
