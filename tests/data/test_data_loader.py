import json
from types import SimpleNamespace

import pytest
import torch

from shardwise.data.loader import TokenLoader
from shardwise.data.prepare import prepare_tokens


class CountingTokenizer:
    """Stand-in tokenizer: a document is space-separated token ids; EOS is id 0."""

    def get_vocab_size(self) -> int:
        return 1000

    def token_to_id(self, token):
        return 0

    def encode_batch(self, texts):
        return [SimpleNamespace(ids=[int(word) for word in text.split()]) for text in texts]

    def to_str(self) -> str:
        return "counting"


def token_file(tmp_path, num_tokens: int):
    """Tokens 1, 2, ..., num_tokens - 1, then EOS (0): every window is recognisable by its first token."""
    document = " ".join(str(token) for token in range(1, num_tokens))
    return prepare_tokens([document], CountingTokenizer(), tmp_path / f"tokens{num_tokens}")


def loader(tokens, **overrides) -> TokenLoader:
    settings = dict(seq_len=4, global_batch_size=4, micro_batch_size=2, seed=0) | overrides
    return TokenLoader(tokens, **settings)


def window_starts(micro_batches) -> list[int]:
    """Window index of every sample, in order (the first input token is window * seq_len + 1)."""
    return [int(first - 1) // 4 for inputs, _ in micro_batches for first in inputs[:, 0]]


def global_batch(micro_batches) -> torch.Tensor:
    return torch.cat([inputs for inputs, _ in micro_batches])


def test_batches_are_shifted_windows_of_the_stream(tmp_path):
    tokens = token_file(tmp_path, 41)  # 10 windows of 4 + 1 tokens
    data = loader(tokens)
    micro_batches = data.next_step()
    assert data.num_micro_batches == 2 and data.step == 1 and data.num_windows == 10
    for inputs, targets in micro_batches:
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (2, 4)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row, target_row in zip(inputs, targets):
            start = int(row[0]) - 1
            assert start % 4 == 0
            assert row.tolist() == tokens.tokens[start:start + 4].tolist()
            assert target_row.tolist() == tokens.tokens[start + 1:start + 5].tolist()


def test_same_seed_same_order_other_seed_other_order(tmp_path):
    tokens = token_file(tmp_path, 41)
    first, second, other = loader(tokens), loader(tokens), loader(tokens, seed=1)
    steps = [window_starts(first.next_step()) for _ in range(5)]
    assert steps == [window_starts(second.next_step()) for _ in range(5)]
    assert steps != [window_starts(other.next_step()) for _ in range(5)]


def test_every_epoch_visits_each_window_once_and_wraps_around(tmp_path):
    tokens = token_file(tmp_path, 41)  # 10 windows; 4 per step, so step 2 spans two epochs
    data = loader(tokens)
    samples = [window for _ in range(5) for window in window_starts(data.next_step())]
    assert sorted(samples[:10]) == list(range(10)) and sorted(samples[10:20]) == list(range(10))
    assert samples[:10] != samples[10:20]


def test_data_parallel_ranks_split_the_same_global_batch(tmp_path):
    tokens = token_file(tmp_path, 101)
    single = loader(tokens, global_batch_size=8)
    ranks = [loader(tokens, global_batch_size=8, dp_rank=rank, dp_size=2) for rank in range(2)]
    for _ in range(4):
        per_rank = [rank.next_step() for rank in ranks]
        assert [len(micro_batches) for micro_batches in per_rank] == [2, 2]
        assert torch.equal(torch.cat([global_batch(mb) for mb in per_rank]), global_batch(single.next_step()))
        assert not set(window_starts(per_rank[0])) & set(window_starts(per_rank[1]))


def test_resume_gives_the_uninterrupted_batches_even_with_another_dp_size(tmp_path):
    tokens = token_file(tmp_path, 101)
    uninterrupted = loader(tokens, global_batch_size=8)
    for _ in range(3):
        uninterrupted.next_step()
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    assert state["step"] == 3 and state["seq_len"] == 4 and state["data_sha256"] == tokens.meta["sha256"]
    resumed = loader(tokens, global_batch_size=8, micro_batch_size=4)
    resumed.load_state_dict(state)
    ranks = [loader(tokens, global_batch_size=8, dp_rank=rank, dp_size=2) for rank in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    for _ in range(3):
        expected = global_batch(uninterrupted.next_step())
        assert torch.equal(global_batch(resumed.next_step()), expected)
        assert torch.equal(torch.cat([global_batch(rank.next_step()) for rank in ranks]), expected)
    assert resumed.step == 6


@pytest.mark.parametrize("change, message", [
    (dict(seq_len=5), "seq_len = 4 in the checkpoint but 5 now; resume with the same train.seq_len"),
    (dict(global_batch_size=8), "global_batch_size = 4 in the checkpoint but 8 now; resume with the same train.global_batch_size"),
    (dict(seed=3), "seed = 0 in the checkpoint but 3 now; resume with the same train.seed"),
])
def test_resume_with_other_settings_is_refused(tmp_path, change, message):
    tokens = token_file(tmp_path, 101)
    state = loader(tokens).state_dict()
    with pytest.raises(ValueError, match=f"data loader state: {message}"):
        loader(tokens, **change).load_state_dict(state)


def test_resume_on_other_data_is_refused(tmp_path):
    state = loader(token_file(tmp_path, 101)).state_dict()
    with pytest.raises(ValueError, match="data loader state: data_sha256 = .* resume with the same data \\(data.\\* settings"):
        loader(token_file(tmp_path, 102)).load_state_dict(state)


def test_seq_len_longer_than_the_corpus(tmp_path):
    tokens = token_file(tmp_path, 50)
    with pytest.raises(ValueError, match=r"^train.seq_len = 4096 is longer than the corpus \(50 tokens\); "
                                         r"use a shorter train.seq_len or more data$"):
        loader(tokens, seq_len=4096)


def test_batch_must_divide_over_micro_batches_and_ranks(tmp_path):
    tokens = token_file(tmp_path, 50)
    with pytest.raises(ValueError, match=r"train.global_batch_size = 6 is invalid: use a multiple of "
                                         r"train.micro_batch_size \* dp \(2 \* 2 = 4\)"):
        loader(tokens, global_batch_size=6, dp_size=2)


def test_rank_must_be_in_range(tmp_path):
    with pytest.raises(ValueError, match="dp_rank = 2 is out of range for dp_size = 2"):
        loader(token_file(tmp_path, 50), dp_rank=2, dp_size=2)


def test_token_id_outside_the_model_vocabulary(tmp_path):
    tokens = token_file(tmp_path, 50)  # max token id 49
    loader(tokens, vocab_size=50)
    with pytest.raises(ValueError, match=r"token id 49 is outside the model vocabulary \(40\); "
                                         r"use model.vocab_size >= 50 or re-tokenize"):
        loader(tokens, vocab_size=40)
