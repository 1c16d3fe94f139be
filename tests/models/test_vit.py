"""The ViT family: HF `transformers` ViTForImageClassification logits on converted weights (both
directions), the loss, pipeline-stage inputs, the per-name init, the plan, and what it refuses.

fp32 on CPU, random tiny models (hidden 32, 2 layers, 8x8 images in 2x2 or 4x4 patches, 10 classes).
Tolerance: atol 1e-5 on logits of magnitude ~2-3; observed 0 against HF's sdpa attention and ~7e-7
against its eager attention (the same ops in the same order otherwise; the final LayerNorm runs on
the class token alone here, which is per token the same arithmetic).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from shardwise.config.presets import model_config
from shardwise.models.families import counts_of
from shardwise.models.vit.hf_adapter import (load_hf_checkpoint, model_from_hf, model_to_hf,
    save_hf_checkpoint, state_dict_from_hf, state_dict_to_hf)
from shardwise.models.vit.hf_config import config_from_hf, config_to_hf
from shardwise.models.vit.model import ViT, build_model
from shardwise.models.vit.plan import vit_plan

from hf_helpers import max_abs_diff, perturb_norms_and_biases, random_hf_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
NUM_CLASSES = 10
VIT_B16_PARAMS = 86_567_656  # HF google/vit-base-patch16-224: ViTForImageClassification.num_parameters()


def images(channels: int = 1, seed: int = 1, size: int = 8) -> torch.Tensor:
    return torch.randn(3, channels, size, size, generator=torch.Generator().manual_seed(seed))


def hf_config(**overrides):
    fields = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=8,
                  patch_size=2, num_channels=1, num_labels=NUM_CLASSES, initializer_range=0.2)
    return transformers.ViTConfig(**(fields | overrides))


def random_hf_vit(config, attn_implementation: str = "sdpa"):
    """A seeded ViTForImageClassification, norms and biases perturbed (hf_helpers), in eval mode."""
    # HF's layernorm_before/_after/layernorm all contain "norm"
    return random_hf_model(config, attn_implementation, auto="AutoModelForImageClassification")


def tiny_config(**overrides):
    return model_config("vit-debug", dim=32, n_heads=4, n_kv_heads=4, ffn_dim=64, init_std=0.2, **overrides)


# -- HF <-> shardwise logits -----------------------------------------------------------------


@pytest.mark.parametrize("overrides, attn", [
    (dict(), "sdpa"),
    (dict(num_channels=3, patch_size=4, intermediate_size=48, image_size=[8, 8]), "eager"),
], ids=["grey-2x2-sdpa", "rgb-4x4-eager"])
def test_import_matches_transformers_logits(overrides, attn, tmp_path):
    hf_model = random_hf_vit(hf_config(**overrides), attn)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_from_hf(tmp_path)
    channels = overrides.get("num_channels", 1)
    assert (ours.cfg.family, ours.cfg.n_channels, ours.cfg.n_classes) == ("vit", channels, NUM_CLASSES)
    assert ours.cfg.max_seq_len == (8 // overrides.get("patch_size", 2)) ** 2 + 1
    assert max_abs_diff(ours, hf_model, images(channels)) <= ATOL


@pytest.mark.parametrize("overrides, max_shard_bytes", [(dict(), 5 * 2**30), (dict(n_channels=3), 20_000)],
                         ids=["grey", "rgb-sharded"])
def test_export_matches_transformers_logits(overrides, max_shard_bytes, tmp_path):
    ours = build_model(tiny_config(**overrides), seed=3)
    perturb_norms_and_biases(ours)
    model_to_hf(ours, tmp_path, max_shard_bytes=max_shard_bytes)
    hf_model = transformers.AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert type(hf_model).__name__ == "ViTForImageClassification"
    assert max_abs_diff(ours, hf_model, images(ours.cfg.n_channels)) <= ATOL
    loaded_cfg, loaded_sd = load_hf_checkpoint(tmp_path)
    assert loaded_cfg == dataclasses.replace(ours.cfg, preset="vit-base")
    assert all(torch.equal(loaded_sd[name], tensor) for name, tensor in ours.state_dict().items())


def test_hf_names_are_those_save_pretrained_writes(tmp_path):
    from safetensors.torch import load_file

    random_hf_vit(hf_config()).save_pretrained(tmp_path, safe_serialization=True)
    cfg = tiny_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    saved = load_file(tmp_path / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in hf_sd.items()} == {name: tuple(t.shape) for name, t in saved.items()}


def test_import_reads_a_vitmodel_checkpoint_with_a_pooler_and_in_memory_names(tmp_path):
    """A ViTModel's tensors (no `vit.` prefix, a pooler) plus a classifier; and a loaded HF model's
    own state dict (5.x renames on load: `vit.layers.<i>.attention.q_proj`, `mlp.fc1`, ...)."""
    cfg = tiny_config()
    ours = build_model(cfg, seed=1)
    sd = ours.state_dict()
    hf_sd = state_dict_to_hf(sd, cfg)
    headless = {name.removeprefix("vit."): t for name, t in hf_sd.items()}
    headless |= {"pooler.dense.weight": torch.ones(32, 32), "pooler.dense.bias": torch.ones(32)}
    back = state_dict_from_hf(headless, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[name], sd[name]) for name in sd)

    model_to_hf(ours, tmp_path)
    in_memory = transformers.AutoModelForImageClassification.from_pretrained(tmp_path).state_dict()
    back = state_dict_from_hf(in_memory, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[name], sd[name]) for name in sd)


# -- the model -------------------------------------------------------------------------------


def test_loss_with_targets_is_the_cross_entropy_of_the_logits():
    model = build_model(tiny_config(), seed=0)
    targets = torch.tensor([3, 0, 9])
    logits = model(images())
    assert logits.shape == (3, NUM_CLASSES)
    torch.testing.assert_close(model(images(), targets_B=targets), F.cross_entropy(logits, targets),
                               rtol=1e-6, atol=1e-6)


def test_a_hidden_state_input_skips_the_embedding_and_a_headless_stage_returns_it():
    """As a pipeline stage after the first (no `embed`) and one before the last (no pool/norm/classifier)."""
    model = build_model(tiny_config(), seed=0).eval()
    with torch.no_grad():
        h = model.embed(images())
        expected = model(images())
        model.embed = None
        torch.testing.assert_close(model(h), expected, rtol=0, atol=0)
        after_blocks = model.layers["1"](model.layers["0"](h))
        model.pool = model.norm = model.classifier = None
        out = model(h)
    assert out.shape == (3, 17, 32)
    torch.testing.assert_close(out, after_blocks, rtol=0, atol=0)


def test_images_of_another_size_are_refused():
    model = build_model(tiny_config(), seed=0)
    with pytest.raises(ValueError, match=re.escape("images of shape (3, 1, 16, 16) are invalid: the model takes "
                                                   "[batch, 1, 8, 8]")):
        model(images(size=16))
    with pytest.raises(ValueError, match=r"images of shape \(3, 3, 8, 8\) are invalid"):
        model(images(channels=3))


def test_init_is_deterministic_by_name():
    cfg = tiny_config()
    a, b, other = build_model(cfg, seed=5), build_model(cfg, seed=5), build_model(cfg, seed=6)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
        assert torch.equal(tensor, a.initial_value(name, tensor.shape, "cpu", 5)), name
    assert not torch.equal(a.embed.cls_token, other.embed.cls_token)
    assert torch.equal(a.layers["1"].mlp_norm.weight, torch.ones(32))
    assert torch.equal(a.embed.projection.bias, torch.zeros(32)) and torch.equal(a.classifier.bias, torch.zeros(10))
    assert abs(a.embed.positions.std().item() - cfg.init_std) < 0.03
    assert not torch.equal(a.layers["0"].attn.q_proj.weight, a.layers["1"].attn.q_proj.weight)


def test_plan_names_modules_the_model_has():
    cfg = model_config("vit-debug")
    plan = vit_plan(cfg)
    with torch.device("meta"):
        model = ViT(cfg)
    modules = dict(model.named_modules())
    assert all(name in modules for name in (*plan.first_stage, *plan.last_stage, *plan.tp_top, plan.blocks))
    block = dict(model.layers["0"].named_modules())
    assert all(name in block for name in plan.tp_block(0)) and plan.attention in block
    assert plan.tp_top == {"embed": "sequence_scatter", "pool": "sequence_gather"}
    assert plan.targets_kwarg == "targets_B" and plan.tied_table is None


@pytest.mark.parametrize("preset", ["vit-debug", "vit-base"])
def test_num_params_counts_the_built_model(preset):
    cfg = model_config(preset)
    with torch.device("meta"):
        model = ViT(cfg)
    assert sum(p.numel() for p in model.parameters()) == counts_of(cfg).num_params()
    if preset == "vit-base":
        assert counts_of(cfg).num_params() == VIT_B16_PARAMS


def test_stage_costs_count_vit_blocks():
    cfg = model_config("vit-debug")
    blocks, first, last = vit_plan(cfg).stage_costs(1024)  # the image, not the text seq_len, sets S
    d, f, s = cfg.dim, cfg.ffn_dim, 17
    block = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d
    assert sum(p.numel() for p in build_model(cfg).layers["0"].parameters()) == block
    assert blocks == [6.0 * block + 12 * d * s] * cfg.n_layers
    assert first == 6.0 * (1 * 2 * 2 + 1) * d
    assert last == pytest.approx((6.0 * (d + 1) * 10 + 12 * d) / s)


# -- config.json ------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_act="gelu_new"), "config.json hidden_act = 'gelu_new' is invalid: shardwise's ViT MLP is the exact"),
    (dict(qkv_bias=False), "config.json qkv_bias = False is invalid"),
    (dict(image_size=[8, 16]), r"config.json image_size = \[8, 16\] is invalid: shardwise's ViT takes square"),
    (dict(patch_size=[2, 4]), r"config.json patch_size = \[2, 4\] is invalid"),
    (dict(patch_size=3), "config.json patch_size = 3 is invalid: use a divisor of image_size"),
    (dict(problem_type="regression"), "config.json problem_type = 'regression' is invalid"),
    (dict(num_labels=0), "config.json num_labels = 0 is invalid"),
])
def test_config_from_hf_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf_config(**overrides).to_dict())


def test_config_from_hf_refuses_another_model_type():
    with pytest.raises(ValueError, match="config.json model_type = 'gpt2' is invalid: use vit"):
        config_from_hf({"model_type": "gpt2"})


def test_config_round_trip_and_defaults():
    cfg = tiny_config(n_channels=3, norm_eps=1e-6)
    assert config_from_hf(config_to_hf(cfg)) == dataclasses.replace(cfg, preset="vit-base")
    published = config_from_hf({"model_type": "vit"})  # every key left out: ViTConfig's (2 labels)
    assert dataclasses.replace(published, preset="vit-base") == model_config("vit-base", n_classes=2)
    assert config_from_hf({"model_type": "vit", "num_labels": 7}).n_classes == 7


def test_unexportable_arch_writes_nothing(tmp_path):
    cfg = tiny_config()
    with pytest.raises(ValueError, match='arch = \'gpt2\' is invalid: a ViT model .* exports as arch="vit"'):
        save_hf_checkpoint(cfg, build_model(cfg).state_dict(), tmp_path / "out", arch="gpt2")
    assert not (tmp_path / "out").exists()


def test_headless_missing_and_misshapen_tensors_are_named():
    cfg = tiny_config()
    hf_sd = state_dict_to_hf(build_model(cfg).state_dict(), cfg)
    headless = {name: t for name, t in hf_sd.items() if not name.startswith("classifier.")}
    with pytest.raises(ValueError, match="HF checkpoint classifier.weight = None is invalid: the checkpoint has no "
                                         "classification head"):
        state_dict_from_hf(headless, cfg)
    broken = dict(hf_sd)
    del broken["vit.encoder.layer.1.intermediate.dense.bias"]
    broken["vit.encoder.layer.2.layernorm_before.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match=r"missing keys \[vit.encoder.layer.1.intermediate.dense.bias\], unexpected "
                                         r"keys \[vit.encoder.layer.2.layernorm_before.weight\]"):
        state_dict_from_hf(broken, cfg)
    broken = dict(hf_sd)
    broken["vit.embeddings.position_embeddings"] = torch.ones(1, 65, 32)
    with pytest.raises(ValueError, match=r"position_embeddings shape = \(1, 65, 32\) is invalid: the model config "
                                         r"expects \(1, 17, 32\)"):
        state_dict_from_hf(broken, cfg)
