"""Batches of preference pairs for DPO (train.objective = "dpo"): whole pairs, the same global
batch for 1 or N ranks, resumable like the token loader.

A pair is example k of two parallel stores (data/example_store.py, made by
data/preference.py's `tokenize_preference_rows` and fitted to train.seq_len by data.overlong): prompt
+ chosen completion and prompt + rejected completion. Each is one row padded to train.seq_len, its
(inputs, targets) made as for padded instruction rows (data/packing.py's `packed_row` with one
example): the targets are -100 (no log-probability) except on the completion's tokens and its end
token, so a row's log-probability is the completion's given its prompt.

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
from typing import NamedTuple

import numpy as np
import torch

from shardwise.data.example_store import ExampleStore
from shardwise.data.loader import TokenLoader, check_one_batch
from shardwise.data.packing import packed_row


class PairBatch(NamedTuple):
    """One micro-batch of P whole pairs (2P rows: the chosen completions, then the rejected ones)."""

    inputs_BS: torch.Tensor
    targets_BS: torch.Tensor
    """-100 on the prompt and the padding: only the completion's tokens are summed."""
    pair_ids_P: torch.Tensor
    """Each pair's index in the training data (int64 [P])."""
    reference_P2: torch.Tensor | None = None
    """Reference log-probabilities, float32 [P, 2] (chosen, rejected); None before they are computed."""


class PreferenceLoader(TokenLoader):
    """TokenLoader's order, slicing and state over pairs; each micro-batch is a `PairBatch`."""

    def __init__(self, chosen: ExampleStore, rejected: ExampleStore, *, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, seed: int, pad_id: int, dp_rank: int = 0, dp_size: int = 1):
        assert chosen.num_examples == rejected.num_examples, (chosen.num_examples, rejected.num_examples)
        self.chosen, self.rejected, self.pad_id = chosen, rejected, int(pad_id)
        self.reference: np.ndarray | None = None
        """float64 [num_pairs, 2]: each pair's reference log-probabilities (chosen, rejected)."""
        data_sha256 = hashlib.sha256(f"{chosen.sha256()} {rejected.sha256()}".encode()).hexdigest()
        self.set_order(seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                       seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_windows=chosen.num_examples,
                       make_pair=self.pair_batch, data_sha256=data_sha256, data_size=chosen.num_examples)

    @property
    def num_pairs(self) -> int:
        return self.num_windows

    def read_windows(self, windows: np.ndarray) -> np.ndarray:
        return windows  # the pairs' indices: pair_batch reads them

    def pair_rows(self, pair_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 [2P, seq_len] of `pair_ids`: the chosen rows first, then the rejected."""
        rows = [packed_row(store, [int(pair)], self.seq_len, self.pad_id)[:2]
                for store in (self.chosen, self.rejected) for pair in pair_ids]
        inputs, targets = zip(*rows)
        return torch.from_numpy(np.stack(inputs)), torch.from_numpy(np.stack(targets))

    def pair_batch(self, pair_ids: np.ndarray, samples: np.ndarray | None = None) -> PairBatch:
        inputs, targets = self.pair_rows(pair_ids)
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
            batches.append(PairBatch(*self.pair_rows(np.maximum(ids, 0)), torch.from_numpy(ids)))
        return batches


def build_preference_loader(cfg, examples, *, dp_rank: int = 0, dp_size: int = 1) -> PreferenceLoader:
    """The training loader of a preference ExampleSet (data/example_data.py: `train` holds the chosen and
    the rejected store); a set smaller than one global batch of pairs is refused here."""
    chosen, rejected = examples.train
    loader = PreferenceLoader(chosen, rejected, seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
                              micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, pad_id=examples.pad_id,
                              dp_rank=dp_rank, dp_size=dp_size)
    check_one_batch(cfg, loader.num_pairs, f"{loader.num_pairs} preference pairs")
    return loader
