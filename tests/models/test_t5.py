"""The T5 family: HF `transformers` T5ForConditionalGeneration logits on converted weights (both
directions, v1.0 relu/tied and v1.1 gated-gelu/untied, with and without encoder padding), the
loss and greedy generation against HF's, the bucket function, the configs it refuses, the plan.

fp32 on CPU, random tiny models (d_model 32, 2 encoder / 3 decoder layers, 8 buckets with max
distance 20 so that 24 positions reach the logarithmic and the last buckets). Tolerance: atol 1e-5;
observed 0 (v1.0) and ~2e-6 (v1.1, whose GELU HF writes out as a formula) on logits of magnitude ~5."""

from __future__ import annotations

from types import SimpleNamespace

from shardwise.models.families import validate_model
from shardwise.core.model import ModelConfig

import pytest
import torch
from torch import nn

from shardwise.models.t5.hf_adapter import (load_hf_checkpoint, model_from_hf, model_to_hf, state_dict_from_hf,
    state_dict_to_hf)
from shardwise.models.t5.hf_config import config_from_hf, config_to_hf
from shardwise.models.common.relative_position import relative_position_bucket
from shardwise.models.t5.model import T5, build_model, shift_right
from shardwise.models.t5.plan import t5_plan

import hf_helpers
from hf_helpers import perturb_norms_and_biases

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
VOCAB, SRC_LEN, TGT_LEN = 96, 24, 20
V10 = dict(feed_forward_proj="relu", tie_word_embeddings=True)
V11 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def fields(**overrides) -> dict:
    return dict(family="t5", dim=32, n_layers=2, n_decoder_layers=3, n_heads=4, n_kv_heads=4, head_dim=8, ffn_dim=48,
                vocab_size=VOCAB, norm_eps=1e-6, tie_embeddings=True, init_std=1.0, relative_buckets=8,
                relative_max_distance=20, gated_mlp=False) | overrides


def tiny_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(preset="t5-debug", **fields(**overrides))
    validate_model(cfg)
    return cfg


def hf_config(**overrides):
    keys = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5Config(**(keys | overrides))


def random_hf_model(config, attn: str = "sdpa"):
    """A seeded HF T5ForConditionalGeneration, norms perturbed; untied, with a head of its own
    (5.x ties it to the table whatever the config says: only the scaling follows the config)."""
    model = hf_helpers.random_hf_model(config, attn, auto="AutoModelForSeq2SeqLM")
    if not config.scale_decoder_outputs:
        model.lm_head.weight = nn.Parameter(0.2 * torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(4)))
    return model


def ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def padding_mask() -> torch.Tensor:
    """Row 0 whole, row 1 with its last 9 positions padding."""
    mask = torch.ones(2, SRC_LEN, dtype=torch.long)
    mask[1, SRC_LEN - 9:] = 0
    return mask


@torch.no_grad()
def max_abs_diff(ours: T5, hf_model, mask=None) -> float:
    src, dec = ids((2, SRC_LEN), 1), ids((2, TGT_LEN), 2)
    ours_logits = ours.eval()(src, dec, padding_mask_BS=mask)
    hf_logits = hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits
    return (ours_logits - hf_logits).abs().max().item()


# -- HF <-> shardwise logits -----------------------------------------------------------------


@pytest.mark.parametrize("version, attn", [(V10, "sdpa"), (V11, "sdpa"), (V11, "eager")],
                         ids=["v1.0", "v1.1", "v1.1-eager"])
def test_import_matches_transformers_logits(version, attn, tmp_path):
    hf_model = random_hf_model(hf_config(**version), attn)
    hf_model.save_pretrained(tmp_path)
    ours = model_from_hf(tmp_path)
    assert ours.fields.gated_mlp == (version is V11) and ours.fields.tie_embeddings == (version is V10)
    assert ours.fields.n_decoder_layers == 3
    assert max_abs_diff(ours, hf_model) <= ATOL
    assert max_abs_diff(ours, hf_model, padding_mask()) <= ATOL


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False, gated_mlp=True)], ids=["v1.0", "v1.1"])
def test_export_matches_transformers_logits(overrides, tmp_path):
    ours = build_model(tiny_config(**overrides), seed=3)
    perturb_norms_and_biases(ours)
    model_to_hf(ours, tmp_path)
    hf_model, info = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert max_abs_diff(ours, hf_model.eval()) <= ATOL
    assert max_abs_diff(ours, hf_model, padding_mask()) <= ATOL
    loaded_cfg, _ = load_hf_checkpoint(tmp_path)
    assert {name: getattr(loaded_cfg, name) for name in fields()} == fields(**overrides)


