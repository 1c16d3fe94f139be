"""Speculative decoding (`generation/speculation.py`): greedy output identical to plain decoding with
both proposers, under continuous batching; sampled output distributed as the target model's (a
chi-square test that catches a wrong acceptance rule); the counts; the cutoff and the back-off;
each bad flag; tensor-parallel speculation equal to one process's plain decoding."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from shardwise.config.presets import model_config
from shardwise.generation import speculation
from shardwise.generation.engine import Engine, engine_for_model, generate_all, speculator_for
from shardwise.generation.runner import ModelRunner
from shardwise.generation.sampling import SamplingParams
from shardwise.generation.speculation import SequenceSpeculation
from shardwise.generation.speculation_options import SpeculationOptions, speculation_options
from shardwise.infer.load import load_run, open_engine
from shardwise.models.llama.model import build_model
from serving_run import train_serving_run

GREEDY = SamplingParams(max_tokens=40, temperature=0)
# Code whose continuation copies the prompt (the ngram proposer's case) and code that does not.
PROMPTS = ["    def __init__(self, name, value):\n        self.name = name\n        self.value = value\n\n    def",
           "import os\nimport sys\nimport re\nimport os", "for i in range(10):\n    print(i)\nfor j in range(",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return", "x = 1\ny = 2\nz = x + y\n", "class ",
           "return self._", "if __name__ == '__main__':\n    main()\n", "# ", "while True:\n    ", "try:\n    import",
           "self.assertEqual(a, b)\n        self.assertEqual("]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    return train_serving_run(tmp_path_factory.mktemp("speculate") / "run", data_cache, steps=200)


def generate_with_arrivals(engine, prompt_ids, params):
    """Half the prompts at once, the rest while those decode (continuous batching admits them mid-run)."""
    half = len(prompt_ids) // 2
    seqs = [engine.submit(ids, params, lambda out: None) for ids in prompt_ids[:half]]
    for _ in range(3):
        engine.step()
    seqs += [engine.submit(ids, params, lambda out: None) for ids in prompt_ids[half:]]
    engine.run_until_done()
    return seqs


def noisy_copy(model, scale=0.05, seed=0):
    """A draft that agrees with the target often, not always: partial acceptance."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return model


def test_greedy_speculation_equals_plain_decoding(run_dir):
    """ngram and a draft model, 12 prompts over 4 slots with arrivals mid-run: token for token plain
    decoding's output, with drafts both accepted and rejected (partial acceptance keeps the draft's
    cache consistent, or its next proposals would go astray and the counts show it)."""
    _, plain_engine, tokenizer = open_engine(run_dir, device_name="cpu", max_batch=4, prefill_chunk=16)
    ids = [tokenizer.encode(prompt).ids for prompt in PROMPTS]
    plain = [seq.output_ids for seq in generate_with_arrivals(plain_engine, ids, GREEDY)]
    _, ngram, _ = open_engine(run_dir, device_name="cpu", max_batch=4, prefill_chunk=16, speculate="ngram")
    ngram.speculator.options = SpeculationOptions(kind="ngram", max_batch=4)  # every row verifies, cutoff lifted
    assert [seq.output_ids for seq in generate_with_arrivals(ngram, ids, GREEDY)] == plain
    draft = noisy_copy(load_run(run_dir)[1])
    drafted = engine_for_model(load_run(run_dir)[1], tokenizer, eos_id=plain_engine.eos_id, max_batch=4,
                               speculation=SpeculationOptions(kind="draft", num_tokens=4, max_batch=4), draft_model=draft)
    drafted.scheduler.prefill_chunk = 16
    assert [seq.output_ids for seq in generate_with_arrivals(drafted, ids, GREEDY)] == plain
    for engine in (ngram, drafted):
        proposed, accepted = engine.stats["draft_tokens_proposed"], engine.stats["draft_tokens_accepted"]
        assert 0 < accepted < proposed, engine.stats
        assert engine.stats["decode_steps"] < plain_engine.stats["decode_steps"]
    assert drafted.stats["draft_tokens_accepted"] > drafted.stats["draft_tokens_proposed"] / 2


