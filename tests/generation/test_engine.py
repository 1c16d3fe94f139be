"""The engine against full recomputation (no cache): greedy tokens, logits and logprobs, under
continuous batching, chunked prefill, cancellation, and every sampling knob."""

import re
import threading
import time

import pytest
import torch

from shardwise.config.presets import model_config
from shardwise.generation.engine import MAX_FAILED_STEPS, Engine, EngineStopped, engine_for_model, generate_all
from shardwise.generation.runner import ModelRunner, key_bucket
from shardwise.generation.sampling import InvalidRequest, SamplingParams
from shardwise.models.llama.model import build_model


class DigitsTokenizer:
    """Token i decodes to " i": enough for the engine's text handling, no tokenizer training."""

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def tiny_model(preset="debug", **overrides):
    cfg = model_config(preset, init_std=0.2, **overrides)  # a large init makes greedy outputs varied
    return build_model(cfg, seed=1).eval()


def greedy_by_recompute(model, prompt, num_tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def make_engine(model, *, max_batch=4, prefill_chunk=256, eos_id=None):
    return Engine(ModelRunner(model, num_slots=max_batch), DigitsTokenizer(), eos_id=eos_id,
                  prefill_chunk=prefill_chunk)


GREEDY = SamplingParams(max_tokens=20, temperature=0)
PROMPTS = [[5, 17, 42, 7, 99], [3], list(range(1, 40)), [8, 8, 8], [200, 1, 300], [11] * 25]


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_heads=1), dict(parallel_block=True),
                                       dict(preset="moe-debug")],
                         ids=["gqa", "mqa", "parallel-block", "moe"])
def test_batched_greedy_equals_recompute(overrides):
    """More prompts than slots (continuous batching admits them as slots free), prompts longer than
    a prefill chunk (prefilled over several steps beside running decodes)."""
    model = tiny_model(**overrides)
    engine = make_engine(model, max_batch=3, prefill_chunk=16)
    seqs = generate_all(engine, PROMPTS, GREEDY)
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_ids == greedy_by_recompute(model, prompt, 20), prompt
        assert seq.finish_reason == "length"
    assert engine.num_running() == 0 and engine.num_waiting() == 0
    assert len({tuple(s.output_ids) for s in seqs}) == len(PROMPTS)


def test_engine_logits_equal_full_forward():
    """The first sampled token's logprobs come from the chunked prefill, later ones from decode
    steps: both equal log_softmax of one forward over the whole text. The head runs at one
    position a row, prefill chunks included."""
    model = tiny_model()
    engine = make_engine(model, prefill_chunk=4)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    got, head_widths = [], []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: head_widths.append(args[0].shape[1]))
    seq = engine.submit(PROMPTS[0], params, got.append)
    engine.run_until_done()
    hook.remove()
    assert head_widths == [1] * 7  # two prefill chunks (4 + 1 tokens), then 5 decode steps
    ids = PROMPTS[0] + seq.output_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    for i, out in enumerate(got):
        position = len(PROMPTS[0]) - 1 + i
        assert out.token.logprob == pytest.approx(float(logprobs[position, out.token.token_id]), abs=1e-4)
        top = torch.topk(logprobs[position], 3)
        assert [t for t, _ in out.token.top] == top.indices.tolist()


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny_model()
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=7)
    alone = generate_all(make_engine(model), [PROMPTS[0]], params)[0].output_ids
    crowd = generate_all(make_engine(model), [PROMPTS[3], PROMPTS[0], PROMPTS[1]], params)[1].output_ids
    assert alone == crowd
    other_seed = generate_all(make_engine(model), [PROMPTS[0]], SamplingParams(max_tokens=16, seed=8))[0]
    assert other_seed.output_ids != alone
    choices = generate_all(make_engine(model), [PROMPTS[0]], params, n=3)
    assert choices[0].output_ids == alone and len({tuple(c.output_ids) for c in choices}) == 3


def test_top_k_1_and_tiny_top_p_and_temperature_are_greedy():
    model = tiny_model()
    greedy = generate_all(make_engine(model), [PROMPTS[0]], GREEDY)[0].output_ids
    for params in (SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=3),
                   SamplingParams(max_tokens=20, temperature=1.5, top_p=1e-6, seed=3),
                   SamplingParams(max_tokens=20, temperature=5e-324, seed=3)):  # logits / T would be inf
        assert generate_all(make_engine(model), [PROMPTS[0]], params)[0].output_ids == greedy


