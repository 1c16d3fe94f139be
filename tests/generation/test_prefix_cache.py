"""Prefix caching: outputs equal to the engine without it (greedy), whatever is shared, evicted or
arriving at once; the index's leaf-first LRU; the counts /metrics reports; the flag's bad values."""

import pytest

from shardwise.generation.engine import Engine, generate_all
from shardwise.generation.prefix_cache import BLOCK_SIZE, enable_prefix_caching, prefix_cache_bytes
from shardwise.generation.prefix_index import PrefixIndex
from shardwise.generation.runner import ModelRunner
from shardwise.generation.sampling import SamplingParams

from test_engine import DigitsTokenizer, tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0)
SHARED = [(7 * i + 3) % 500 for i in range(2 * BLOCK_SIZE)]  # two whole blocks
PROMPTS = [
    SHARED + [11, 12, 13],  # a miss: the first
    SHARED + [11, 12, 14],  # its prefix plus a block's remainder differ at the end
    SHARED,  # equal to a cached prefix (whole blocks): all but its last token reused
    SHARED[:BLOCK_SIZE],  # exactly one block
    SHARED[:BLOCK_SIZE] + [400] * 40,  # one block shared, then its own
    SHARED + [400] * 40,
    [5, 6, 7],  # shorter than a block
    list(range(100, 150)),  # nothing shared
    SHARED + [11, 12, 13] + [99] * 20,  # extends the first prompt
]


def engine_of(model, *, pool_bytes=None, max_batch=3, prefill_chunk=16):
    runner = ModelRunner(model, num_slots=max_batch)
    prefix_cache = enable_prefix_caching(runner, pool_bytes) if pool_bytes else None
    return Engine(runner, DigitsTokenizer(), eos_id=None, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache)


def outputs(engine, prompts):
    return [seq.output_ids for seq in generate_all(engine, prompts, GREEDY)]


@pytest.mark.parametrize("overrides", [dict(), dict(sliding_window=8)], ids=["gqa", "sliding-window"])
def test_outputs_with_prefix_caching_equal_those_without(overrides):
    """Two waves through one engine: the first arrives at once (more prompts than slots, prefilled
    in 16-token chunks: later prompts find the earlier ones' blocks), the second finds all of them.
    A sliding window (8) shorter than the shared prefix: the slot keeps every position."""
    model = tiny_model(**overrides)
    expected = outputs(engine_of(model), PROMPTS)
    engine = engine_of(model, pool_bytes=1 << 20)
    assert outputs(engine, PROMPTS) == expected
    first_wave = engine.prefix_cache.counts()
    assert first_wave["hits"] >= 4 and first_wave["reused_tokens"] > 0
    second = generate_all(engine, PROMPTS, GREEDY)
    assert [seq.output_ids for seq in second] == expected
    assert [seq.num_reused for seq in second] == [reused_whole(p) for p in PROMPTS]
    assert len({tuple(ids) for ids in expected}) >= 6  # varied outputs: equality means something


def reused_whole(prompt):
    """Tokens a prompt reuses once it was seen whole: its whole blocks, all but its last token."""
    return min(len(prompt) - 1, len(prompt) // BLOCK_SIZE * BLOCK_SIZE)


def test_counts_of_one_sequence_at_a_time():
    engine = engine_of(tiny_model(), pool_bytes=1 << 20, max_batch=1)
    seqs = generate_all(engine, [SHARED + [1], SHARED + [2], SHARED, [3, 4, 5]], GREEDY)
    assert [seq.num_reused for seq in seqs] == [0, 32, 31, 0]
    counts = engine.prefix_cache.counts()
    assert counts["hits"] == 2 and counts["misses"] == 2 and counts["reused_tokens"] == 63
    assert counts["evicted_blocks"] == 0
    # held: SHARED's 2 blocks; no third is whole (a sequence ends with 32 + 1 + 7 tokens cached at most)
    assert counts["bytes_used"] == 2 * engine.runner.prefix_pool.block_bytes


def test_a_tiny_pool_evicts_and_outputs_stay_equal():
    """A pool of 3 blocks: every prompt evicts others' blocks; outputs unchanged, memory within the bound."""
    model = tiny_model()
    expected = outputs(engine_of(model), PROMPTS)
    block_bytes = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # k and v, 2 layers, 2 kv heads, head_dim 16, fp32
    engine = engine_of(model, pool_bytes=3 * block_bytes + block_bytes // 2)
    assert outputs(engine, PROMPTS + PROMPTS[::-1]) == expected + expected[::-1]
    counts = engine.prefix_cache.counts()
    assert engine.runner.prefix_pool.block_bytes == block_bytes
    assert counts["evicted_blocks"] > 0 and counts["hits"] > 0
    assert engine.runner.prefix_pool.bytes_allocated() == 3 * block_bytes
    assert counts["bytes_used"] == 3 * block_bytes <= counts["bytes_limit"]


def test_the_index_evicts_the_least_recently_used_leaf_and_never_a_parent():
    index = PrefixIndex(num_blocks=3, block_size=2)
    assert index.insert([1, 2, 3, 4]) == (0, [0, 1])  # a chain of two blocks
    assert index.insert([9, 9]) == (0, [2])
    assert index.match([1, 2, 3, 4, 5]) == [0, 1]  # the chain is now the most recent
    assert index.insert([1, 2, 7, 7]) == (1, [2])  # evicts [9, 9], the least recent leaf
    assert index.num_evicted == 1 and index.match([9, 9]) == []
    # [1, 2] has two children: only they can go; [1, 2, 3, 4] is the older leaf
    assert index.insert([5, 5]) == (0, [1])
    assert index.match([1, 2, 3, 4]) == [0] and index.match([1, 2, 7, 7]) == [0, 2]
    # extending a chain never evicts the block it extends: the pool is full of its own chain
    full = PrefixIndex(num_blocks=1, block_size=2)
    assert full.insert([1, 2, 3, 4]) == (0, [0])
    assert full.insert([1, 2, 3, 4]) == (1, []) and full.match([1, 2]) == [0]


def test_bad_prefix_cache_sizes_name_the_flag():
    from shardwise.config.presets import model_config

    debug, big = model_config("debug"), model_config("llama3-8b")
    assert prefix_cache_bytes(None, debug, encoder_decoder=False, num_shards=1) == 256 << 20  # on by default
    assert prefix_cache_bytes(None, debug, encoder_decoder=True, num_shards=1) == 0  # off for encoder-decoders
    assert prefix_cache_bytes(0, debug, encoder_decoder=False, num_shards=1) == 0
    with pytest.raises(ValueError, match=r"^--prefix-cache-mb = 3 is invalid: an encoder-decoder's prompt"):
        prefix_cache_bytes(3, debug, encoder_decoder=True, num_shards=1)
    # llama3-8b: 2 x 32 layers x 8 kv heads x 16 tokens x 128 x 4 bytes = 4 MiB a block (2 MiB a rank of tp 2)
    with pytest.raises(ValueError, match=r"^--prefix-cache-mb = 3 is invalid: one block of 16 tokens of this "
                                         r"model takes 4.00 MiB; use at least 4 \(or 0: off\)$"):
        prefix_cache_bytes(3, big, encoder_decoder=False, num_shards=1)
    assert prefix_cache_bytes(3, big, encoder_decoder=False, num_shards=2) == 3 << 20