def test_with_compile_the_drafts_steps_run_its_compiled_decode_step(run_dir, monkeypatch):
    """`compile=True` compiles the draft runner's decode step too, and the draft's one- and
    two-token steps run through it (row = slot, as the target's steps), giving plain decoding's
    greedy tokens; a one-token prompt's chunk runs eager (its first forward allocates the cache,
    which a compiled step cannot). Dynamo traces the steps as for inductor; the eager backend spares the code
    generation (minutes on 2 cores: benchmarks/speculation.py --compile runs inductor's)."""
    calls = []
    real_compile = torch.compile

    def traced(fn, options=None):
        compiled = real_compile(fn, backend="eager")

        def step(tokens, *args):
            calls.append((fn.__self__, tokens.shape[1], len(args) == 6))
            return compiled(tokens, *args)
        return step
    monkeypatch.setattr(torch, "compile", traced)
    _, plain_engine, tokenizer = open_engine(run_dir, device_name="cpu", max_batch=2)
    ids = [tokenizer.encode("# ").ids[:1]] + [tokenizer.encode(prompt).ids for prompt in PROMPTS[:2]]
    plain = [seq.output_ids for seq in generate_all(plain_engine, ids, GREEDY)]
    target = ModelRunner(load_run(run_dir)[1], num_slots=2)  # eager: only the draft's steps are traced
    speculator = speculator_for(target, SpeculationOptions(kind="draft", max_batch=2),
                                noisy_copy(load_run(run_dir)[1]), compile=True)
    drafted = Engine(target, tokenizer, eos_id=plain_engine.eos_id, speculator=speculator)
    outputs = [generate_all(drafted, ids[:1], GREEDY)[0].output_ids]  # alone: the draft's first forward
    assert outputs + [seq.output_ids for seq in generate_all(drafted, ids[1:], GREEDY)] == plain
    draft_runner = drafted.speculator.draft.runner
    draft_widths = {(width, every) for runner, width, every in calls if runner is draft_runner}
    assert draft_widths == {(1, False), (2, True)}, draft_widths  # decode steps, and two tokens after full rounds
    assert drafted.stats["draft_tokens_accepted"] > 0


def test_a_draft_run_of_the_same_model_is_always_accepted_and_counted(run_dir, tmp_path):
    """`--speculate draft:RUN` through `generate --json`: per-prompt counts, which add up to the
    engine's (the /metrics counters) and, with the target as its own draft, every draft accepted."""
    from shardwise.infer.commands import generate_results
    from shardwise.cli.main import build_parser
    from shardwise.infer.metrics import ServerMetrics

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS[:4]))
    args = build_parser().parse_args(["generate", "--run", str(run_dir), "--prompts-file", str(prompts), "--json",
                                      "--temperature", "0", "--max-new-tokens", "24", "--device", "cpu"])
    plain = generate_results(args)
    args.speculate, args.num_speculative_tokens = f"draft:{run_dir}", 3
    args.max_batch = 1  # a draft speculates for one sequence at a time (SPECULATION_MAX_BATCH)
    drafted = generate_results(args)
    assert [r["completion"] for r in drafted] == [r["completion"] for r in plain]
    assert all(r["acceptance_rate"] == 1.0 and r["draft_tokens_proposed"] > 0 for r in drafted), drafted

    _, engine, tokenizer = open_engine(run_dir, device_name="cpu", max_batch=2, speculate="ngram")
    seqs = generate_all(engine, [tokenizer.encode(p).ids for p in PROMPTS[:4]], GREEDY)
    assert engine.stats["draft_tokens_proposed"] == sum(seq.speculation.proposed for seq in seqs) > 0
    assert engine.stats["draft_tokens_accepted"] == sum(seq.speculation.accepted for seq in seqs)
    text = ServerMetrics(engine).render()
    rate = engine.stats["draft_tokens_accepted"] / engine.stats["draft_tokens_proposed"]
    assert f"shardwise_draft_tokens_proposed_total {float(engine.stats['draft_tokens_proposed'])}" in text
    assert f"shardwise_draft_tokens_accepted_total {float(engine.stats['draft_tokens_accepted'])}" in text
    assert f"shardwise_draft_acceptance_rate {rate}" in text


# ---- the sampled distribution ----

VOCAB = 16
PROMPT = list(range(VOCAB)) + [0]  # every token once: the ngram proposer always proposes t + 1 after t
NUM_SAMPLES = 1500


def tiny(seed):
    return build_model(model_config("debug", vocab_size=VOCAB, max_seq_len=32, init_std=0.1), seed=seed).eval()


def exact_second_token(model, params):
    """The target's distribution of the second generated token: sum over t1 of p(t1) p(t2 | t1)."""
    def probs(logits_BV):
        return speculation.sampling_probs(logits_BV, [params] * len(logits_BV))

    with torch.no_grad():
        first = probs(model(torch.tensor([PROMPT]))[:, -1])[0]
        second = probs(model(torch.tensor([PROMPT + [t] for t in range(VOCAB)]))[:, -1])
    return first @ second


def chi_square(counts, expected_probs, num_samples):
    """The statistic over cells expected >= 5 times (the rest pooled) and the 0.1% critical value
    (Wilson-Hilferty's approximation of the chi-square quantile; z = 3.09)."""
    expected = expected_probs * num_samples
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def sampled_second_tokens(model, params, options, draft=None):
    engine = engine_for_model(model, DigitsTokenizer(), eos_id=None, max_batch=16, speculation=options,
                              draft_model=draft)
    seqs = generate_all(engine, [PROMPT], params, n=NUM_SAMPLES)
    assert engine.stats["draft_tokens_proposed"] >= NUM_SAMPLES  # the second token was always a verify step's
    return torch.bincount(torch.tensor([seq.output_ids[1] for seq in seqs]), minlength=VOCAB).float()


