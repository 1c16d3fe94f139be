"""The GPT-2 family: HF `transformers` GPT2LMHeadModel logits and greedy generations on converted
weights (both directions, and through `shardwise convert` and the generation engine), parameter
and FLOP counts, and the configs it refuses.

fp32 on CPU, random tiny models (hidden 32, 2 layers, vocab 320). Tolerance: atol 1e-5 on logits of
magnitude ~3; observed ~5e-7 (the same ops in the same order but for GELU's tanh, which HF's
"gelu_new" writes out and torch fuses).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from shardwise.config.presets import model_config
from shardwise.core.model import ModelConfig
from shardwise.config.presets import PRESETS
from shardwise.models.build import build_on_meta, plan_of, torch_family_of
from shardwise.models.families import FAMILY_NAMES, SPECS, counts_of, spec_of
from shardwise.models.gpt2.hf_adapter import (load_hf_checkpoint, model_from_hf, model_to_hf,
    save_hf_checkpoint, state_dict_from_hf, state_dict_to_hf)
from shardwise.models.gpt2.hf_config import config_from_hf, config_to_hf
from shardwise.models.gpt2.model import GPT2, build_model

from hf_helpers import max_abs_diff, perturb_norms_and_biases, random_hf_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
HF_NORMS = ("ln",)
"""HF GPT-2 names its LayerNorms ln_1, ln_2, ln_f: perturbed with the norms."""
VOCAB, SEQ_LEN = 320, 48
GPT2_124M_PARAMS = 124_439_808  # HF "gpt2": GPT2LMHeadModel.from_pretrained("gpt2").num_parameters()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def hf_config(**overrides):
    fields = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
                  layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    return transformers.GPT2Config(**(fields | overrides))


def tiny_config(**overrides) -> ModelConfig:
    return model_config("gpt2-debug", dim=32, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=VOCAB, max_seq_len=64,
                        init_std=0.2, **overrides)


# -- HF <-> shardwise logits -----------------------------------------------------------------


@pytest.mark.parametrize("overrides, attn", [
    (dict(), "sdpa"),
    (dict(tie_word_embeddings=False, n_inner=48), "sdpa"),
    (dict(activation_function="gelu_pytorch_tanh"), "eager"),
], ids=["tied", "untied-n-inner-48", "gelu-pytorch-tanh-eager"])
def test_import_matches_transformers_logits(overrides, attn, tmp_path):
    hf_model = random_hf_model(hf_config(**overrides), attn, also=HF_NORMS)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    assert ours.cfg.family == "gpt2" and ours.cfg.ffn_dim == overrides.get("n_inner", 4 * 32)
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL


@pytest.mark.parametrize("overrides, max_shard_bytes", [(dict(), 5 * 2**30), (dict(tie_embeddings=False), 20_000)],
                         ids=["tied", "untied-sharded"])
def test_export_matches_transformers_logits(overrides, max_shard_bytes, tmp_path):
    ours = build_model(tiny_config(**overrides), seed=3)
    perturb_norms_and_biases(ours, HF_NORMS)
    model_to_hf(ours, tmp_path, max_shard_bytes=max_shard_bytes)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf_model).__name__ == "GPT2LMHeadModel"
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL
    loaded_cfg, _ = load_hf_checkpoint(tmp_path)
    assert loaded_cfg == dataclasses.replace(ours.cfg, preset="gpt2")


def test_c_attn_is_transposed_and_split_into_q_k_v():
    cfg = tiny_config()
    sd = build_model(cfg, seed=1).state_dict()
    hf_sd = state_dict_to_hf(sd, cfg)
    c_attn = hf_sd["transformer.h.1.attn.c_attn.weight"]
    assert c_attn.shape == (32, 96)  # Conv1D: [in, out]
    assert torch.equal(c_attn[:, 32:64], sd["layers.1.attn.k_proj.weight"].t())
    assert torch.equal(hf_sd["transformer.h.1.attn.c_attn.bias"][64:], sd["layers.1.attn.v_proj.bias"])
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[name], sd[name]) for name in sd)


def test_import_reads_a_gpt2model_checkpoint_with_old_mask_buffers():
    """The hub's "gpt2" was saved from GPT2Model: no `transformer.` prefix, causal-mask buffers per layer."""
    cfg = tiny_config()
    sd = build_model(cfg).state_dict()
    hf_sd = {name.removeprefix("transformer."): t for name, t in state_dict_to_hf(sd, cfg).items()}
    hf_sd |= {"h.0.attn.bias": torch.ones(1, 1, 64, 64), "h.0.attn.masked_bias": torch.tensor(-1e4),
              "lm_head.weight": hf_sd["wte.weight"]}
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys()


