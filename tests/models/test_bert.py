"""The BERT family: HF `transformers` BertForMaskedLM logits on converted weights (both directions,
with and without padding), the checkpoint spellings it reads, the configs it refuses, and what
makes it BERT (bidirectional attention, the masked-LM loss, init by name, the pipeline cut).

fp32 on CPU, random tiny models (hidden 32, 2 layers, vocab 320). Tolerance: atol 1e-5 on logits of
magnitude ~5; observed 0 against HF's sdpa attention (the same ops in the same order) and ~3e-6
against its eager attention (matmul and softmax written out)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardwise.config.presets import model_config
from shardwise.models.families import counts_of
from shardwise.models.bert.hf_adapter import (load_hf_checkpoint, model_from_hf, model_to_hf,
    save_hf_checkpoint, state_dict_from_hf, state_dict_to_hf)
from shardwise.models.bert.hf_config import config_from_hf, config_to_hf
from shardwise.models.bert.model import Bert, build_model
from shardwise.models.bert.plan import bert_plan

import hf_helpers
from hf_helpers import perturb_norms_and_biases

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
HF_NORMS = ("LayerNorm",)
"""HF BERT's LayerNorms are named `LayerNorm`: perturbed with the biases."""
VOCAB, SEQ_LEN = 320, 24


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def token_types() -> torch.Tensor:
    return torch.randint(0, 2, (2, SEQ_LEN), generator=torch.Generator().manual_seed(7))


def padding_mask() -> torch.Tensor:
    """Row 0 whole, row 1 with its last 9 positions padding."""
    mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    mask[1, SEQ_LEN - 9:] = 0
    return mask


def hf_config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=True)
    return transformers.BertConfig(**(fields | overrides))


def tiny_config(**overrides):
    return model_config("bert-debug", dim=32, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=VOCAB, max_seq_len=64,
                        init_std=0.2, **overrides)


def random_hf_model(config, attn_implementation: str = "sdpa"):
    """A seeded HF BertForMaskedLM, norms and biases perturbed, in eval mode."""
    model = hf_helpers.random_hf_model(config, attn_implementation, also=HF_NORMS, auto="AutoModelForMaskedLM")
    assert type(model).__name__ == "BertForMaskedLM"
    return model


@torch.no_grad()
def max_abs_diff(ours: Bert, hf_model, *, mask=None, types=None) -> float:
    """The largest logit gap between ours and HF's on `tokens()`, over the real (non-padding) positions."""
    ours_logits = ours.eval()(tokens(), padding_mask_BS=mask, token_types_BS=types)
    hf_logits = hf_model(tokens(), attention_mask=mask, token_type_ids=types).logits
    real = torch.ones(2, SEQ_LEN, dtype=torch.bool) if mask is None else mask.bool()
    return (ours_logits - hf_logits)[real].abs().max().item()


# -- HF <-> shardwise logits -----------------------------------------------------------------


@pytest.mark.parametrize("overrides, attn", [
    (dict(), "sdpa"),
    (dict(tie_word_embeddings=False, intermediate_size=48), "sdpa"),
    (dict(type_vocab_size=3), "eager"),
], ids=["tied", "untied-intermediate-48", "3-types-eager"])
def test_import_matches_transformers_logits(overrides, attn, tmp_path):
    hf_model = random_hf_model(hf_config(**overrides), attn)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    assert ours.cfg.family == "bert" and ours.cfg.ffn_dim == overrides.get("intermediate_size", 64)
    assert max_abs_diff(ours, hf_model) <= ATOL
    assert max_abs_diff(ours, hf_model, mask=padding_mask(), types=token_types()) <= ATOL


@pytest.mark.parametrize("overrides, max_shard_bytes", [(dict(), 5 * 2**30), (dict(tie_embeddings=False), 20_000)],
                         ids=["tied", "untied-sharded"])
def test_export_matches_transformers_logits(overrides, max_shard_bytes, tmp_path):
    ours = build_model(tiny_config(**overrides), seed=3)
    perturb_norms_and_biases(ours)
    model_to_hf(ours, tmp_path, max_shard_bytes=max_shard_bytes)
    hf_model, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf_model.eval()
    assert max_abs_diff(ours, hf_model) <= ATOL
    assert max_abs_diff(ours, hf_model, mask=padding_mask(), types=token_types()) <= ATOL
    loaded_cfg, _ = load_hf_checkpoint(tmp_path)
    assert loaded_cfg == dataclasses.replace(ours.cfg, preset="bert-base")


