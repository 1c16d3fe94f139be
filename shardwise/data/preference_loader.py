"""Batches of preference pairs for DPO (train.objective = "dpo"): whole pairs, the same global
batch for 1 or N ranks, resumable like the token loader.

A pair is two rows of the same prompt: prompt + chosen completion and prompt + rejected
completion, each padded to train.seq_len + 1 tokens. A row's (inputs, targets) are tokens[:-1]
and tokens[1:] as for a causal LM, the targets -100 (no log-probability) except on the
completion's tokens (`loss_mask`), so a row's log-probability is the completion's given its
prompt.

The order and the slicing are TokenLoader's (data/loader.py) with pairs in place of windows:
sample k of the run is pair perm_e[k % num_pairs], step s takes samples s*G .. s*G + G - 1, rank r
of dp the contiguous slice r of them; train.global_batch_size and train.micro_batch_size count
pairs. A micro-batch of P pairs runs 2P rows: rows 0..P-1 are the chosen completions and rows
P..2P-1 the rejected ones, pair i in rows i and P + i (the order TRL's concatenated forward uses),
so no pair is ever split between micro-batches or ranks.

`reference` (set once by train/dpo_reference.py) holds each pair's reference log-probabilities;
the micro-batches then carry them beside the tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from shardwise.data.loader import TokenLoader
from shardwise.data.objectives import IGNORE_INDEX


@dataclass(frozen=True)
class PreferencePairs:
    """Tokenized pairs: `tokens` int [num_pairs, 2, seq_len + 1] (chosen row 0, rejected row 1, padded)
    and `loss_mask` bool of the same shape (True on the completion's tokens)."""

    tokens: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self):
        assert self.tokens.ndim == 3 and self.tokens.shape[1] == 2, self.tokens.shape
        assert self.loss_mask.shape == self.tokens.shape, (self.loss_mask.shape, self.tokens.shape)

    @property
    def num_pairs(self) -> int:
        return len(self.tokens)

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[2] - 1

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256(np.ascontiguousarray(self.tokens, dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(self.loss_mask, dtype=np.bool_).tobytes())
        return digest.hexdigest()


class PairBatch(NamedTuple):
    """One micro-batch of P whole pairs (2P rows: the chosen completions, then the rejected ones)."""

    inputs_BS: torch.Tensor
    targets_BS: torch.Tensor
    """-100 on the prompt and the padding: only the completion's tokens are summed."""
    pair_ids_P: torch.Tensor
    """Each pair's index in the training data (int64 [P])."""
    reference_P2: torch.Tensor | None = None
    """Reference log-probabilities, float32 [P, 2] (chosen, rejected); None before they are computed."""


def pair_rows(pairs: PreferencePairs, pair_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) int64 [2P, seq_len] of `pair_ids`: the chosen rows first, then the rejected."""
    rows = np.concatenate([pairs.tokens[pair_ids, 0], pairs.tokens[pair_ids, 1]]).astype(np.int64)
    completion = np.concatenate([pairs.loss_mask[pair_ids, 0], pairs.loss_mask[pair_ids, 1]])
    targets = np.where(completion[:, 1:], rows[:, 1:], IGNORE_INDEX)
    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(targets)


class PreferenceLoader(TokenLoader):
    """TokenLoader's order, slicing and state over pairs; each micro-batch is a `PairBatch`."""

    def __init__(self, pairs: PreferencePairs, *, global_batch_size: int, micro_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        self.pairs = pairs
        self.reference: np.ndarray | None = None
        """float64 [num_pairs, 2]: each pair's reference log-probabilities (chosen, rejected)."""
        self.set_order(seq_len=pairs.seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                       seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_windows=pairs.num_pairs,
                       make_pair=self.pair_batch, data_sha256=pairs.sha256, data_size=pairs.num_pairs)

    @property
    def num_pairs(self) -> int:
        return self.pairs.num_pairs

    def read_windows(self, windows: np.ndarray) -> np.ndarray:
        return windows  # the pairs' indices: pair_batch reads them

    def pair_batch(self, pair_ids: np.ndarray, samples: np.ndarray | None = None) -> PairBatch:
        inputs, targets = pair_rows(self.pairs, pair_ids)
        reference = None if self.reference is None else torch.from_numpy(self.reference[pair_ids]).float()
        return PairBatch(inputs, targets, torch.from_numpy(np.asarray(pair_ids, dtype=np.int64)), reference)

    def all_pairs_of_rank(self) -> list[PairBatch]:
        """This rank's contiguous share of every pair, in order, in micro-batches. Every rank gets the
        same number of micro-batches, as the collective forward of a sharded model needs: a share
        short of it is filled up with pair 0, whose `pair_ids_P` are -1 (not this rank's)."""
        per_rank = -(-self.num_pairs // self.dp_size)
        per_rank = -(-per_rank // self.micro_batch_size) * self.micro_batch_size
        owned = np.arange(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        owned[owned >= self.num_pairs] = -1
        batches = []
        for start in range(0, per_rank, self.micro_batch_size):
            ids = owned[start:start + self.micro_batch_size]
            inputs, targets = pair_rows(self.pairs, np.maximum(ids, 0))
            batches.append(PairBatch(inputs, targets, torch.from_numpy(ids)))
        return batches