@pytest.mark.parametrize("version", [V10, V11], ids=["v1.0", "v1.1"])
@torch.no_grad()
def test_loss_and_greedy_generation_match_transformers(version):
    hf_model = random_hf_model(hf_config(**version))
    ours = T5(tiny_config(**fields_of(version)))
    ours.load_state_dict(state_dict_from_hf(hf_model.state_dict(), ours.cfg))
    ours.eval()
    src, mask = ids((2, SRC_LEN), 1), padding_mask()
    labels = ids((2, TGT_LEN), 2)
    labels[0, -5:] = -100
    hf_loss = hf_model(input_ids=src, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours(src, targets_BT=labels, padding_mask_BS=mask), hf_loss, rtol=0, atol=ATOL)
    # use_cache=False: transformers 5.24 sizes the decoder's KV cache by num_layers (the encoder's
    # depth), IndexError with 3 decoder layers over 2 encoder layers
    hf_tokens = hf_model.generate(input_ids=src, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=1,
                                  use_cache=False)
    assert torch.equal(ours.greedy_generate(src, 8, eos_id=1, padding_mask_BS=mask), hf_tokens)


def fields_of(version) -> dict:
    return dict(tie_embeddings=version is V10, gated_mlp=version is V11)


class IdsText:
    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("version, compile",
                         [(V10, False), (V11, False), pytest.param(V10, True, marks=pytest.mark.slow)],
                         ids=["v1.0", "v1.1", "v1.0-compiled"])
@torch.no_grad()
def test_engine_decodes_as_transformers_generate(version, compile):
    """The serving engine's encoder-decoder path (the encoder once per prompt, the decoder over a KV
    cache with relative position biases, cross-attention over the stored encoder output; 5 prompts
    of different lengths through 2 slots, so sequences start while others decode) gives HF's greedy
    tokens for every prompt; compiled, the decode step is the same."""
    from shardwise.generation.engine import engine_for_model, generate_all
    from shardwise.generation.sampling import SamplingParams

    hf_model = random_hf_model(hf_config(**version))
    ours = T5(tiny_config(**fields_of(version), max_seq_len=64))
    ours.load_state_dict(state_dict_from_hf(hf_model.state_dict(), ours.cfg))
    ours.eval()
    prompts = [ids((1, n), seed).tolist()[0] for seed, n in enumerate((7, 19, 3, 12, 24))]
    engine = engine_for_model(ours, IdsText(), eos_id=1, max_batch=2, compile=compile)
    seqs = generate_all(engine, prompts, SamplingParams(max_tokens=10, temperature=0))
    for prompt, seq in zip(prompts, seqs):
        hf_tokens = hf_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False, num_beams=1,
                                      use_cache=False)[0, 1:].tolist()
        assert seq.output_ids == hf_tokens
    assert engine.stats["finished_length"] + engine.stats["finished_stop"] == len(prompts)


def test_shift_right_is_hfs():
    labels = ids((2, TGT_LEN), 2)
    labels[1, 3:] = -100
    hf_model = random_hf_model(hf_config(**V10))
    assert torch.equal(shift_right(labels), hf_model._shift_right(labels))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (6, 7)])
def test_bucket_function_is_hfs(bidirectional, num_buckets, max_distance):
    relative = torch.arange(-300, 301)[None, :] - torch.arange(0, 40)[:, None]
    hf = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    ours = relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)
    assert torch.equal(ours, hf)


# -- state dicts and config.json -------------------------------------------------------------


def test_state_dict_round_trip_is_exact():
    cfg = tiny_config(tie_embeddings=False, gated_mlp=True)
    sd = build_model(cfg, seed=1).state_dict()
    hf_sd = state_dict_to_hf(sd, cfg)
    assert hf_sd["decoder.block.2.layer.1.EncDecAttention.k.weight"] is sd["decoder_layers.2.cross_attn.k_proj.weight"]
    assert hf_sd["encoder.block.1.layer.1.DenseReluDense.wi_0.weight"] is sd["encoder_layers.1.mlp.gate_proj.weight"]
    assert "lm_head.weight" in hf_sd and "lm_head.weight" not in state_dict_to_hf(*tied_sd())
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[name], sd[name]) for name in sd)


def tied_sd():
    cfg = tiny_config()
    return build_model(cfg).state_dict(), cfg


def test_import_drops_what_hf_ignores_and_fills_a_tied_untied_head():
    sd, cfg = tied_sd()
    hf_sd = state_dict_to_hf(sd, cfg)
    hf_sd |= {"encoder.embed_tokens.weight": hf_sd["shared.weight"], "lm_head.weight": hf_sd["shared.weight"],
              "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": torch.ones(8, 4)}
    assert state_dict_from_hf(hf_sd, cfg).keys() == sd.keys()
    untied = tiny_config(tie_embeddings=False)
    hf_sd = state_dict_to_hf(build_model(untied).state_dict(), untied)
    del hf_sd["lm_head.weight"]
    assert state_dict_from_hf(hf_sd, untied)["lm_head.weight"] is hf_sd["shared.weight"]


