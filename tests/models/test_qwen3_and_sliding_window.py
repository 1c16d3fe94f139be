"""Qwen3 (per-head q/k norms) and sliding-window attention (Mistral, Qwen2, Qwen3) against HF
`transformers`: logits both ways through run directories, greedy generation through the engine,
the window's exact boundary, and the configs that do not convert.

fp32 on CPU, random tiny models (hidden 32, 2 layers, vocab 128), sequences of 48 tokens and a
window of 8, so most queries lose keys to the window. Tolerance: atol 1e-5, as in
test_hf_adapter.py (HF's "sdpa" path runs the same ops as ours; "eager" differs by fp32 rounding).
"""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.models.families import counts_of, validate_model
from shardwise.models.llama.spec import SPEC as LLAMA
import torch

from shardwise.core.model import ModelConfig
from shardwise.generation.engine import Engine, generate_all
from shardwise.generation.runner import ModelRunner
from shardwise.generation.sampling import SamplingParams
from shardwise.models.common.attention import causal_attention
from shardwise.models.llama.hf_adapter import (
    config_from_hf,
    config_to_hf,
    model_from_hf,
    model_to_hf,
    save_hf_checkpoint,
)
from shardwise.models.llama.model import Llama, build_model

from hf_helpers import max_abs_diff, perturb_norms_and_biases, random_hf_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
SEQ_LEN = 48
VOCAB = 128
WINDOW = 8
CONFIG_CLASSES = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def hf_config(arch: str, **overrides):
    fields = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.1, rope_theta=10000.0, rope_scaling=None,
        # No end token: generation runs its full length on both sides.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if arch == "qwen3":
        fields["head_dim"] = 16  # Qwen3 sets it apart from hidden_size / heads (default 128)
    return getattr(transformers, CONFIG_CLASSES[arch])(**(fields | overrides))


QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)


