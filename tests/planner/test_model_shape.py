"""Model shapes: parameter counts against shardwise's ModelConfig and transformers' own models."""

import pytest

from shardwise.planner.model_shape import ModelShape, resolve_model

LLAMA3_8B_PARAMS = 8_030_261_248  # the published count of Llama 3.1 8B


def test_llama3_8b_parameter_count_is_exact():
    assert resolve_model("llama3-8b").num_params == LLAMA3_8B_PARAMS


def test_every_preset_matches_model_config():
    from shardwise.config.presets import model_config
    from shardwise.config.presets import PRESETS

    for name in PRESETS:
        assert resolve_model(name).num_params == model_config(name).num_params(), name


def test_shardwise_config_dict_overrides_a_preset():
    shape = resolve_model({"preset": "debug", "n_layers": 5})
    assert shape.n_layers == 5 and shape.dim == 64


def test_shardwise_moe_fields():
    shape = resolve_model({"preset": "debug", "n_experts": 4, "experts_per_token": 2, "moe_ffn_dim": 32,
                           "n_shared_experts": 1, "moe_layer_step": 2})
    assert shape.moe_layers == (1,)
    dense = resolve_model("debug")
    expert = 3 * 64 * 32
    moe_mlp = 4 * expert + 64 * 4 + 3 * 64 * 32  # experts, router, one shared expert of width moe_ffn_dim
    assert shape.num_params == dense.num_params - 3 * 64 * 160 + moe_mlp
    assert shape.num_active_params == shape.num_params - 2 * expert


HF_CASES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=32, shared_expert_intermediate_size=80, num_experts=6,
                                         num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, head_dim=16,
                                         tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict()),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_config_parameter_count_matches_transformers(case):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    kind, extra = HF_CASES[case]
    cfg = getattr(transformers, kind)(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    assert resolve_model(cfg.to_dict()).num_params == expected


def test_bad_model_names_the_field():
    with pytest.raises(ValueError, match=r"model.preset = 'nope' is invalid: use one of"):
        resolve_model({"preset": "nope"})
    with pytest.raises(ValueError, match=r"model = 'nope' is invalid"):
        resolve_model("nope")
    with pytest.raises(ValueError, match=r"model.n_kv_heads = 3 is invalid"):
        ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=3, ffn_dim=8, vocab_size=8)


def test_shardwise_moe_config_matches_model_config():
    from shardwise.config.presets import model_config

    fields = dict(n_experts=8, experts_per_token=2, n_shared_experts=1, moe_ffn_dim=96, moe_layer_step=2,
                  shared_expert_gate=True)
    cfg = model_config("demo", **fields)
    shape = resolve_model({"preset": "demo", **fields})
    assert shape.num_params == cfg.num_params()
    assert shape.moe_layers == tuple(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i))


@pytest.mark.parametrize("case", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_planner_and_converter_read_one_shape(case):
    """`shape_from_hf` and the converter's `config_from_hf` build on one reader (config/hf_config.py):
    for every config the converter takes, the planner's shape counts the same parameters."""
    transformers = pytest.importorskip("transformers")
    from shardwise.models.llama.hf_config import config_from_hf

    kind, extra = HF_CASES[case]
    if case == "qwen2_moe":  # what the converter refuses: dense layers, shared experts not n x expert width
        extra = {**extra, "mlp_only_layers": [], "shared_expert_intermediate_size": 64}
    hf = getattr(transformers, kind)(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, **extra).to_dict()
    cfg, shape = config_from_hf(hf), resolve_model(hf)
    assert (shape.num_params, shape.num_active_params) == (cfg.num_params(), cfg.num_active_params())
    assert (shape.n_experts, shape.qkv_bias, shape.tie_embeddings) == (cfg.n_experts, cfg.qkv_bias, cfg.tie_embeddings)
    if cfg.n_experts:
        assert shape.experts_per_token == cfg.experts_per_token