def test_missing_and_unexpected_tensors_are_named():
    sd, cfg = tied_sd()
    hf_sd = state_dict_to_hf(sd, cfg)
    del hf_sd["decoder.block.2.layer.2.DenseReluDense.wo.weight"]
    hf_sd["encoder.block.1.layer.1.DenseReluDense.wi_0.weight"] = torch.ones(48, 32)
    with pytest.raises(ValueError, match=r"missing keys \[decoder.block.2.layer.2.DenseReluDense.wo.weight\], "
                                         r"unexpected keys \[encoder.block.1.layer.1.DenseReluDense.wi_0.weight\]"):
        state_dict_from_hf(hf_sd, cfg)


@pytest.mark.parametrize("key, value", [("feed_forward_proj", "gated-silu"), ("feed_forward_proj", "gelu"),
                                        ("is_encoder_decoder", False), ("decoder_start_token_id", 2),
                                        ("pad_token_id", 3), ("model_type", "mt5")])
def test_config_from_hf_refuses(key, value):
    hf = hf_config().to_dict() | {key: value}
    with pytest.raises(ValueError, match=f"^config.json {key} = {value!r} is invalid: "):
        config_from_hf(hf)


def test_config_round_trip_and_defaults():
    cfg = fields(tie_embeddings=False, gated_mlp=True, norm_eps=1e-5)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    assert config_from_hf(config_to_hf(SimpleNamespace(**cfg))) == cfg
    defaults = config_from_hf({"model_type": "t5"})
    assert defaults == config_from_hf(transformers.T5Config().to_dict())
    assert defaults | dict(n_decoder_layers=6, tie_embeddings=True, gated_mlp=False, init_std=1.0) == defaults
    assert config_from_hf({"model_type": "t5", "num_layers": 4})["n_decoder_layers"] == 4
    # the head: 4.x spells it with tie_word_embeddings, 5.x with scale_decoder_outputs
    assert not config_from_hf({"model_type": "t5", "tie_word_embeddings": False})["tie_embeddings"]
    five = {"model_type": "t5", "tie_word_embeddings": True, "scale_decoder_outputs": False}
    assert not config_from_hf(five)["tie_embeddings"]
    with pytest.raises(ValueError, match='arch = \'bert\' is invalid: a T5 model'):
        config_to_hf(cfg, "bert")


# -- init and the plan -----------------------------------------------------------------------


def test_init_is_deterministic_by_name_with_hfs_scales():
    cfg = tiny_config(tie_embeddings=False, gated_mlp=True)
    first, again = build_model(cfg, seed=5).state_dict(), build_model(cfg, seed=5).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert torch.equal(first["decoder_norm.weight"], torch.ones(32))
    for name, std in [("encoder_layers.0.attn.q_proj.weight", (32 * 8) ** -0.5), ("lm_head.weight", 1.0),
                      ("decoder_layers.1.mlp.down_proj.weight", 48 ** -0.5)]:
        assert first[name].std().item() == pytest.approx(std, rel=0.15)


def test_plan_names_the_model_modules():
    cfg = tiny_config(tie_embeddings=False, gated_mlp=True)
    plan, model = t5_plan(cfg), T5(cfg)
    modules = dict(model.named_modules())
    assert set(plan.tp_top) <= set(modules) and plan.blocks in modules
    decoder_block = set(dict(model.decoder_layers["0"].named_modules()))
    assert set(plan.tp_block(0)) == decoder_block - {""}
    assert hasattr(model.encoder_layers["0"].get_submodule(plan.attention), "core_attention")
    assert plan.tp_top["lm_head"] == "head" and t5_plan(tiny_config()).tp_top["lm_head"] == "tied_head"


@pytest.mark.parametrize("version", [V10, V11], ids=["v1.0", "v1.1"])
def test_flops_per_window_token_count_every_matmul_of_a_training_step(version):
    """The MFU's FLOPs (`model_counts.encoder_decoder_flops_per_token`, per token of the corrupted
    window, which the trainer's tokens/s counts) equal what torch's FLOP counter sees in forward +
    backward on a real span-corrupted batch: encoder blocks over the encoder's tokens, decoder blocks
    and head over the decoder's, cross-attention keys and values over the encoder's (SDPA's math
    kernel, so that every attention product is a counted matmul)."""
    import numpy as np
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.core.model_counts import encoder_decoder_flops_per_token
    from shardwise.models.t5.spec import SPEC as T5_SPEC
    from shardwise.data.objectives import SpanCorruption

    model = T5(tiny_config(**fields_of(version), max_seq_len=64))
    model.init_weights(0)
    seq_len, batch = 64, 3
    windows = ids((batch, seq_len + 1), 5)
    inputs, targets = SpanCorruption(tuple(range(2, 34)), 1, 0.15, 0)(windows, np.arange(batch))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(inputs, targets_BT=targets).backward()
    flops_per_token = encoder_decoder_flops_per_token(model.cfg, T5_SPEC, seq_len, norms=False)
    assert counter.get_total_flops() == flops_per_token * seq_len * batch
