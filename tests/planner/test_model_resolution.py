"""What the planner estimates: the ModelConfig `resolve_model` builds from each form it takes, its
parameter counts against published and transformers' own counts, and the name `plan` prints."""

import pytest

from shardwise.config.presets import PRESETS, model_config
from shardwise.models.families import counts_of
from shardwise.planner.model_resolution import resolve_model, resolve_model_and_name

LLAMA3_8B_PARAMS = 8_030_261_248  # the published count of Llama 3.1 8B
PUBLISHED_PARAMS = {
    "llama3-1b": 1_235_814_400,  # Llama 3.2 1B
    "llama3-3b": 3_212_749_824,  # Llama 3.2 3B
    "llama3-8b": LLAMA3_8B_PARAMS,
    "llama3-70b": 70_553_706_496,  # Llama 3.1 70B
    "mixtral-8x7b": 46_702_792_704,  # Mixtral-8x7B-v0.1
    "gpt2": 124_439_808,  # HF gpt2 (GPT2LMHeadModel, tied head)
    "bert-base": 109_514_298,  # bert-base-uncased as BertForMaskedLM
    "vit-base": 86_567_656,  # google/vit-base-patch16-224 (1,000 classes)
    "t5-small": 60_506_624,  # t5-small (T5ForConditionalGeneration)
}


def test_llama3_8b_parameter_count_is_exact():
    assert counts_of(resolve_model("llama3-8b")).num_params() == LLAMA3_8B_PARAMS


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_presets_count_their_published_parameters(name):
    assert counts_of(resolve_model(name)).num_params() == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_to_its_model_config(name):
    """The planner estimates the config `shardwise train` builds, and prints the preset's name."""
    assert resolve_model_and_name(name) == (model_config(name), name)
    assert resolve_model({"preset": name}) == model_config(name)


def test_shardwise_config_dict_overrides_a_preset():
    model, name = resolve_model_and_name({"preset": "debug", "n_layers": 5})
    assert (model.n_layers, model.dim, name) == (5, 64, "debug")
    assert resolve_model_and_name({"model": {"preset": "debug", "n_layers": 5}}) == (model, "debug")  # a run config


def test_shardwise_moe_fields():
    model = resolve_model({"preset": "debug", "n_experts": 4, "experts_per_token": 2, "moe_ffn_dim": 32,
                           "n_shared_experts": 1, "moe_layer_step": 2})
    assert [i for i in range(model.n_layers) if model.is_moe_layer(i)] == [1]
    dense = resolve_model("debug")
    expert = 3 * 64 * 32
    moe_mlp = 4 * expert + 64 * 4 + 3 * 64 * 32  # experts, router, one shared expert of width moe_ffn_dim
    counts = counts_of(model)
    assert counts.num_params() == counts_of(dense).num_params() - 3 * 64 * 160 + moe_mlp
    assert counts.num_active_params() == counts.num_params() - 2 * expert


def test_shardwise_moe_config_is_the_loaders():
    fields = dict(n_experts=8, experts_per_token=2, n_shared_experts=1, moe_ffn_dim=96, moe_layer_step=2,
                  shared_expert_gate=True)
    model = resolve_model({"preset": "demo", **fields})
    assert model == model_config("demo", **fields)
    assert [i for i in range(model.n_layers) if model.is_moe_layer(i)] == [1, 3]


def test_every_shape_field_without_a_preset():
    model, name = resolve_model_and_name({"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256,
                                          "vocab_size": 512})
    assert name == "custom"
    assert counts_of(model).num_params() == 361_088  # 2 x (65,536 + 98,304 + 256) + 128 + 512 x 128 (tied)


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
HF_CASES = {  # the HF config class, its model class, its keys
    "mixtral": ("MixtralConfig", "AutoModelForCausalLM", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "AutoModelForCausalLM",
                  dict(SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=80, num_experts=6,
                       num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])),
    "qwen3_moe": ("Qwen3MoeConfig", "AutoModelForCausalLM",
                  dict(SMALL, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, head_dim=16,
                       tie_word_embeddings=True)),
    "llama": ("LlamaConfig", "AutoModelForCausalLM", dict(SMALL, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "AutoModelForCausalLM", dict(SMALL)),
    "qwen2": ("Qwen2Config", "AutoModelForCausalLM", dict(SMALL)),
    "qwen3": ("Qwen3Config", "AutoModelForCausalLM", dict(SMALL)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128, vocab_size=256, max_position_embeddings=128)),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=128, image_size=32, patch_size=8,
                                                           num_labels=10)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                          num_decoder_layers=3, num_heads=4, vocab_size=256)),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_config_parameter_count_matches_transformers(case):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config_class, model_class, keys = HF_CASES[case]
    cfg = getattr(transformers, config_class)(**keys)
    model_class = getattr(transformers, model_class)
    with torch.device("meta"):
        model = model_class.from_config(cfg) if model_class is transformers.AutoModelForCausalLM else model_class(cfg)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    hf = {**cfg.to_dict(), "_name_or_path": f"org/{case}"}
    resolved, name = resolve_model_and_name(hf)
    assert (counts_of(resolved).num_params(), name) == (expected, f"org/{case}")