def test_penalties_and_logit_bias_change_the_choice():
    model = tiny_model()
    plain = generate_all(make_engine(model), [[8, 8, 8]], GREEDY)[0].output_ids
    assert len(set(plain)) < len(plain)  # greedy repeats itself here...
    penalised = SamplingParams(max_tokens=20, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    out = generate_all(make_engine(model), [[8, 8, 8]], penalised)[0].output_ids
    assert len(set(out)) > len(set(plain))  # ...and less so when repeats are penalised
    biased = SamplingParams(max_tokens=5, temperature=0, logit_bias={77: 100.0})
    assert generate_all(make_engine(model), [[8, 8, 8]], biased)[0].output_ids == [77] * 5


def test_stop_token_ids_and_eos_end_the_sequence():
    model = tiny_model()
    greedy = generate_all(make_engine(model), [PROMPTS[0]], GREEDY)[0].output_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    seq = generate_all(make_engine(model), [PROMPTS[0]],
                       SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert seq.output_ids == greedy[:first + 1] and seq.finish_reason == "stop"
    seq = generate_all(make_engine(model, eos_id=stop_at), [PROMPTS[0]], GREEDY)[0]
    assert seq.finish_reason == "stop" and seq.text == DigitsTokenizer().decode(greedy[:first])
    seq = generate_all(make_engine(model, eos_id=stop_at), [PROMPTS[0]],
                       SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert seq.output_ids == greedy


def test_stop_string_cuts_the_text():
    model = tiny_model()
    greedy = generate_all(make_engine(model), [PROMPTS[0]], GREEDY)[0]
    words = greedy.text.split(" ")
    stop = f" {words[5]} "  # the 5th token's text, with the spaces around it
    seq = generate_all(make_engine(model), [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0, stop=(stop,)))[0]
    assert seq.finish_reason == "stop"
    assert seq.text == greedy.text[:greedy.text.index(stop)]


def test_context_limit_ends_with_length_and_long_prompts_are_refused():
    model = tiny_model(max_seq_len=16)
    engine = make_engine(model)
    seq = generate_all(engine, [[1] * 10], SamplingParams(max_tokens=100, temperature=0))[0]
    assert seq.finish_reason == "length" and len(seq.output_ids) == 6
    with pytest.raises(ValueError, match="prompt has 16 tokens but the model's context is 16"):
        engine.submit([1] * 16, GREEDY, print)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], GREEDY, print)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens = 0 is invalid: ask for at least 1 token"),
    ("temperature", -0.5, "temperature = -0.5 is invalid"),
    ("temperature", 2.5, "temperature = 2.5 is invalid"),
    ("top_p", 0.0, "top_p = 0.0 is invalid"),
    ("top_k", -1, "top_k = -1 is invalid"),
    ("presence_penalty", 3.0, "presence_penalty = 3.0 is invalid"),
    ("frequency_penalty", -2.5, "frequency_penalty = -2.5 is invalid"),
    ("logprobs", 21, "logprobs = 21 is invalid"),
    ("stop", ("",), "stop strings must not be empty"),
    ("stop_token_ids", (10_000,), "stop_token_ids = 10000 is invalid: token ids go from 0 to 511"),
    ("logit_bias", {-1: 1.0}, "logit_bias = -1 is invalid: token ids go from 0 to 511"),
    ("top_k", 513, "top_k = 513 is invalid: use 0 (every token) or a positive count up to the vocabulary's 512"),
    ("seed", 2**63, "seed = 9223372036854775808 is invalid: use a 64-bit signed integer"),
    ("temperature", float("nan"), "temperature = nan is invalid"),
])
def test_bad_sampling_values_are_refused(field, value, message):
    engine = make_engine(tiny_model())
    with pytest.raises(InvalidRequest, match=re.escape(message)) as caught:
        engine.submit([1, 2], SamplingParams(**{field: value}), print)
    assert caught.value.param == field
    assert engine.num_waiting() == 0


@pytest.mark.parametrize("prompt, bad_id", [([1, 512], 512), ([-1, 2], -1), ([2**70], 2**70)],
                         ids=["past-vocab", "negative", "huge"])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(prompt, bad_id):
    """Before this check an id past the vocabulary reached the embedding: an IndexError in the engine thread."""
    engine = make_engine(tiny_model())
    with pytest.raises(InvalidRequest, match=f"prompt token id = {bad_id} is invalid: token ids go from 0 to 511") as caught:
        engine.submit(prompt, GREEDY, print)
    assert caught.value.param == "prompt" and engine.num_waiting() == 0