def test_state_dict_round_trip_is_exact():
    cfg = tiny_config(tie_embeddings=False)
    sd = build_model(cfg, seed=1).state_dict()
    hf_sd = state_dict_to_hf(sd, cfg)
    assert hf_sd["bert.encoder.layer.1.attention.self.key.weight"] is sd["layers.1.attn.k_proj.weight"]
    assert hf_sd["cls.predictions.decoder.bias"] is hf_sd["cls.predictions.bias"] is sd["lm_bias.bias"]
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[name], sd[name]) for name in sd)


def test_import_reads_older_spellings():
    """A TensorFlow-converted BertForPreTraining save: LayerNorm gamma/beta, the index buffers, the
    pooler and next-sentence head (dropped: the masked LM has neither), both output-bias names."""
    cfg = tiny_config()
    sd = build_model(cfg, seed=1).state_dict()
    hf_sd = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
             for name, t in state_dict_to_hf(sd, cfg).items()}
    hf_sd |= {"bert.embeddings.position_ids": torch.arange(64)[None], "bert.pooler.dense.weight": torch.ones(32, 32),
              "bert.pooler.dense.bias": torch.ones(32), "cls.seq_relationship.weight": torch.ones(2, 32),
              "cls.predictions.decoder.weight": sd["embed_tokens.weight"],
              "cls.predictions.decoder.bias": hf_sd["cls.predictions.bias"]}
    back = state_dict_from_hf(hf_sd, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[name], sd[name]) for name in sd)


def test_a_bertmodel_checkpoint_is_refused_for_its_missing_head():
    """A BertModel save (no `bert.` prefix, a pooler) has no masked-LM head to convert."""
    cfg = tiny_config()
    hf_sd = {name.removeprefix("bert."): t for name, t in state_dict_to_hf(build_model(cfg).state_dict(), cfg).items()
             if not name.startswith("cls.")}
    hf_sd["pooler.dense.weight"] = torch.ones(32, 32)
    with pytest.raises(ValueError, match=r"missing keys \[cls.predictions.bias, cls.predictions.transform"):
        state_dict_from_hf(hf_sd, cfg)


def test_missing_unexpected_and_misshapen_tensors_are_named():
    cfg = tiny_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    del hf_sd["bert.encoder.layer.1.intermediate.dense.bias"]
    hf_sd["bert.encoder.layer.2.output.dense.weight"] = torch.ones(32, 64)
    with pytest.raises(ValueError, match=r"missing keys \[bert.encoder.layer.1.intermediate.dense.bias\], unexpected "
                                         r"keys \[bert.encoder.layer.2.output.dense.weight\]"):
        state_dict_from_hf(hf_sd, cfg)
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    hf_sd["bert.encoder.layer.0.output.dense.weight"] = hf_sd["bert.encoder.layer.0.output.dense.weight"].t()
    with pytest.raises(ValueError, match=r"output.dense.weight shape = \(64, 32\) is invalid: the model config "
                                         r"expects \(32, 64\)"):
        state_dict_from_hf(hf_sd, cfg)


def test_unexportable_arch_writes_nothing(tmp_path):
    cfg = tiny_config()
    with pytest.raises(ValueError, match='arch = \'gpt2\' is invalid: a BERT model .* exports as arch="bert"'):
        save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path / "out", arch="gpt2")
    assert not (tmp_path / "out").exists()


# -- config.json -----------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("hidden_act", "gelu_new"),
    ("position_embedding_type", "relative_key"),
    ("is_decoder", True),
    ("add_cross_attention", True),
])
def test_config_from_hf_refuses(key, value):
    hf = hf_config().to_dict() | {key: value}
    with pytest.raises(ValueError, match=f"^config.json {key} = {value!r} is invalid: "):
        config_from_hf(hf)


def test_config_round_trip_and_defaults():
    cfg = tiny_config(tie_embeddings=False, norm_eps=1e-6, type_vocab_size=3)
    assert config_from_hf(config_to_hf(cfg)) == dataclasses.replace(cfg, preset="bert-base")
    assert config_from_hf({"model_type": "bert"}) == model_config("bert-base")  # BertConfig's defaults
    assert config_from_hf(transformers.BertConfig().to_dict()) == model_config("bert-base")


# -- what makes it BERT ----------------------------------------------------------------------