# -- generation ------------------------------------------------------------------------------


def test_greedy_generation_through_convert_and_the_engine_equals_transformers(tmp_path):
    """`shardwise convert --from-hf`, then the engine `shardwise generate` opens (continuous batching,
    KV cache, chunked prefill) against HF generate, token for token; then `--to-hf --arch gpt2`."""
    from shardwise.convert import export_run_to_hf, import_hf_to_run
    from shardwise.data.tokenizer import save_tokenizer, train_tokenizer
    from shardwise.generation.engine import generate_all
    from shardwise.generation.sampling import SamplingParams
    from shardwise.infer.load import open_engine

    hf_model = random_hf_model(hf_config(), also=HF_NORMS)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    save_tokenizer(train_tokenizer(["def main():\n    return 0\n"] * 4, VOCAB), tmp_path / "hf" / "tokenizer.json")
    import_hf_to_run(tmp_path / "hf", tmp_path / "run")

    prompts = [[5, 17, 42, 7, 99], [3], list(range(100, 140))]
    _, engine, _ = open_engine(tmp_path / "run", device_name="cpu", max_batch=2, prefill_chunk=16)
    ours = [seq.output_ids for seq in generate_all(engine, prompts, SamplingParams(max_tokens=20, temperature=0))]
    for prompt, output in zip(prompts, ours):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        assert output == out[0, len(prompt):].tolist(), prompt
    assert len({tuple(o) for o in ours}) == len(prompts) and len(set(ours[0])) > 3  # varied, not constant

    export_run_to_hf(tmp_path / "run", tmp_path / "back", arch="gpt2")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(exported(tokens()).logits, hf_model(tokens()).logits)


# -- the model and its counts ----------------------------------------------------------------


@pytest.mark.parametrize("preset, overrides", [("gpt2-debug", {}), ("gpt2-debug", dict(tie_embeddings=False)),
                                               ("gpt2", {})])
def test_num_params_counts_the_built_model(preset, overrides):
    cfg = model_config(preset, **overrides)
    model = build_on_meta(cfg)
    assert isinstance(model, GPT2)
    counts = counts_of(cfg)
    assert sum(p.numel() for p in model.parameters()) == counts.num_params()
    positions = cfg.max_seq_len * cfg.dim
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim  # tied: counted once, as the head
    assert counts.num_params(embedding=False) == counts.num_params() - positions - table
    assert counts.flops_per_token(128) == 6 * counts.num_params(embedding=False) + 12 * cfg.n_layers * cfg.dim * 128
    if preset == "gpt2":
        assert counts.num_params() == GPT2_124M_PARAMS


def test_stage_costs_count_gpt2_blocks():
    cfg = model_config("gpt2-debug")
    blocks, first, last = plan_of(cfg).stage_costs(32)
    d, f = cfg.dim, cfg.ffn_dim
    block = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d
    assert blocks == [6.0 * block + 12 * d * 32] * cfg.n_layers
    assert (first, last) == (4.0 * d, 6.0 * cfg.vocab_size * d + 12 * d)


def test_families_are_those_the_config_accepts():
    assert tuple(SPECS) == FAMILY_NAMES
    assert spec_of("gpt2").name == "gpt2" and torch_family_of(model_config("gpt2-debug")).build is GPT2
    assert spec_of(model_config("debug").family) is SPECS["llama"]
    assert {PRESETS[name].get("family", "llama") for name in PRESETS} == set(FAMILY_NAMES)


def test_positions_per_row_equal_one_sequence_each():
    """[B, S] positions (the engine's decode: each row at its own place) index the table per row."""
    model = build_model(tiny_config(), seed=0).eval()
    ids = tokens()[:, :8]
    with torch.no_grad():
        shifted = model(ids, positions_S=torch.stack([torch.arange(8), torch.arange(5, 13)]))
        assert torch.allclose(shifted[0], model(ids[:1])[0], atol=1e-6)
        assert torch.allclose(shifted[1], model(ids[1:], positions_S=torch.arange(5, 13))[0], atol=1e-6)
        assert not torch.allclose(shifted[1], model(ids[1:])[0], atol=1e-3)