def write_tokenizer(path) -> None:
    """A word-level tokenizer.json over the test vocabulary: what `import_hf_to_run` copies along."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))


def without_window(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.layers.values():
        block.attn.sliding_window = 0
    return model


# -- HF -> run directory -> HF ---------------------------------------------------------------

ROUND_TRIP_CASES = {
    "qwen3-untied": ("qwen3", dict()),
    "qwen3-tied-window": ("qwen3", dict(tie_word_embeddings=True, **QWEN_WINDOW)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window": ("qwen2", dict(QWEN_WINDOW)),
}


@pytest.mark.parametrize("case", ROUND_TRIP_CASES)
def test_transformers_to_run_to_transformers_keeps_the_logits(case, tmp_path):
    from shardwise.convert import export_run_to_hf, import_hf_to_run
    from shardwise.infer.load import load_run

    arch, overrides = ROUND_TRIP_CASES[case]
    hf_model = random_hf_model(hf_config(arch, **overrides))
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_tokenizer(tmp_path / "hf" / "tokenizer.json")
    run_dir = import_hf_to_run(tmp_path / "hf", tmp_path / "run")
    cfg, ours, _ = load_run(run_dir)
    assert cfg.model.qk_norm == (arch == "qwen3")
    assert cfg.model.sliding_window == (WINDOW if "window" in case else 0)
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL

    export_run_to_hf(run_dir, tmp_path / "hf-again", arch=arch)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-again", attn_implementation="sdpa").eval()
    assert type(again) is type(hf_model)
    assert max_abs_diff(ours, again, tokens()) <= ATOL
    if "window" in case:  # the window shapes these logits: a converter that dropped it would fail above
        assert max_abs_diff(without_window(ours), hf_model, tokens()) > 1e-3


def test_window_matches_transformers_eager_attention_too(tmp_path):
    hf_model = random_hf_model(hf_config("qwen3", **QWEN_WINDOW), attn_implementation="eager")
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    assert max_abs_diff(model_from_hf(tmp_path), hf_model, tokens()) <= ATOL


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB, max_seq_len=64, init_std=0.1,
    )
    return ModelConfig(**(fields | overrides))


EXPORT_CASES = {
    "qwen3-window-untied": ("qwen3", dict(qk_norm=True, head_dim=16, sliding_window=WINDOW, tie_embeddings=False)),
    "qwen3-dim-40": ("qwen3", dict(qk_norm=True, dim=40, n_heads=3, n_kv_heads=1, head_dim=16)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window": ("qwen2", dict(qkv_bias=True, sliding_window=WINDOW, tie_embeddings=False)),
}


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_matches_transformers_logits(case, tmp_path):
    arch, overrides = EXPORT_CASES[case]
    ours = build_model(tiny_config(**overrides), seed=3)
    perturb_norms_and_biases(ours)
    model_to_hf(ours, tmp_path, arch=arch)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert type(hf_model).__name__ == config_to_hf(ours.cfg, arch)["architectures"][0]
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL


def test_parameter_count_matches_transformers_and_the_planner():
    """Qwen3's q/k norms in every count: our model, ModelConfig.num_params, the planner's reader, HF."""
    from shardwise.planner.model_resolution import resolve_model

    config = hf_config("qwen3")
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    cfg = config_from_hf(config.to_dict())
    with torch.device("meta"):
        ours = sum(p.numel() for p in Llama(cfg).parameters())
    assert ours == counts_of(cfg).num_params() == counts_of(resolve_model(config.to_dict())).num_params() == hf_count


# -- generation ------------------------------------------------------------------------------


class DigitsTokenizer:
    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


PROMPTS = [[5, 17, 42, 7, 99, 3], list(range(1, 14)), [11] * 9]
"""Shorter than the window, longer than it, one past it; each with 24 new tokens crosses it."""


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_greedy_generation_with_a_window_equals_transformers_generate(arch, tmp_path):
    overrides = dict(sliding_window=WINDOW) if arch == "mistral" else QWEN_WINDOW
    hf_model = random_hf_model(hf_config(arch, **overrides))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path).eval()
    greedy = SamplingParams(max_tokens=24, temperature=0)
    # Prefill chunks of 4 (not a divisor of the window) beside running decodes, 2 slots for 3 prompts.
    engine = Engine(ModelRunner(ours, num_slots=2), DigitsTokenizer(), eos_id=None, prefill_chunk=4)
    outputs = [seq.output_ids for seq in generate_all(engine, PROMPTS, greedy)]
    for prompt, output in zip(PROMPTS, outputs):
        ids = torch.tensor([prompt])
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert output == expected[0, len(prompt):].tolist(), prompt
    full = Engine(ModelRunner(without_window(ours), num_slots=2), DigitsTokenizer(), eos_id=None, prefill_chunk=4)
    assert [seq.output_ids for seq in generate_all(full, PROMPTS, greedy)] != outputs  # the window mattered


def test_engine_logits_with_a_window_equal_the_full_forward():
    """Prefill chunks and decode steps through the cache's windowed mask give the logits of one
    forward over the whole text."""
    model = build_model(tiny_config(sliding_window=5, qk_norm=True), seed=1).eval()
    engine = Engine(ModelRunner(model, num_slots=2), DigitsTokenizer(), eos_id=None, prefill_chunk=3)
    got = []
    prompt = list(range(3, 15))
    seq = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=1), got.append)
    engine.run_until_done()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + seq.output_ids]))[0], dim=-1)
    for i, out in enumerate(got):
        position = len(prompt) - 1 + i
        assert out.token.logprob == pytest.approx(float(logprobs[position, out.token.token_id]), abs=1e-4)


# -- the window's boundary (off by one either way fails) ---------------------------------------


def manual_window_attention(q, k, v, window: int) -> torch.Tensor:
    """softmax over keys j with i - window < j <= i, written out: the reference convention."""
    seq_len, scale = q.shape[2], q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_causal_attention_window_is_exact():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 20, 8, generator=gen) for _ in range(3))
    ours = causal_attention(q, k, v, window=WINDOW)
    torch.testing.assert_close(ours, manual_window_attention(q, k, v, WINDOW), rtol=0, atol=1e-6)
    for near_miss in (WINDOW - 1, WINDOW + 1):
        assert (ours - manual_window_attention(q, k, v, near_miss)).abs().max() > 1e-3
    torch.testing.assert_close(causal_attention(q, k, v, window=20), causal_attention(q, k, v), rtol=0, atol=0)


def test_one_layer_sees_exactly_window_tokens_back():
    """In one layer the logits at i depend on the tokens at i - window + 1 .. i, not at i - window."""
    model = build_model(tiny_config(n_layers=1, sliding_window=WINDOW), seed=5).eval()
    ids, i = tokens()[:1], 30
    with torch.no_grad():
        base = model(ids)[0, i]
        for position, changes in ((i - WINDOW, False), (i - WINDOW + 1, True)):
            edited = ids.clone()
            edited[0, position] = (edited[0, position] + 1) % VOCAB
            moved = (model(edited)[0, i] - base).abs().max().item()
            assert (moved > 1e-4) == changes, (position, moved)


# -- configs ----------------------------------------------------------------------------------


def hf_dict(model_type: str, **overrides) -> dict:
    cfg = tiny_config(qk_norm=model_type == "qwen3", qkv_bias=model_type == "qwen2")
    return config_to_hf(cfg, model_type) | overrides


def test_config_reading_follows_transformers_defaults():
    no_head_dim = {k: v for k, v in hf_dict("qwen3").items() if k != "head_dim"}
    assert config_from_hf(no_head_dim).head_dim == 128  # Qwen3Config's default, not hidden_size / heads
    no_window_key = {k: v for k, v in hf_dict("mistral", max_position_embeddings=8192).items() if k != "sliding_window"}
    assert config_from_hf(no_window_key).sliding_window == 4096  # MistralConfig's default
    # A window of at least the context cuts nothing: full attention, which every layout runs.
    assert config_from_hf(hf_dict("mistral", sliding_window=64)).sliding_window == 0
    # Qwen2 windows only the layers from max_window_layers (default 28) on: none of these 2.
    qwen2 = {k: v for k, v in hf_dict("qwen2", use_sliding_window=True, sliding_window=16).items()
             if k != "max_window_layers"}
    assert config_from_hf(qwen2).sliding_window == 0
    assert config_from_hf(hf_dict("qwen2", use_sliding_window=False, sliding_window=16)).sliding_window == 0
    qwen3 = hf_dict("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert config_from_hf(qwen3).sliding_window == 16


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
         "config.json max_window_layers = 1 is invalid: shardwise applies one sliding window to every layer"),
        ("qwen3", dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
         "config.json layer_types = ['full_attention', 'sliding_attention'] is invalid: shardwise applies one"),
        ("qwen3", dict(attention_bias=True), "config.json attention_bias = True is invalid"),
        ("qwen3", dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type = 'yarn' is invalid"),
    ],
)
def test_config_from_hf_refuses(model_type, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        config_from_hf(hf_dict(model_type, **overrides))


@pytest.mark.parametrize(
    "cfg_overrides, arch, message",
    [
        (dict(qk_norm=True), "llama", 'a model with q/k norms (model.qk_norm) exports as arch="qwen3"'),
        (dict(qk_norm=True), "mistral", 'exports as arch="qwen3"'),
        (dict(), "qwen3", 'HF Qwen3 always has q/k norms: export a model without them as arch="mistral"'),
        (dict(qk_norm=True, qkv_bias=True), "qwen3", "model.qkv_bias = True is invalid: no HF architecture"),
        (dict(sliding_window=WINDOW), "llama",
         'HF LlamaForCausalLM has no sliding window on every layer (model.sliding_window = 8): use arch="mistral"'),
    ],
)
def test_unexportable_configs_write_nothing(cfg_overrides, arch, message, tmp_path):
    cfg = tiny_config(**cfg_overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path / "out", arch=arch)
    assert not (tmp_path / "out").exists()


def test_config_round_trip():
    for arch, overrides in [("qwen3", dict(qk_norm=True, head_dim=16, sliding_window=WINDOW)),
                            ("mistral", dict(sliding_window=WINDOW)), ("qwen2", dict(qkv_bias=True, sliding_window=3))]:
        cfg = tiny_config(**overrides)
        assert config_from_hf(config_to_hf(cfg, arch)) == dataclasses.replace(cfg, preset="demo"), arch


def test_bad_window_and_ring_attention_with_a_window_are_refused():
    from shardwise.core.layout_checks import check_context_parallel
    from shardwise.config.loader import load_config

    with pytest.raises(ValueError, match=r"model.sliding_window = -1 is invalid: use 0 \(full causal attention\)"):
        validate_model(tiny_config(sliding_window=-1))
    overrides = {"model.preset": "debug", "data.vocab_size": 512, "model.sliding_window": WINDOW, "parallel.cp": 2,
                 "train.seq_len": 32}
    with pytest.raises(ValueError, match=r"parallel.cp_mode = 'ring' is invalid: ring attention has no sliding window "
                                         r"\(model.sliding_window = 8\) yet: use parallel.cp_mode = \"alltoall\""):
        check_context_parallel(load_config(overrides=overrides), LLAMA, cp=2, tp=1)
    check_context_parallel(load_config(overrides=overrides | {"parallel.cp_mode": "alltoall"}), LLAMA, cp=2, tp=1)