class DigitsTokenizer:
    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_tokens_follow_the_target_distribution(proposer, monkeypatch):
    """The second token of 1500 samples (temperature 0.9, top-k 12, top-p 0.95; proposals at every
    position) against the exact target distribution; then with a wrong rule that keeps every draft
    (the proposer's q instead of p), which the same test must reject."""
    target, params = tiny(1), SamplingParams(max_tokens=3, temperature=0.9, top_k=12, top_p=0.95, seed=7)
    options = SpeculationOptions(kind=proposer, num_tokens=2, max_batch=16)  # every row speculates
    draft = tiny(2) if proposer == "draft" else None
    exact = exact_second_token(target, params)
    statistic, critical = chi_square(sampled_second_tokens(target, params, options, draft), exact, NUM_SAMPLES)
    assert statistic < critical, (statistic, critical)

    def keep_every_draft(logits_SV, proposal, params, generator):
        return proposal.tokens + [0]
    monkeypatch.setattr(speculation, "accept_row", keep_every_draft)
    statistic, critical = chi_square(sampled_second_tokens(target, params, options, draft), exact, NUM_SAMPLES)
    assert statistic > 10 * critical, (statistic, critical)


# ---- when it speculates ----

def test_above_the_batch_cutoff_and_after_misses_it_decodes_plainly():
    spec = speculation.Speculator(SpeculationOptions(kind="ngram", num_tokens=4, max_batch=2), capacity=64)

    def seq(prompt):
        from shardwise.generation.sequence import Sequence
        return Sequence(prompt, SamplingParams(max_tokens=20, temperature=0), None, None, None, frozenset(),
                        output_ids=[2], slot=0)

    repeating = [seq([1, 2, 3, 1, 2, 3, 1]) for _ in range(3)]
    assert spec.proposals(repeating) == {}  # 3 sequences > the cutoff of 2
    proposals = spec.proposals(repeating[:2])
    # "... 3 1 2": the 3-gram "3 1 2" ended at 5 before; what followed it, then the loop goes on
    assert [p.tokens for p in proposals.values()] == [[3, 1, 2, 3]] * 2
    with_penalty = seq([1, 2, 1])
    with_penalty.params.presence_penalty = 0.5
    assert spec.proposals([with_penalty]) == {}

    draft, ngram = speculation.POLICY["draft"], speculation.POLICY["ngram"]
    state = SequenceSpeculation(k=4)
    skips = []
    for _ in range(7):  # nothing ever accepted: 4, 8, 16, ... plain steps between tries, at most 128
        state.record(state.k, 0, max_k=4, policy=draft)
        skips.append(state.skip_steps)
    assert skips == [4, 8, 16, 32, 64, 128, 128] and state.k == 1
    state.skip_steps = 0
    state.record(1, 1, max_k=4, policy=draft)  # accepted: try again at once, with one more token
    assert (state.skip_steps, state.k, state.misses) == (0, 2, 0)
    state.record(3, 1, max_k=4, policy=draft)  # 1 of 3: too few to pay for a draft's steps
    assert (state.skip_steps, state.k, state.misses) == (4, 2, 1)
    state.skip_steps = 0
    state.record(4, 1, max_k=8, policy=ngram)  # ngram: any kept draft pays; k = kept + 1
    assert (state.skip_steps, state.k, state.misses) == (0, 2, 0)
    state.record(2, 2, max_k=8, policy=ngram)  # all kept: k doubles, up to K
    state.record(4, 4, max_k=8, policy=ngram)
    state.record(8, 8, max_k=8, policy=ngram)
    assert state.k == 8
    skips = []
    for _ in range(6):  # two lost one-draft probes are free, then 1, 2, 4, 8 plain steps
        state.record(state.k, 0, max_k=8, policy=ngram)
        skips.append(state.skip_steps)
        state.skip_steps = 0
    assert skips == [0, 0, 1, 2, 4, 8] and state.k == 1


