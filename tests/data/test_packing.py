"""Packing examples into train.seq_len rows: best-fit in a seeded order, never splitting an example,
and the rows the micro-batch contract describes (document ids, padding, targets -100)."""

import numpy as np
import pytest

from shardwise.data.chat_masks import Encoded
from shardwise.data.example_store import store_of
from shardwise.data.packing import pack_examples, packed_row, padding_fraction

PAD = 0


def store(*examples):
    """Examples given as (ids, index of the first token that carries the loss)."""
    encoded = [Encoded(np.asarray(ids, dtype=np.int64), np.arange(len(ids)) >= first) for ids, first in examples]
    return store_of(encoded, [(0, k + 1) for k in range(len(examples))], ["rows.jsonl"], vocab_size=100)


def test_best_fit_never_splits_and_fills_each_row():
    rng = np.random.default_rng(0)
    positions = rng.integers(1, 17, size=300)
    rows = pack_examples(positions, capacity=16, seed=3)
    placed = np.concatenate(rows)
    assert sorted(placed.tolist()) == list(range(300))  # every example once, whole
    assert all(positions[row].sum() <= 16 for row in rows)
    assert len(rows) <= 1.1 * np.ceil(positions.sum() / 16)  # best-fit: close to the fewest rows possible


def test_packing_is_seeded():
    positions = np.random.default_rng(1).integers(1, 9, size=50)
    first, again = pack_examples(positions, 8, seed=5), pack_examples(positions, 8, seed=5)
    assert [row.tolist() for row in first] == [row.tolist() for row in again]
    other = pack_examples(positions, 8, seed=6)
    assert [row.tolist() for row in first] != [row.tolist() for row in other]


def test_an_exact_fit_closes_the_row():
    rows = pack_examples(np.asarray([4, 4, 4, 4]), capacity=8, seed=0)
    assert sorted(len(row) for row in rows) == [2, 2]


def test_a_packed_row_holds_each_example_s_pairs_document_ids_and_padding():
    examples = store(([5, 6, 7, 8], 2), ([9, 10, 11], 1), ([12, 13], 1))
    inputs, targets, documents = packed_row(examples, np.asarray([1, 0]), seq_len=8, pad_id=PAD)
    # example 1 first (9 10 -> 10 11, all loss), then example 0 (5 6 7 -> 6 7 8, loss from token 2 on)
    assert inputs.tolist() == [9, 10, 5, 6, 7, PAD, PAD, PAD]
    assert targets.tolist() == [10, 11, -100, 7, 8, -100, -100, -100]
    assert documents.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_a_full_row_has_no_padding_document():
    examples = store(([1, 2, 3], 1), ([4, 5, 6], 1))
    inputs, targets, documents = packed_row(examples, np.asarray([0, 1]), seq_len=4, pad_id=PAD)
    assert inputs.tolist() == [1, 2, 4, 5] and targets.tolist() == [2, 3, 5, 6] and documents.tolist() == [0, 0, 1, 1]


def test_padding_fraction_counts_positions():
    examples = store(([1, 2, 3], 1), ([4, 5, 6, 7, 8], 1))  # 2 + 4 positions
    assert padding_fraction(examples, num_rows=2, seq_len=4) == pytest.approx(1 - 6 / 8)
    assert padding_fraction(examples, num_rows=1, seq_len=6) == 0.0