@torch.no_grad()
def test_attention_is_bidirectional_and_padding_keys_are_ignored():
    model = build_model(tiny_config(), seed=0).eval()
    ids = tokens()
    later_changed = ids.clone()
    later_changed[:, -1] = (ids[:, -1] + 1) % VOCAB
    # the first position sees the last token: a causal model's first logits would be unchanged
    assert not torch.allclose(model(ids)[:, 0], model(later_changed)[:, 0], atol=1e-3)
    mask = padding_mask()
    padding_changed = ids.clone()
    padding_changed[1, -1] = (ids[1, -1] + 1) % VOCAB
    real = model(ids, padding_mask_BS=mask)[1, :SEQ_LEN - 9]
    torch.testing.assert_close(model(padding_changed, padding_mask_BS=mask)[1, :SEQ_LEN - 9], real, rtol=0, atol=1e-6)


def test_init_is_deterministic_by_name():
    cfg = tiny_config()
    first, again = build_model(cfg, seed=5).state_dict(), build_model(cfg, seed=5).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    other = build_model(cfg, seed=6).state_dict()
    assert not torch.equal(first["layers.0.attn.q_proj.weight"], other["layers.0.attn.q_proj.weight"])
    deeper = build_model(dataclasses.replace(cfg, n_layers=3), seed=5).state_dict()  # a value depends on its name only
    assert all(torch.equal(first[name], deeper[name]) for name in first)
    assert torch.equal(first["head_transform.norm.weight"], torch.ones(32)) and not first["lm_bias.bias"].any()
    assert first["layers.1.mlp.down_proj.weight"].std().item() == pytest.approx(0.2, rel=0.1)  # not scaled down


def test_loss_is_the_cross_entropy_of_the_masked_positions():
    model = build_model(tiny_config(), seed=0)
    ids = tokens()
    targets = torch.full_like(ids, -100)
    targets[0, 3], targets[1, 10], targets[1, 20] = 5, 17, 300
    logits = model(ids)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    picked = logits[[0, 1, 1], [3, 10, 20]]
    torch.testing.assert_close(expected, F.cross_entropy(picked, torch.tensor([5, 17, 300])))
    torch.testing.assert_close(model(ids, targets_BS=targets), expected, rtol=1e-6, atol=1e-6)


# -- counts and the plan ---------------------------------------------------------------------


BERT_BASE_MLM_PARAMS = 109_514_298  # transformers.BertForMaskedLM(BertConfig()).num_parameters()


@pytest.mark.parametrize("preset, overrides", [("bert-debug", {}), ("bert-debug", dict(tie_embeddings=False)),
                                               ("bert-base", {})])
def test_num_params_counts_the_built_model(preset, overrides):
    cfg = model_config(preset, **overrides)
    with torch.device("meta"):
        model = Bert(cfg)
    assert sum(p.numel() for p in model.parameters()) == counts_of(cfg).num_params()
    if preset == "bert-base":
        assert counts_of(cfg).num_params() == BERT_BASE_MLM_PARAMS



def test_plan_names_the_model_modules():
    cfg = tiny_config(tie_embeddings=False)
    plan, model = bert_plan(cfg), Bert(cfg)
    modules = dict(model.named_modules())
    assert set(plan.tp_top) | set(plan.first_stage) | set(plan.last_stage) <= set(modules)
    assert set(plan.tp_block(0)) <= set(dict(model.layers["0"].named_modules()))
    assert hasattr(model.layers["0"].get_submodule(plan.attention), "core_attention")
    assert plan.tp_top["lm_head"] == "head" and bert_plan(tiny_config()).tp_top["lm_head"] == "tied_head"
    d, f, v = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    block = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d  # GPT-2's block, post-norm or not
    assert plan.stage_costs(32) == ([6.0 * block + 12 * d * 32] * cfg.n_layers, 18.0 * d,
                                    6.0 * v * d + 6.0 * (d * d + 3 * d + v))


@pytest.mark.parametrize("tied", [True, False])
@torch.no_grad()
def test_two_pipeline_stages_compute_the_whole_model(tied):
    """Each stage drops what the other owns, by the plan (as distributed/pipeline_parallel.keep_stage
    does): the first returns the hidden state, the last takes it (a float input) and gives logits."""
    cfg = tiny_config(tie_embeddings=tied)
    plan, whole = bert_plan(cfg), build_model(cfg, seed=0).eval()
    first, last = build_model(cfg, seed=0).eval(), build_model(cfg, seed=0).eval()
    del first.layers["1"], last.layers["0"]
    for name in plan.last_stage:
        setattr(first, name, None)
    for name in plan.first_stage:
        if name != plan.tied_table:
            setattr(last, name, None)
    ids, mask = tokens(), padding_mask()
    hidden = first(ids, padding_mask_BS=mask)
    assert hidden.shape == (2, SEQ_LEN, cfg.dim)
    torch.testing.assert_close(last(hidden, padding_mask_BS=mask), whole(ids, padding_mask_BS=mask), rtol=0, atol=1e-6)