def test_ngram_proposals_continue_a_loop_past_the_end():
    """A suffix that occurred just before the end is a loop: the proposal goes on repeating it to k
    tokens (an overlapping copy), not only the one or two tokens before the end."""
    assert speculation.NgramIndex().propose([5, 1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]
    assert speculation.NgramIndex().propose([7, 3, 3, 3], 4) == [3, 3, 3, 3]
    assert speculation.NgramIndex().propose([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    assert speculation.NgramIndex().propose([1, 2, 3], 4) == []


# ---- bad input ----

def copy_run(run_dir, where, **config_changes):
    draft = where / "draft"
    shutil.copytree(run_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    for key, value in config_changes.items():
        section, field = key.split(".")
        config[section][field] = value
    (draft / "config.json").write_text(json.dumps(config))
    return draft


@pytest.mark.parametrize("case", ["unknown", "zero", "huge", "no-run", "untrained", "vocab", "tokenizer", "short"])
def test_bad_speculation_flags_are_one_line_errors(run_dir, tmp_path, case, capsys):
    from shardwise.cli.main import main

    draft = None
    if case == "vocab":
        draft = copy_run(run_dir, tmp_path, **{"model.vocab_size": 1024})
    elif case == "short":
        draft = copy_run(run_dir, tmp_path, **{"model.max_seq_len": 64})
    elif case == "untrained":
        draft = copy_run(run_dir, tmp_path)
        shutil.rmtree(draft / "checkpoints")
    elif case == "tokenizer":
        draft = copy_run(run_dir, tmp_path)
        tokenizer = json.loads((draft / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        vocab[next(iter(vocab))] = len(vocab) + 7  # one token's id moved: another tokenizer
        (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    flags, message = {
        "unknown": (["--speculate", "eagle"], "--speculate = 'eagle' is invalid: use ngram"),
        "zero": (["--speculate", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens = 0 is invalid"),
        "huge": (["--speculate", "ngram", "--num-speculative-tokens", "999"], "--num-speculative-tokens = 999 is inv"),
        "no-run": (["--speculate", f"draft:{tmp_path / 'none'}"], "is not a run directory"),
        "untrained": (["--speculate", f"draft:{draft}"], "has no checkpoint yet; train it"),
        "vocab": (["--speculate", f"draft:{draft}"], "the draft's vocabulary has 1024 tokens, the served run's 512"),
        "tokenizer": (["--speculate", f"draft:{draft}"], "the draft's tokenizer differs from the served run's"),
        "short": (["--speculate", f"draft:{draft}"], "whose max_seq_len (64) covers the served context (128)"),
    }[case]
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--run", str(run_dir), "--device", "cpu", "--max-new-tokens", "2", *flags])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="needs --speculate"):
        speculation_options(None, 3)


def test_an_encoder_decoder_refuses_speculation():
    from shardwise.infer.draft_run import check_draft_run

    with pytest.raises(ValueError, match=r"--speculate = 'ngram' is invalid for --run 't5run', an encoder-decoder"):
        check_draft_run(speculation_options("ngram", None), "t5run", model_config("t5-debug"), 64)


@pytest.mark.slow
@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_tensor_parallel_speculation_equals_one_process_plain_decoding(run_dir, speculate):
    """`generate --nproc 2 --speculate ngram|draft:RUN` (the leader proposes, a draft model unsplit on
    rank 0; both ranks verify) against one process without speculation. The run drafts for itself."""
    from shardwise.cli.main import build_parser
    from shardwise.infer.commands import generate_results

    command = ["generate", "--run", str(run_dir), "--prompt", PROMPTS[0], "--json", "--temperature", "0",
               "--max-new-tokens", "32", "--device", "cpu"]
    single = generate_results(build_parser().parse_args(command))[0]
    proposer = "ngram" if speculate == "ngram" else f"draft:{run_dir}"
    done = subprocess.run([sys.executable, "-m", "shardwise.cli.main", *command, "--speculate", proposer, "--nproc", "2",
                           "--parallel.tp", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["completion"] == single["completion"] and result["draft_tokens_accepted"] > 0, result


def test_a_draft_attends_the_prefix_that_the_prefix_cache_restored(run_dir):
    """The second prompt's shared prefix is copied into the target's slot from the prefix cache, not
    computed; the draft must compute it in its own cache. The run as its own draft then keeps every
    proposal, as it does without caching (a draft missing the prefix proposes from garbage)."""
    _, engine, tokenizer = open_engine(run_dir, device_name="cpu", max_batch=1, prefill_chunk=16,
                                       speculate=f"draft:{run_dir}")
    prefix = PROMPTS[0] + " get(self):\n        return self.name\n\n"
    first = generate_all(engine, [tokenizer.encode(prefix + "    def set(self").ids], GREEDY)[0]
    with torch.inference_mode():  # the one slot's draft columns no longer hold the first prompt's keys (as another slot's)
        for layer in engine.speculator.draft.runner.cache.keys + engine.speculator.draft.runner.cache.values:
            layer.zero_()
    second = generate_all(engine, [tokenizer.encode(prefix + "    def put(self").ids], GREEDY)[0]
    assert second.num_reused >= 32 and first.num_reused == 0
    state = second.speculation
    assert state.proposed > 0 and state.accepted == state.proposed
