"""Multi-head attention whose keys and values may come from another sequence (an encoder-decoder's
cross-attention, T5's), with a key padding mask and an optional additive score bias (a relative
position bias, `models/common/relative_position.py`).

The same module serves self-attention (no `source`: keys and values from the queries' own input),
so a family with biased scores needs one attention class for both. Projections have no biases
unless asked (`bias=True`). `scale` is the factor on q k^T: None is 1/sqrt(head_dim); T5 passes 1.0
(it folds the scale into the init of q). The core receives it as a keyword (`scale=s`) only when it
is not the default, as `attention.py` hands a sliding window only when there is one: a swapped
core that does not know scales then fails on an unscaled model instead of silently scaling.

Masked keys take the dtype's minimum, not -inf, as HF does: a query with no key left averages
instead of giving NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def masked_attention(q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, bias_BHST: torch.Tensor | None,
                     keep_BHST: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """softmax(scale q k^T + bias) v, keys where `keep` is False masked with the dtype's minimum.
    `bias` and `keep` broadcast to [batch, heads, S, T]; either may be None. `scale` None is
    1/sqrt(head_dim)."""
    mask = None
    if bias_BHST is not None:
        mask = bias_BHST.to(q_BHSD.dtype)
    if keep_BHST is not None:
        kept = mask if mask is not None else torch.zeros((), dtype=q_BHSD.dtype, device=q_BHSD.device)
        mask = torch.where(keep_BHST, kept, torch.finfo(q_BHSD.dtype).min)
    return F.scaled_dot_product_attention(q_BHSD, k_BHTD, v_BHTD, attn_mask=mask, scale=scale)


def key_mask(padding_mask_BS: torch.Tensor | None) -> torch.Tensor | None:
    """[B, 1, 1, S] bool, True at the keys a query may attend (the real tokens), from a padding
    mask [B, S] (bool or 0/1, True = a real token, HF's attention_mask), or None."""
    return None if padding_mask_BS is None else padding_mask_BS.bool()[:, None, None, :]


class CrossAttention(nn.Module):
    """Multi-head attention of `x_BSD`'s queries over `source_BTD`'s keys and values (cross-attention),
    or over `x_BSD`'s own (self-attention) when `source_BTD` is None. Modules `q_proj`, `k_proj`,
    `v_proj`, `o_proj`; separate projections let tensor parallelism split each by heads."""

    core_attention = staticmethod(masked_attention)
    """(q, k, v, bias, keep[, scale=s]) -> out on [batch, heads, seq, head_dim] tensors; a layout may
    swap it on an instance."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, *, bias: bool = False, scale: float | None = None):
        super().__init__()
        self.head_dim, self.scale = head_dim, scale
        width = n_heads * head_dim
        self.q_proj = nn.Linear(dim, width, bias=bias)
        self.k_proj = nn.Linear(dim, width, bias=bias)
        self.v_proj = nn.Linear(dim, width, bias=bias)
        self.o_proj = nn.Linear(width, dim, bias=bias)

    def forward(self, x_BSD: torch.Tensor, bias_BHST: torch.Tensor | None, keep_BHST: torch.Tensor | None,
                source_BTD: torch.Tensor | None = None) -> torch.Tensor:
        """Every input positional (tensor parallelism's "block_input" style counts them): a block
        passes None for an absent bias, mask or source rather than leaving it out."""
        scale = {} if self.scale is None else {"scale": self.scale}
        k, v = self.source_kv(x_BSD if source_BTD is None else source_BTD)
        return self.attend_with(x_BSD, lambda q: self.core_attention(q, k, v, bias_BHST, keep_BHST, **scale))

    def heads(self, proj: nn.Linear, x_BSD: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, head_dim]; -1 heads: all of them in one process, 1/tp of them on a tp rank."""
        return proj(x_BSD).view(x_BSD.shape[0], x_BSD.shape[1], -1, self.head_dim).transpose(1, 2)

    def source_kv(self, source_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a source (an inference cache keeps an encoder output's once)."""
        return self.heads(self.k_proj, source_BTD), self.heads(self.v_proj, source_BTD)

    def attend_with(self, x_BSD: torch.Tensor, attend) -> torch.Tensor:
        """o_proj(attend(q)) with x's queries: `attend` maps [B, heads, S, head_dim] queries to
        their attention output (the forward's, or an inference cache's over its stored keys)."""
        out = attend(self.heads(self.q_proj, x_BSD))
        return self.o_proj(out.transpose(1, 2).reshape(x_BSD.shape[0], x_BSD.shape[1], -1))