def test_a_failing_step_ends_only_its_sequences_and_the_engine_serves_on(caplog):
    """A step that raises ends the sequences that held a slot in it (finish_reason "error", with the
    error id the log line names); the waiting one then runs, greedy as ever."""
    model = tiny_model()
    engine = make_engine(model, max_batch=1)
    outputs = []
    decode = engine.runner.decode_logits
    calls = iter([RuntimeError("injected: out of memory")])

    def decode_failing_once(batch):
        fault = next(calls, None)
        if fault is not None:
            raise fault
        return decode(batch)

    engine.runner.decode_logits = decode_failing_once
    doomed = engine.submit([1, 2, 3], SamplingParams(max_tokens=5, temperature=0), outputs.append)
    waiting = engine.submit([4, 5], SamplingParams(max_tokens=3, temperature=0), outputs.append)
    helper = threading.Thread(target=lambda: (wait_until(lambda: waiting.finish_reason), engine.pause()))
    helper.start()
    engine.serve_forever()
    helper.join()
    assert doomed.finish_reason == "error" and doomed.error_id
    assert waiting.finish_reason == "length" and waiting.output_ids == greedy_by_recompute(model, [4, 5], 3)
    assert engine.failed_steps == 0 and not engine.failed
    [record] = [r for r in caplog.records if r.name == "shardwise.engine"]
    assert f"error id {doomed.error_id}" in record.getMessage() and "injected: out of memory" in record.getMessage()


def test_steps_failing_in_a_row_stop_the_engine():
    engine = make_engine(tiny_model(), max_batch=1)

    def broken(batch):
        raise RuntimeError("injected: the device is lost")

    engine.runner.prefill_logits = broken
    seqs = [engine.submit([i + 1], GREEDY, print) for i in range(MAX_FAILED_STEPS + 1)]
    engine.serve_forever()  # returns by itself once MAX_FAILED_STEPS steps failed in a row
    assert engine.failed and all(seq.finish_reason == "error" and seq.error_id for seq in seqs)
    with pytest.raises(EngineStopped):
        engine.submit([1], GREEDY, print)


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_cancel_frees_the_slot_at_the_next_step():
    model = tiny_model()
    engine = make_engine(model, max_batch=1)
    outputs = []
    long = engine.submit([1, 2, 3], SamplingParams(max_tokens=500, temperature=0), outputs.append)
    waiting = engine.submit([4, 5], SamplingParams(max_tokens=3, temperature=0), outputs.append)
    for _ in range(3):
        engine.step()
    assert long.slot == 0 and waiting.slot is None
    engine.cancel(long)
    engine.step()
    assert long.finish_reason == "cancelled" and waiting.slot == 0
    engine.run_until_done()
    assert waiting.output_ids == greedy_by_recompute(model, [4, 5], 3)
    assert outputs[-1].sequence is waiting and outputs[-1].finish_reason == "length"


def test_serve_forever_steps_in_the_calling_thread_until_paused_and_can_serve_again():
    """`shardwise serve` steps the engine in its main thread while requests come from another."""
    model = tiny_model()
    engine = make_engine(model, max_batch=2)
    stepped_in = set()
    step = engine.step
    engine.step = lambda: (stepped_in.add(threading.get_ident()), step())

    def client(prompts):
        done = threading.Semaphore(0)
        seqs = [engine.submit(p, GREEDY, lambda out: out.finish_reason and done.release()) for p in prompts]
        for _ in seqs:
            assert done.acquire(timeout=60)
        engine.pause()
        return seqs

    for prompts in (PROMPTS[:3], PROMPTS[3:]):  # serve, pause, serve again
        seqs = []
        helper = threading.Thread(target=lambda: seqs.extend(client(prompts)))
        helper.start()
        engine.serve_forever()
        helper.join()
        assert [s.output_ids for s in seqs] == [greedy_by_recompute(model, p, 20) for p in prompts]
    assert stepped_in == {threading.get_ident()}
    engine.pause()  # a pause asked for while idle ends the next serve_forever at once
    engine.serve_forever()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["debug", "moe-debug"])
def test_compiled_decode_equals_eager(preset):
    """An MoE step compiles through `MoE.every_expert` (static shapes) and keeps dynamo's guards on
    the model (runner.py): before either, its graph broke at the experts and the resumed frames
    ran with another layer's weights."""
    model = tiny_model(preset)
    eager = generate_all(make_engine(model), PROMPTS[:3], GREEDY)
    compiled = generate_all(engine_for_model(model, DigitsTokenizer(), eos_id=None, max_batch=4, compile=True),
                            PROMPTS[:3], GREEDY)
    assert [s.output_ids for s in compiled] == [s.output_ids for s in eager]


