"""Bucketed relative position bias (T5, Raffel et al., 2020): instead of absolute positions, every
attention score gets a learned per-head bias looked up by the bucketed distance between its query
and its key.

`relative_position_bucket` is the bucket function (Mesh TensorFlow's, HF's
`T5Attention._relative_position_bucket`); `RelativePositionBias` is one stack's table, which a model
keeps as a top-level module and evaluates once per forward (`scores_bias`), handing the bias to every
block's attention as an additive score term (`models/common/cross_attention.py` takes it).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """HF's `T5Attention._relative_position_bucket` (Mesh TensorFlow's): key position minus query
    position -> bucket. Half the buckets (per direction when bidirectional) are exact distances,
    the rest logarithmic bins up to `max_distance`, beyond which all share the last bucket. A
    causal stack (not bidirectional) maps every future position to bucket 0. The logarithm's
    argument is clamped to >= 1 (HF takes log(0) = -inf for the exact distances, whose values
    `where` discards anyway), so no infinity is cast to an integer; the buckets are equal."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    if_large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, if_large)


class RelativePositionBias(nn.Embedding):
    """One stack's table of per-head score biases, [num_buckets, n_heads] (its parameter is `weight`).
    An nn.Embedding (its forward looks up bucket indices) so that tensor parallelism can split it by
    heads (columns, role "colwise") like the colwise q/k/v projections, each rank looking up the
    biases of its own heads. `bidirectional`: an encoder's (keys on both sides); False: a causal
    decoder's, every future key in bucket 0."""

    def __init__(self, num_buckets: int, n_heads: int, *, bidirectional: bool, max_distance: int):
        super().__init__(num_buckets, n_heads)
        self.bidirectional, self.max_distance = bidirectional, max_distance

    def scores_bias(self, query_len: int, key_len: int) -> torch.Tensor:
        """[1, heads, query_len, key_len]: the bias of each query/key pair's distance."""
        device = self.weight.device
        return self.bias_at(torch.arange(query_len, device=device)[None], torch.arange(key_len, device=device))

    def bias_at(self, query_positions_BS: torch.Tensor, key_positions_T: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, T]: the bias between each row's query positions and the key positions (a
        decode step: each row's one query at its own position, over the cached keys)."""
        relative = key_positions_T[None, None, :] - query_positions_BS[:, :, None]
        buckets = relative_position_bucket(relative, bidirectional=self.bidirectional,
                                           num_buckets=self.num_embeddings, max_distance=self.max_distance)
        return self(buckets).permute(0, 3, 1, 2)  # through __call__: a layout's hooks run
