"""HF interop of mixture-of-experts models: Mixtral and Qwen2-MoE logits match `transformers`,
both directions (fp32, CPU, tiny random models; atol 1e-5 as in test_hf_adapter.py: the expert
sums run in a different order than HF's loop over experts, ~1e-7 apart)."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.core.model import ModelConfig
from shardwise.models.llama.hf_adapter import (
    config_from_hf,
    config_to_hf,
    model_from_hf,
    model_to_hf,
    save_hf_checkpoint,
    state_dict_from_hf,
    state_dict_to_hf,
)
from shardwise.models.llama.model import build_model

from hf_helpers import max_abs_diff, perturb_norms_and_biases, random_hf_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
ROUTERS = ("gate", "router")
"""Perturbed too: HF initialises routers to zero, which would hide swapped tensors."""
VOCAB = 128
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
              rope_theta=10000.0, rope_scaling=None)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def hf_moe_config(arch: str, **overrides):
    if arch == "mixtral":
        fields = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
        return transformers.MixtralConfig(**(COMMON | fields | overrides))
    fields = dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=4,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                  use_sliding_window=False)
    return transformers.Qwen2MoeConfig(**(COMMON | fields | overrides))


IMPORT_CASES = {
    "mixtral-top2": ("mixtral", dict()),
    "mixtral-top1": ("mixtral", dict(num_experts_per_tok=1)),
    "qwen2moe-shared-unnormalised": ("qwen2_moe", dict()),
    "qwen2moe-normalised-every-2nd-layer": ("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2)),
}


@pytest.mark.parametrize("case", IMPORT_CASES)
def test_import_matches_transformers_logits(case, tmp_path):
    arch, overrides = IMPORT_CASES[case]
    hf_model = random_hf_model(hf_moe_config(arch, **overrides), also=ROUTERS)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    assert ours.cfg.n_experts == 4
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL


def test_routing_normalisation_matters(tmp_path):
    """Guards the qwen2_moe cases from passing vacuously: renormalising top-k changes the logits."""
    hf_model = random_hf_model(hf_moe_config("qwen2_moe"), also=ROUTERS)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    for block in ours.layers.values():
        block.mlp.router.norm_topk = True
    assert max_abs_diff(ours, hf_model, tokens()) > 1e-3


def tiny_moe_config(**overrides) -> ModelConfig:
    fields = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=VOCAB, max_seq_len=64,
                  init_std=0.1, tie_embeddings=False, n_experts=4, experts_per_token=2)
    return ModelConfig(**(fields | overrides))


EXPORT_CASES = {
    "mixtral": ("mixtral", dict()),
    "qwen2moe": ("qwen2_moe", dict(qkv_bias=True, n_shared_experts=2, shared_expert_gate=True, moe_ffn_dim=24,
                                   router_norm_topk=False, moe_layer_step=2)),
}


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_matches_transformers_logits(case, tmp_path):
    arch, overrides = EXPORT_CASES[case]
    ours = build_model(tiny_moe_config(**overrides), seed=3)
    perturb_norms_and_biases(ours, ROUTERS)
    model_to_hf(ours, tmp_path, arch=arch)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert type(hf_model).__name__ == config_to_hf(ours.cfg, arch)["architectures"][0]
    assert max_abs_diff(ours, hf_model, tokens()) <= ATOL
    # And back: the written files import to the same config and weights.
    again = model_from_hf(tmp_path)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_state_dict_round_trip_names():
    cfg = tiny_moe_config(qkv_bias=True, n_shared_experts=1, shared_expert_gate=True)
    sd = build_model(cfg).state_dict()
    hf_sd = state_dict_to_hf(sd, cfg, "qwen2_moe")
    assert hf_sd["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (32, 48)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in hf_sd and "model.layers.0.mlp.gate.weight" in hf_sd
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    mixtral = tiny_moe_config()
    names = state_dict_to_hf(build_model(mixtral).state_dict(), mixtral, "mixtral")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_missing_expert_is_reported():
    cfg = tiny_moe_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg, "mixtral")
    del hf_sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(ValueError, match=r"missing keys \[model.layers.1.mlp.experts.up_proj\]"):
        state_dict_from_hf(hf_sd, cfg)


@pytest.mark.parametrize(
    "overrides, arch, message",
    [
        (dict(n_shared_experts=1), "mixtral", "model.n_shared_experts = 1 is invalid: HF Mixtral needs 0"),
        (dict(router_score="sigmoid"), "mixtral", "model.router_score = 'sigmoid' is invalid"),
        (dict(), "qwen2_moe", "HF Qwen2-MoE always has a gated shared expert"),
        (dict(), "llama", "a mixture-of-experts model exports as mixtral or qwen2_moe"),
        (dict(n_experts=0), "mixtral", "the model has no experts"),
    ],
)
def test_unexportable_moe_configs_write_nothing(overrides, arch, message, tmp_path):
    cfg = tiny_moe_config(**overrides)
    with pytest.raises(ValueError, match=message):
        save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path / "out", arch=arch)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise = 0.1 is invalid"),
        (dict(model_type="qwen2_moe", mlp_only_layers=[0]), r"mlp_only_layers = \[0\] is invalid"),
        (dict(model_type="qwen2_moe", shared_expert_intermediate_size=30, moe_intermediate_size=24),
         "shared_expert_intermediate_size = 30 is invalid"),
    ],
)
def test_config_from_hf_refuses(overrides, message):
    hf = json.loads(json.dumps(config_to_hf(tiny_moe_config(), "mixtral"))) | overrides
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)
