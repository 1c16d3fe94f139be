"""Prefix caching: outputs equal to the engine without it (greedy), whatever is shared, evicted or
arriving at once; the index's leaf-first LRU; the counts /metrics reports; the flag's bad values."""

import pytest

from shardwise.generation.engine import Engine, generate_all
from shardwise.generation.prefix_cache import BLOCK_SIZE, enable_prefix_caching, prefix_cache_bytes
from shardwise.generation.prefix_index import PrefixIndex
from shardwise.generation.runner import ModelRunner
from shardwise.generation.sampling import SamplingParams

from test_engine import DigitsTokenizer, tiny_model
from serving_run import train_serving_run

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


SYSTEM = "# a system prompt that every request shares, long enough for several blocks of tokens\nimport os\n"
QUESTIONS = ["def main():\n    ", "class Parser:\n    ", "def read(path):\n    ", "for line in lines:\n    "]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    return train_serving_run(tmp_path_factory.mktemp("prefix") / "run", data_cache,
                             **{"model.tie_embeddings": False, "run.name": "tiny"})


def serve_one_by_one(run_dir, prefix_cache_mb):
    """Each question after the system prompt, one request after another: (texts, cached tokens, /metrics)."""
    from fastapi.testclient import TestClient

    from shardwise.infer.chat import load_chat_template
    from shardwise.infer.load import open_engine
    from shardwise.infer.server import Service, build_app

    _, engine, tokenizer = open_engine(run_dir, device_name="cpu", max_batch=2, prefix_cache_mb=prefix_cache_mb)
    engine.start()
    try:
        with TestClient(build_app(Service(engine, tokenizer, "tiny", load_chat_template(run_dir)))) as client:
            answers = [client.post("/v1/completions", json={"model": "tiny", "prompt": SYSTEM + question,
                                                             "max_tokens": 12, "temperature": 0}).json()
                       for question in QUESTIONS]
            metrics = client.get("/metrics").text
    finally:
        engine.stop()
    return ([a["choices"][0]["text"] for a in answers],
            [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers], metrics)


def test_the_server_reports_hits_and_cached_tokens_and_answers_as_without_caching(run_dir):
    from shardwise.data.tokenizer import load_tokenizer

    texts, cached, metrics = serve_one_by_one(run_dir, None)  # on by default
    plain_texts, plain_cached, plain_metrics = serve_one_by_one(run_dir, 0)
    assert texts == plain_texts and len(set(texts)) > 1
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    shared = common_prefix_len([tokenizer.encode(SYSTEM + q).ids for q in QUESTIONS])
    assert shared >= 2 * BLOCK_SIZE
    assert cached == [0] + [shared // BLOCK_SIZE * BLOCK_SIZE] * 3 and plain_cached == [0] * 4
    values = {name: float(value) for name, value in
              (line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("shardwise_prefix"))}
    used = values.pop("shardwise_prefix_cache_bytes")
    assert values == {"shardwise_prefix_cache_hits_total": 3, "shardwise_prefix_cache_misses_total": 1,
                      "shardwise_prefix_cache_reused_tokens_total": sum(cached),
                      "shardwise_prefix_cache_evicted_blocks_total": 0,
                      "shardwise_prefix_cache_limit_bytes": 256 << 20}
    block_bytes = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # k and v, 2 layers, 2 kv heads, head_dim 16, fp32
    held = len(tokenizer.encode(SYSTEM + QUESTIONS[0]).ids) // BLOCK_SIZE  # at least the first prompt's blocks
    assert used % block_bytes == 0 and held * block_bytes <= used < 256 << 20
    assert "shardwise_prefix_cache" not in plain_metrics


def common_prefix_len(prompts):
    length = 0
    while all(len(p) > length and p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


def generate_argv(run_dir, prompts_file, *flags):
    return ["generate", "--run", str(run_dir), "--prompts-file", str(prompts_file), "--json", "--temperature", "0",
            "--max-new-tokens", "12", "--device", "cpu", *flags]


def tp_generate_job(run_dir: str, prompts_file: str) -> str:
    from shardwise.cli.main import build_parser
    from shardwise.infer.commands import generate_text

    return generate_text(build_parser().parse_args(generate_argv(run_dir, prompts_file, "--nproc", "2",
                                                                 "--parallel.tp", "2")))


def test_tensor_parallel_generation_with_prefix_caching_equals_one_process(pool2, run_dir, tmp_path):
    """Every rank restores and stores the same blocks of its own heads: tp 2 with caching equals one
    process (whose answers equal those without caching: the server's test above), reusing as much."""
    import json

    from shardwise.cli.main import build_parser
    from shardwise.infer.commands import generate_text

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(SYSTEM + q) + "\n" for q in QUESTIONS))
    single = generate_text(build_parser().parse_args(generate_argv(run_dir, prompts_file)))
    assert pool2.run(tp_generate_job, str(run_dir), str(prompts_file)) == [single, single]
    rows = [json.loads(line) for line in single.splitlines()]
    assert [r["cached_tokens"] > 0 for r in rows] == [False, True, True, True]  # one computes, the others reuse


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_negative_prefix_cache_size_is_a_one_line_error(run_dir, command, capsys):
    from shardwise.cli.main import main

    with pytest.raises(SystemExit) as caught:
        main([command, "--run", str(run_dir), "--device", "cpu", "--prefix-cache-mb", "-1"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1, err
    assert "--prefix-cache-mb = -1 is invalid: use 0 (off) or a positive size in MiB" in err


def test_a_store_that_fails_leaves_no_block_behind(monkeypatch):
    """A failed copy into the pool (out of memory, say) must not leave blocks that claim to hold keys."""
    model = tiny_model()
    expected = outputs(engine_of(model, max_batch=1), [SHARED + [1], SHARED + [2]])
    engine = engine_of(model, pool_bytes=1 << 20, max_batch=1)
    real_copy = ModelRunner.copy_prefix
    monkeypatch.setattr(ModelRunner, "copy_prefix", lambda self, copy: (_ for _ in ()).throw(MemoryError("pool")))
    seq = engine.submit(SHARED + [1], GREEDY, lambda out: None)
    with pytest.raises(MemoryError):
        engine.step()  # its first prefill chunk is a whole block, stored at once
    engine.fail_step(MemoryError("pool"))  # as `serve_forever` ends the step's sequences
    assert seq.finish_reason == "error" and engine.prefix_cache.index.num_used == 0
    monkeypatch.setattr(ModelRunner, "copy_prefix", real_copy)
    assert outputs(engine, [SHARED + [1], SHARED + [2]]) == expected
    assert engine.prefix_cache.counts()["hits"] == 1


def test_a_chats_next_turn_reuses_the_answer_it_repeats():
    """A finished sequence leaves its output's whole blocks: 30 prompt tokens + 8 generated (37 cached)
    hold 2 blocks, the second half answer; the next turn (prompt + answer + more) reuses both."""
    model = tiny_model()
    first_turn = SHARED[:30]
    answer = generate_all(engine_of(model), [first_turn], GREEDY)[0].output_ids
    next_turn = first_turn + answer + [42, 43]
    engine = engine_of(model, pool_bytes=1 << 20, max_batch=1)
    seqs = generate_all(engine, [first_turn, next_turn], GREEDY)
    assert seqs[0].output_ids == answer and [seq.num_reused for seq in seqs] == [0, 32]
    assert seqs[1].output_ids == outputs(engine_of(model), [next_turn])[0]
