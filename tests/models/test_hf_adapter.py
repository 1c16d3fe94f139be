"""HF interop: shardwise logits match `transformers` on converted weights, both directions.

fp32 on CPU, random tiny models (hidden 32, 2 layers, vocab 128, logits of magnitude ~2).
Tolerance: atol 1e-5. With HF's "sdpa" attention both sides run the same ops in the same order
and agree bitwise (observed 0.0); HF's "eager" attention differs by fp32 rounding (observed ~1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from shardwise.core.model import ModelConfig
from shardwise.models.llama.hf_adapter import (
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    model_from_hf,
    model_to_hf,
    save_hf_checkpoint,
    state_dict_from_hf,
    state_dict_to_hf,
)
from shardwise.models.llama.model import build_model
from shardwise.config.presets import model_config

from hf_helpers import max_abs_diff, perturb_norms_and_biases, random_hf_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
SEQ_LEN = 48  # long enough that Llama-3 scaling (original length 16) changes the logits
VOCAB = 128
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16,
)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def hf_config(arch: str, **overrides):
    config_class = getattr(transformers, {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[arch])
    fields = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        # The 4.x spelling of RoPE settings, which 5.x also accepts, keeps these tests running on both.
        initializer_range=0.1, rope_theta=10000.0, rope_scaling=None,
    )
    return config_class(**(fields | overrides))


# -- HF -> shardwise -------------------------------------------------------------------------

IMPORT_CASES = {
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-head-dim-16": ("llama", dict(head_dim=16)),
    "llama-gqa-llama3-rope": ("llama", dict(rope_scaling=LLAMA3_ROPE)),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-no-window": ("mistral", dict(sliding_window=None)),
}


@pytest.mark.parametrize("case", IMPORT_CASES)
def test_import_matches_transformers_logits(case, tmp_path):
    arch, overrides = IMPORT_CASES[case]
    hf_model = random_hf_model(hf_config(arch, **overrides))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL


def test_import_reads_a_sharded_transformers_checkpoint(tmp_path):
    hf_model = random_hf_model(hf_config("qwen2"))
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    assert max_abs_diff(model_from_hf(tmp_path), hf_model, tokens()) <= ATOL


def test_import_matches_eager_attention_too(tmp_path):
    hf_model = random_hf_model(hf_config("llama", num_key_value_heads=1), attn_implementation="eager")
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    assert max_abs_diff(model_from_hf(tmp_path), hf_model, tokens()) <= ATOL


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    """Guards the rope case above from passing vacuously (scaling that changes nothing here)."""
    hf_model = random_hf_model(hf_config("llama", rope_scaling=LLAMA3_ROPE))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    assert ours.cfg.rope_scaling_factor == 4.0 and ours.cfg.rope_original_max_seq_len == 16
    ours.cfg = dataclasses.replace(ours.cfg, rope_scaling_factor=0.0)
    assert max_abs_diff(ours, hf_model, tokens()) > 1e-3


# -- shardwise -> HF -------------------------------------------------------------------------


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB, max_seq_len=64, init_std=0.1,
    )
    return ModelConfig(**(fields | overrides))


EXPORT_CASES = {
    "llama-tied": ("llama", dict(tie_embeddings=True), 5 * 2**30),
    "llama-untied-llama3-rope-sharded": (
        "llama", dict(tie_embeddings=False, rope_scaling_factor=4.0, rope_original_max_seq_len=16), 20_000,
    ),
    "qwen2-qkv-bias": ("qwen2", dict(tie_embeddings=False, qkv_bias=True, n_kv_heads=1), 5 * 2**30),
    "mistral-head-dim-16-dim-40": ("mistral", dict(dim=40, n_heads=3, n_kv_heads=1, head_dim=16), 5 * 2**30),
}


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_matches_transformers_logits(case, tmp_path):
    arch, overrides, max_shard_bytes = EXPORT_CASES[case]
    ours = build_model(tiny_config(**overrides), seed=3)
    perturb_norms_and_biases(ours)
    model_to_hf(ours, tmp_path, arch=arch, max_shard_bytes=max_shard_bytes)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert type(hf_model).__name__ == config_to_hf(ours.cfg, arch)["architectures"][0]
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL


def test_sharded_save_loads_back_and_a_later_save_removes_stale_shards(tmp_path):
    cfg = tiny_config(tie_embeddings=False)
    sd = build_model(cfg, seed=4).state_dict()
    save_hf_checkpoint(cfg, sd, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    loaded_cfg, loaded = load_hf_checkpoint(tmp_path)
    assert loaded_cfg == dataclasses.replace(cfg, preset="demo") and loaded.keys() == sd.keys()
    assert all(torch.equal(loaded[name], sd[name]) for name in sd)

    save_hf_checkpoint(cfg, sd, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_tied_weights_are_written_once(tmp_path):
    cfg = tiny_config(tie_embeddings=True)
    save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()


# -- renames and configs ---------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False, qkv_bias=True)])
def test_state_dict_round_trip_is_identity(overrides):
    cfg = tiny_config(**overrides)
    sd = build_model(cfg).state_dict()
    hf_sd = state_dict_to_hf(sd, cfg)
    assert "model.layers.1.self_attn.q_proj.weight" in hf_sd and "model.layers.0.post_attention_layernorm.weight" in hf_sd
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys() and all(back[name] is sd[name] for name in sd)


def test_import_drops_tied_lm_head_and_rotary_buffers():
    cfg = tiny_config(tie_embeddings=True)
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"]
    hf_sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    assert "lm_head.weight" not in state_dict_from_hf(hf_sd, cfg)


def test_config_round_trip_and_4x_rope_spelling():
    cfg = tiny_config(rope_theta=500000.0, rope_scaling_factor=8.0, rope_original_max_seq_len=32, head_dim=16)
    hf = config_to_hf(cfg)
    assert hf["rope_scaling"]["rope_type"] == "llama3" and hf["rope_theta"] == 500000.0
    assert config_from_hf(hf) == dataclasses.replace(cfg, preset="demo")
    hf_5x = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    hf_5x["rope_parameters"] = dict(hf["rope_scaling"], rope_theta=500000.0)
    assert config_from_hf(hf_5x) == config_from_hf(hf)


def test_published_llama_3_2_1b_config_maps_to_our_preset():
    """config.json of meta-llama/Llama-3.2-1B (4.x spelling), as published."""
    hf = dict(
        architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=128000,
        eos_token_id=128001, head_dim=64, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
        intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False, model_type="llama",
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05,
        rope_scaling=dict(
            factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192, rope_type="llama3",
        ),
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True, vocab_size=128256,
    )
    assert config_from_hf(hf) == dataclasses.replace(model_config("llama3-1b"), preset="demo")


# -- bad input -------------------------------------------------------------------------------


def hf_dict(**overrides) -> dict:
    return config_to_hf(tiny_config()) | overrides


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model_type="gpt2"), "config.json model_type = 'gpt2' is invalid: use one of llama, mistral, qwen2"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type = 'yarn' is invalid"),
        (dict(rope_scaling=None, rope_parameters=dict(rope_type="linear", factor=2.0)), "rope_type = 'linear' is invalid"),
        (dict(attention_bias=True), "attention_bias = True is invalid: o_proj biases are unsupported"),
        (dict(mlp_bias=True), "mlp_bias = True is invalid"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu' is invalid"),
        (dict(hidden_size=None), "config.json hidden_size = None is invalid"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "llama3 rope_scaling low_freq_factor = None is invalid"),
    ],
)
def test_config_from_hf_refuses(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(hf_dict(**overrides))


def test_harmless_sliding_window_settings_are_accepted():
    assert config_from_hf(hf_dict(model_type="mistral", sliding_window=64)).max_seq_len == 64
    assert config_from_hf(hf_dict(model_type="qwen2", use_sliding_window=False, sliding_window=16)).qkv_bias


@pytest.mark.parametrize(
    "cfg_overrides, arch, message",
    [
        (dict(parallel_block=True), "llama", "model.parallel_block = True is invalid"),
        (dict(qkv_bias=True), "llama", 'exports as arch="qwen2"'),
        (dict(), "qwen2", 'export a model without them as arch="llama"'),
        (dict(), "gpt2", "arch = 'gpt2' is invalid"),
        (dict(dim=40, n_heads=3, n_kv_heads=1, head_dim=16), "llama", 'use arch="mistral"'),
    ],
)
def test_unexportable_configs_write_nothing(cfg_overrides, arch, message, tmp_path):
    cfg = tiny_config(**cfg_overrides)
    with pytest.raises(ValueError, match=message):
        save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path / "out", arch=arch)
    assert not (tmp_path / "out").exists()


def test_missing_and_unexpected_keys_are_listed():
    cfg = tiny_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    del hf_sd["model.layers.1.mlp.up_proj.weight"]
    hf_sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    hf_sd["model.vision_tower.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as error:
        state_dict_from_hf(hf_sd, cfg)
    message = str(error.value)
    assert "missing keys [model.layers.1.mlp.up_proj.weight]" in message
    assert "model.layers.0.self_attn.q_proj.bias" in message and "model.vision_tower.weight" in message
    with pytest.raises(ValueError, match=r"unexpected keys \[lm_head.weight\]"):
        state_dict_to_hf(build_model(cfg).state_dict() | {"lm_head.weight": torch.zeros(VOCAB, 32)}, cfg)


def test_wrong_shape_is_named():
    cfg = tiny_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    hf_sd["model.norm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match=r"model.norm.weight shape = \(16,\) is invalid: the model config expects \(32,\)"):
        state_dict_from_hf(hf_sd, cfg)


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_hf_checkpoint(tmp_path)


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_dict()))
    with pytest.raises(ValueError, match="needs model.safetensors or model.safetensors.index.json"):
        load_hf_checkpoint(tmp_path)


def test_missing_shard(tmp_path):
    cfg = tiny_config()
    save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path, max_shard_bytes=20_000)
    (tmp_path / "model-00001-of-00002.safetensors").unlink(missing_ok=True)
    next(tmp_path.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(ValueError, match="listed in model.safetensors.index.json but missing"):
        load_hf_checkpoint(tmp_path)


class _OpensAFile:
    """Unpickling this creates a file: proof that pickled code would have run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_pickled_bin_checkpoint_is_refused_unopened(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_dict()))
    marker = tmp_path / "unpickled"
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_OpensAFile(marker)))
    with pytest.raises(ValueError, match="only safetensors is loaded"):
        load_hf_checkpoint(tmp_path)
    assert not marker.exists()
