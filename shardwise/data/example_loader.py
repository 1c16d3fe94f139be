"""Stateful, rank-aware batches of example rows: TokenLoader's order and slicing (data/loader.py) over
the rows of data/packing.py instead of windows of a token stream.

Sample k of the run is row `perm_e[k % num_rows]` (e = k // num_rows, perm_e seeded by (seed, e)),
step s holds samples s*G .. s*G + G - 1, rank r of dp takes the contiguous slice r of them: the
same global batch for 1 or N ranks, and a state (the step) any data-parallel size resumes from.

A micro-batch is (inputs, targets, document_ids) of packed rows, (inputs, targets) of padded ones,
int64 [micro_batch_size, seq_len] each (the contract in tools/post_training_contract.md).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from shardwise.data.example_store import ExampleStore
from shardwise.data.loader import TokenLoader
from shardwise.data.packing import packed_row, padding_fraction


class ExampleLoader(TokenLoader):
    def __init__(self, store: ExampleStore, rows: list[np.ndarray] | None, *, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, seed: int, pad_id: int, dp_rank: int = 0, dp_size: int = 1):
        """`rows`: the packed rows' example indices (data/packing.py), or None: one example a row, padded."""
        self.store, self.rows, self.pad_id = store, rows, int(pad_id)
        num_rows = store.num_examples if rows is None else len(rows)
        self.set_order(seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                       seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_windows=num_rows, make_pair=self.row_batch,
                       data_sha256=rows_sha256(store, rows), data_size=num_rows)

    @property
    def padding_fraction(self) -> float:
        """The share of all rows' positions that are padding (no compute saved on them)."""
        return padding_fraction(self.store, self.num_windows, self.seq_len)

    def read_windows(self, windows: np.ndarray) -> np.ndarray:
        return windows

    def row_batch(self, rows: np.ndarray, samples: np.ndarray) -> tuple[torch.Tensor, ...]:
        made = [packed_row(self.store, self.examples_of_row(int(row)), self.seq_len, self.pad_id) for row in rows]
        columns = [torch.from_numpy(np.stack(column)) for column in zip(*made)]
        return tuple(columns) if self.rows is not None else tuple(columns[:2])

    def examples_of_row(self, row: int) -> np.ndarray:
        return self.rows[row] if self.rows is not None else np.asarray([row])


def rows_sha256(store: ExampleStore, rows: list[np.ndarray] | None) -> str:
    """Names the rows a checkpoint's data position counts: the examples and how they were packed."""
    hasher = hashlib.sha256(store.sha256().encode())
    if rows is not None:  # the packed rows: their sizes, then their examples
        hasher.update(np.asarray([len(row) for row in rows], dtype=np.int64).tobytes())
        hasher.update(np.concatenate(rows).astype(np.int64).tobytes() if rows else b"")
    return hasher.hexdigest()
