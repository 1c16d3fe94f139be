"""The DPO loader (data/preference_loader.py): whole pairs per micro-batch, the same global batch for
any number of data-parallel ranks, resumable, and every pair once for the reference pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.data.chat_masks import Encoded
from shardwise.data.example_store import store_of
from shardwise.data.preference_loader import PreferenceLoader

SEQ_LEN = 8


def numbered_stores(num_pairs: int):
    """Pair p: a prompt [p, p] then a completion of 3 tokens, chosen 1000 + p, rejected 2000 + p: every
    token says which pair and side it came from; rows shorter than SEQ_LEN + 1 are padded with 7."""
    def side(first: int):
        examples = [Encoded(np.array([p, p] + [first + p] * 3), np.array([False, False, True, True, True]))
                    for p in range(num_pairs)]
        return store_of(examples, [(0, p + 1) for p in range(num_pairs)], ["hand-built"], 4096)

    return side(1000), side(2000)


def loader(num_pairs=10, dp_rank=0, dp_size=1, micro=2, batch=4):
    return PreferenceLoader(*numbered_stores(num_pairs), seq_len=SEQ_LEN, global_batch_size=batch,
                            micro_batch_size=micro, seed=3, pad_id=7, dp_rank=dp_rank, dp_size=dp_size)


def test_a_micro_batch_holds_whole_pairs_chosen_rows_first():
    batches = loader().next_step()
    assert len(batches) == 2
    for batch in batches:
        assert batch.inputs_BS.shape == batch.targets_BS.shape == (4, SEQ_LEN)
        for i, pair in enumerate(batch.pair_ids_P.tolist()):
            assert batch.inputs_BS[i].tolist() == [pair, pair] + [1000 + pair] * 2 + [7] * 4
            assert batch.inputs_BS[2 + i].tolist() == [pair, pair] + [2000 + pair] * 2 + [7] * 4
            # the targets: -100 on the prompt and the padding, the completion's tokens elsewhere
            assert batch.targets_BS[i].tolist() == [-100] + [1000 + pair] * 3 + [-100] * 4
            assert batch.targets_BS[2 + i].tolist() == [-100] + [2000 + pair] * 3 + [-100] * 4


def test_the_ranks_slices_make_the_one_process_batch():
    whole = loader().batch_of_step(3)
    ranks = [loader(dp_rank=r, dp_size=2).batch_of_step(3) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 1
    joined = [batch for rank in ranks for batch in rank]
    for mine, one in zip(joined, whole):
        for field in ("inputs_BS", "targets_BS", "pair_ids_P"):
            torch.testing.assert_close(getattr(mine, field), getattr(one, field), rtol=0, atol=0)


def test_a_resumed_loader_continues_where_it_stopped():
    first = loader()
    for _ in range(4):  # past an epoch of 10 pairs
        first.next_step()
    resumed = loader(dp_rank=1, dp_size=2)
    resumed.load_state_dict(first.state_dict())
    expected = first.next_step()[1]  # rank 1 of dp2 holds the second micro-batch of one process
    got = resumed.next_step()[0]
    assert got.pair_ids_P.tolist() == expected.pair_ids_P.tolist()
    torch.testing.assert_close(got.inputs_BS, expected.inputs_BS, rtol=0, atol=0)


def test_a_resume_with_other_pairs_is_refused():
    state = loader().state_dict()
    with pytest.raises(ValueError, match="data_sha256"):
        loader(num_pairs=11).load_state_dict(state)


def test_the_reference_pass_sees_every_pair_once():
    """5 pairs over 2 ranks, 2 pairs a micro-batch: 2 micro-batches on each rank (the collective
    forward needs equal counts), the filler rows marked -1."""
    shares = [loader(num_pairs=5, dp_rank=r, dp_size=2).all_pairs_of_rank() for r in range(2)]
    assert [len(share) for share in shares] == [2, 2]
    owned = [pair for share in shares for batch in share for pair in batch.pair_ids_P.tolist() if pair >= 0]
    assert sorted(owned) == [0, 1, 2, 3, 4]
    assert shares[1][1].pair_ids_P.tolist() == [-1, -1]


def test_micro_batches_carry_the_reference_once_attached():
    pairs = loader()
    assert pairs.next_step()[0].reference_P2 is None
    pairs.reference = np.arange(20, dtype=np.float64).reshape(10, 2)
    batch = pairs.next_step()[0]
    assert batch.reference_P2.dtype == torch.float32
    assert batch.reference_P2.tolist() == [[2.0 * p, 2.0 * p + 1] for p in batch.pair_ids_P.tolist()]
