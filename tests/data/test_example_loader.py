"""The example loader: TokenLoader's interface over packed or padded rows of examples: the same
global batch for 1 or N ranks, resumable at another data-parallel size, rows as the contract says."""

import numpy as np
import pytest
import torch

from shardwise.data.chat_masks import Encoded
from shardwise.data.example_loader import ExampleLoader
from shardwise.data.example_store import store_of
from shardwise.data.packing import pack_examples

EOS = 0
SEQ_LEN = 12


@pytest.fixture(scope="module")
def examples():
    """40 examples of 3..12 tokens; example k's tokens are 100 * k + 1, 100 * k + 2, ...; loss from token 2."""
    rng = np.random.default_rng(0)
    encoded = [Encoded(np.arange(1, n + 1) + 100 * k, np.arange(n) >= 2)
               for k, n in enumerate(rng.integers(3, SEQ_LEN + 1, size=40))]
    return store_of(encoded, [(0, k + 1) for k in range(40)], ["rows.jsonl"], vocab_size=5000)


def loader(examples, packed: bool, **overrides):
    rows = pack_examples(examples.lengths - 1, SEQ_LEN, seed=7) if packed else None
    settings = dict(seq_len=SEQ_LEN, global_batch_size=8, micro_batch_size=2, seed=7, pad_id=EOS) | overrides
    return ExampleLoader(examples, rows, **settings)


def global_batch(micro_batches) -> list[torch.Tensor]:
    return [torch.cat(column) for column in zip(*micro_batches)]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_the_global_batch_is_the_same_for_1_2_and_4_ranks(examples, packed):
    one = loader(examples, packed)
    for step in range(6):  # past an epoch of the packed rows
        whole = global_batch(one.batch_of_step(step))
        for dp in (2, 4):
            parts = [loader(examples, packed, dp_rank=r, dp_size=dp).batch_of_step(step) for r in range(dp)]
            assert all(len(part) == 8 // (2 * dp) for part in parts)
            joined = global_batch([mb for part in parts for mb in part])
            assert all(torch.equal(a, b) for a, b in zip(whole, joined))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_resume_at_another_data_parallel_size_continues_the_run(examples, packed):
    uninterrupted = loader(examples, packed)
    expected = [global_batch(uninterrupted.next_step()) for _ in range(5)]
    first = [loader(examples, packed, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(2):
        for rank in first:
            rank.next_step()
    state = first[0].state_dict()
    assert state == first[1].state_dict()  # rank independent
    resumed = loader(examples, packed)
    resumed.load_state_dict(state)
    for step in range(2, 5):
        assert all(torch.equal(a, b) for a, b in zip(expected[step], global_batch(resumed.next_step())))


def test_padded_rows_are_one_example_each_padded_with_end_of_text(examples):
    data = loader(examples, packed=False)
    seen = set()
    for inputs, targets in data.batch_of_step(0):
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (2, SEQ_LEN)
        for row_inputs, row_targets in zip(inputs.tolist(), targets.tolist()):
            example = row_inputs[0] // 100
            ids, _ = examples.example(example)
            n = len(ids)
            assert row_inputs == ids[:-1].tolist() + [EOS] * (SEQ_LEN - n + 1)
            assert row_targets == [-100] + ids[2:].tolist() + [-100] * (SEQ_LEN - n + 1)
            seen.add(example)
    assert len(seen) == 8


def test_packed_rows_cover_every_example_once_per_epoch(examples):
    data = loader(examples, packed=True, global_batch_size=1, micro_batch_size=1)
    firsts = []
    for step in range(data.num_windows):
        [(inputs, targets, documents)] = data.batch_of_step(step)
        inputs, documents = inputs[0].tolist(), documents[0].tolist()
        for document in range(max(documents) + 1):
            tokens = [t for t, d in zip(inputs, documents) if d == document]
            if tokens and tokens[0] != EOS:
                firsts.append(tokens[0] // 100)
    assert sorted(firsts) == list(range(40))


def test_a_changed_packing_is_refused_on_resume(examples):
    state = loader(examples, packed=True).state_dict()
    with pytest.raises(ValueError, match="data_sha256 = .* in the checkpoint but .* now; resume with the same data"):
        loader(examples, packed=False).load_state_dict(state)