def test_chunked_loss_equals_the_loss_of_the_logits():
    model = build_model(tiny_config(), seed=0)
    ids, targets = tokens()[:, :-1], tokens()[:, 1:]
    logits = model(ids)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model(ids, targets_BS=targets), expected, rtol=1e-6, atol=1e-6)


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (dict(family="gpt3"), "model.family = 'gpt3' is invalid: use one of llama, gpt2, bert, vit"),
    (dict(n_kv_heads=2), "model.n_kv_heads = 2 is invalid: gpt2 attention is multi-head: use model.n_heads (4)"),
    (dict(n_experts=4), "model.n_experts = 4 is invalid: only model.family llama has mixture-of-experts layers: "
                        "leave it at 0 for gpt2"),
    (dict(rope_scaling_factor=8.0), "model.rope_scaling_factor = 8.0 is invalid: only model.family llama has rotary"),
    (dict(rope_theta=5e5), "model.rope_theta = 500000.0 is invalid: only model.family llama has rotary positions"),
    (dict(parallel_block=True), "model.parallel_block = True is invalid: only model.family llama has the PaLM-style"),
    (dict(qk_norm=True), "model.qk_norm = True is invalid: only model.family llama has q/k norms"),
    (dict(sliding_window=16), "model.sliding_window = 16 is invalid: only model.family llama has sliding-window"),
    (dict(head_dim=8), "model.head_dim = 8 is invalid: gpt2 heads are dim / n_heads wide: use 0"),
    (dict(image_size=8), "model.image_size = 8 is invalid: only model.family vit has image inputs: leave it at 0"),
    (dict(type_vocab_size=3), "model.type_vocab_size = 3 is invalid: only model.family bert has the token-type"),
])
def test_config_refuses_what_gpt2_cannot_be(overrides, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        model_config("gpt2-debug", **overrides)


def test_a_gpt2_head_may_be_odd_wide():
    """No RoPE, so no even head width needed (Llama's check is not GPT-2's)."""
    assert model_config("gpt2-debug", dim=60, n_heads=4, n_kv_heads=4).head_size == 15


@pytest.mark.parametrize("overrides, message", [
    (dict(activation_function="gelu"), "config.json activation_function = 'gelu' is invalid: shardwise's GPT-2 MLP"),
    (dict(scale_attn_weights=False), "config.json scale_attn_weights = False is invalid"),
    (dict(scale_attn_by_inverse_layer_idx=True), "config.json scale_attn_by_inverse_layer_idx = True is invalid"),
    (dict(add_cross_attention=True), "config.json add_cross_attention = True is invalid"),
])
def test_config_from_hf_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf_config(**overrides).to_dict())


def test_config_round_trip_and_defaults():
    cfg = tiny_config(tie_embeddings=False, norm_eps=1e-6)
    assert config_from_hf(config_to_hf(cfg)) == dataclasses.replace(cfg, preset="gpt2")
    published = config_from_hf({"model_type": "gpt2"})  # every key left out: GPT2Config's defaults
    assert dataclasses.replace(published, preset="gpt2") == model_config("gpt2", init_std=0.02)


def test_unexportable_arch_writes_nothing(tmp_path):
    cfg = tiny_config()
    with pytest.raises(ValueError, match='arch = \'llama\' is invalid: a GPT-2 model .* exports as arch="gpt2"'):
        save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path / "out", arch="llama")
    assert not (tmp_path / "out").exists()


def test_missing_unexpected_and_misshapen_tensors_are_named():
    cfg = tiny_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    del hf_sd["transformer.h.1.mlp.c_fc.bias"]
    hf_sd["transformer.h.2.ln_1.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match=r"missing keys \[transformer.h.1.mlp.c_fc.bias\], unexpected keys "
                                         r"\[transformer.h.2.ln_1.weight\]"):
        state_dict_from_hf(hf_sd, cfg)
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    hf_sd["transformer.h.0.attn.c_attn.weight"] = hf_sd["transformer.h.0.attn.c_attn.weight"].t()
    with pytest.raises(ValueError, match=r"c_attn.weight shape = \(96, 32\) is invalid: the model config expects "
                                         r"\(32, 96\)"):
        state_dict_from_hf(hf_sd, cfg)


def test_convert_picks_the_family_by_model_type(tmp_path):
    from shardwise.convert import family_of_hf

    for model_type, family in (("gpt2", "gpt2"), ("qwen2", "llama")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert family_of_hf(tmp_path).name == family
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="config.json model_type = 'gpt_neox' is invalid: use one of llama, .*gpt2"):
        family_of_hf(tmp_path)
