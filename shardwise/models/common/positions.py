"""Learned absolute position embeddings (GPT-2, BERT): a table of one vector per position, added
to the token embeddings before the first block."""

import torch
from torch import nn


class LearnedPositions(nn.Embedding):
    """`max_seq_len` rows of width `dim`; positions [S] or [B, S] -> vectors [1 or B, S, dim].

    An `nn.Embedding` so that a layout splits it as it splits the token table (tensor parallelism's
    "vocab" role: rows over the ranks, partial lookups summed). Its output always keeps a batch
    dimension, so that dimension 1 is the sequence, which sequence parallelism shards, as it shards
    the token embeddings the positions are added to."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__(max_seq_len, dim)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions if positions.dim() == 2 else positions.unsqueeze(0))