LENIENT = {  # what only the planner reads, and the counts it made before it read ModelConfig (at 2683a84)
    "llama, GELU, o_proj and MLP biases": (dict(SMALL, model_type="llama", hidden_act="gelu", attention_bias=True,
                                                mlp_bias=True), 140_352),
    "qwen2, a window on some layers only": (dict(SMALL, model_type="qwen2", use_sliding_window=True, sliding_window=16,
                                                 max_window_layers=2), 140_352),
    "a type no family converts": (dict(SMALL, model_type="phi3", num_key_value_heads=None), 156_224),
    "no model_type": (dict(SMALL, num_key_value_heads=None), 156_224),
    "qwen3_moe, dense layers beyond the model": (dict(SMALL, model_type="qwen3_moe", num_experts=8,
                                                      moe_intermediate_size=32, num_experts_per_tok=2,
                                                      mlp_only_layers=[0, 9]), 233_664),
}


@pytest.mark.parametrize("case", sorted(LENIENT))
def test_the_planner_reads_decoders_the_converter_refuses(case):
    hf, params = LENIENT[case]
    assert counts_of(resolve_model(hf)).num_params() == params


def test_dense_mlp_only_layers_and_an_odd_shared_width():
    model = resolve_model(dict(HF_CASES["qwen2_moe"][2], model_type="qwen2_moe"))
    assert [i for i in range(model.n_layers) if model.is_moe_layer(i)] == [1]  # step 2, less mlp_only_layers [3]
    assert model.shared_ffn_dim == 80 and model.shared_expert_gate  # one shared expert, not 80 / 32 of them


def test_hf_names_fall_back_to_the_model_type():
    assert resolve_model_and_name(dict(SMALL, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=32))[1] \
        == "qwen3_moe"
    assert resolve_model_and_name(dict(SMALL))[1] == "custom"


def test_bad_model_names_the_field():
    with pytest.raises(ValueError, match=r"model.preset = 'nope' is invalid: use one of"):
        resolve_model({"preset": "nope"})
    with pytest.raises(ValueError, match=r"model = 'nope' is invalid"):
        resolve_model("nope")
    with pytest.raises(ValueError, match=r"model.n_kv_heads = 3 is invalid"):
        resolve_model({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 3, "ffn_dim": 8, "vocab_size": 8})
    with pytest.raises(ValueError, match=r"model.ffn_dim is missing: give it, or a preset"):
        resolve_model({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 8})
    with pytest.raises(ValueError, match=r"model.n_layer is not a config field; did you mean 'model.n_layers'"):
        resolve_model({"preset": "debug", "n_layer": 3})


@pytest.mark.parametrize("case", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_planner_and_converter_read_one_shape(case):
    """The planner's reader (`estimate_config_from_hf`) and the converter's `config_from_hf` build on
    one reader (models/llama/hf_shape.py): for every config the converter takes, they count the same."""
    transformers = pytest.importorskip("transformers")
    from shardwise.models.llama.hf_config import config_from_hf

    config_class, _, keys = HF_CASES[case]
    if case == "qwen2_moe":  # what the converter refuses: dense layers, shared experts not n x expert width
        keys = {**keys, "mlp_only_layers": [], "shared_expert_intermediate_size": 64}
    hf = getattr(transformers, config_class)(**keys).to_dict()
    cfg, model = config_from_hf(hf), resolve_model(hf)
    planned, converted = counts_of(model), counts_of(cfg)
    assert (planned.num_params(), planned.num_active_params()) == (converted.num_params(), converted.num_active_params())
    assert (model.n_experts, model.qkv_bias, model.tie_embeddings) == (cfg.n_experts, cfg.qkv_bias, cfg.tie_embeddings)
    assert model.experts_per_token == cfg.experts_per_token