@pytest.mark.slow
def test_on_cpu_a_compiled_decode_step_compiles_twice_over_every_key_length():
    """On CPU a decode step attends a multiple of 16 key columns (`key_bucket`): 100 tokens after
    prompts of up to 39 cross seven lengths. The first recompile makes the length symbolic, so
    the step compiles twice in all (the count a server pays), not once per length."""
    from torch._dynamo.utils import counters

    model = tiny_model()
    engine = engine_for_model(model, DigitsTokenizer(), eos_id=None, max_batch=4, compile=True)
    before = counters["stats"]["unique_graphs"]
    seqs = generate_all(engine, PROMPTS[:3], SamplingParams(max_tokens=100, temperature=0))
    assert counters["stats"]["unique_graphs"] - before == 2
    assert [key_bucket(n, "cpu") for n in (1, 32, 33, 48, 49, 139)] == [32, 32, 48, 48, 64, 144]
    assert [key_bucket(n, "cuda") for n in (1, 33, 139)] == [32, 64, 256]
    assert [s.output_ids for s in seqs] == [greedy_by_recompute(model, p, 100) for p in PROMPTS[:3]]


@pytest.mark.slow
def test_on_cpu_a_runner_that_owns_its_model_stores_linear_weights_transposed_and_16_compiled_rows_equal_eager():
    """`cpu_weight_layout`, for a runner that owns its model (`shardwise serve` and `generate`'s):
    every linear's weight and the tied head's table keep their values and shapes but are stored
    [in, out], so MKL multiplies a step's few rows by a contiguous operand. Other runners (the
    trainer's closing sample) leave the model as it is."""
    model = tiny_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 5)] for i in range(16)]
    params = SamplingParams(max_tokens=6, temperature=0)
    kept = generate_all(make_engine(model, max_batch=16), prompts, params)  # a runner that does not own it
    assert all(p.is_contiguous() for p in model.parameters())
    eager = generate_all(Engine(ModelRunner(model, num_slots=16, owns_model=True), DigitsTokenizer(), eos_id=None),
                         prompts, params)
    assert [s.output_ids for s in eager] == [s.output_ids for s in kept]
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert model.cfg.tie_embeddings and linears
    for weight in [*linears, model.embed_tokens.weight]:
        assert weight.t().is_contiguous() and not weight.is_contiguous()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert [s.output_ids for s in eager] == [greedy_by_recompute(model, p, 6) for p in prompts]
    compiled = generate_all(engine_for_model(model, DigitsTokenizer(), eos_id=None, max_batch=16, compile=True,
                                             owns_model=True), prompts, params)
    assert [s.output_ids for s in compiled] == [s.output_ids for s in eager]


def test_a_long_prompt_is_prefilled_in_chunks_while_running_decodes_advance():
    model = tiny_model()
    engine = make_engine(model, max_batch=2, prefill_chunk=8)
    running = engine.submit([1, 2, 3], SamplingParams(max_tokens=100, temperature=0), lambda out: None)
    engine.step()  # its prefill and first token
    long = engine.submit(list(range(1, 65)), SamplingParams(max_tokens=4, temperature=0), lambda out: None)
    before = len(running.output_ids)
    for step in range(1, 9):  # 64 prompt tokens, 8 per step
        engine.step()
        assert len(running.output_ids) == before + step  # one token every step, never stalled
        if step < 8:
            assert long.num_cached == 8 * step and not long.output_ids
    # its first token sampled when the prefill completed, and decoded in the same step
    assert len(long.output_ids) == 2
    engine.run_until_done()
    assert long.output_ids == greedy_by_recompute(model, list(range(1, 65)), 4)
    assert running.output_ids == greedy_by_recompute(model, [1, 2, 3], 100)


@pytest.mark.slow
def test_two_compiled_engines_in_one_process_each_decode_their_own_model():
    """Each runner compiles its own copy of the decode step (`runner.own_code`): with the model's guards
    skipped, two models in one process must not share a graph (a parallel-block model would
    otherwise run the sequential one's code, as a gated T5 ran an ungated one's on CUDA)."""
    first, second = tiny_model(), tiny_model(parallel_block=True)
    for model in (first, second):  # max_batch 4: the first's graphs are test_compiled_decode_equals_eager's, cached
        compiled = generate_all(engine_for_model(model, DigitsTokenizer(), eos_id=None, max_batch=4, compile=True),
                                PROMPTS[:2], GREEDY)
        assert [s.output_ids for s in compiled] == [s.output_ids for s in generate_all(make_engine(model),
                                                                                       PROMPTS[:2], GREEDY)]
