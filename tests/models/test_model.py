import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.common.rope import RopeSpec, inverse_frequencies
from shardwise.models.llama.model import build_model
from shardwise.config.presets import model_config
from shardwise.config.presets import PRESETS
from shardwise.models.build import build_on_meta
from shardwise.models.families import counts_of

# Published parameter counts of the Llama 3 family (model cards / HF safetensors metadata).
PUBLISHED_PARAMS = {
    "llama3-1b": 1_235_814_400,
    "llama3-3b": 3_212_749_824,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_num_params_counts_the_built_model(preset):
    cfg = model_config(preset)
    model = build_on_meta(cfg)  # the preset's family (llama or gpt2)
    assert sum(p.numel() for p in model.parameters()) == counts_of(cfg).num_params()
    if preset in PUBLISHED_PARAMS:
        assert counts_of(cfg).num_params() == PUBLISHED_PARAMS[preset]


def test_flops_per_token_formula():
    cfg = model_config("demo")
    n = counts_of(cfg).num_params() - 0  # tied: the table counts once, as the output head's matmul
    assert counts_of(cfg).flops_per_token(128) == 6 * n + 12 * cfg.n_layers * cfg.dim * 128
    untied = model_config("llama3-8b")
    n_matmul = counts_of(untied).num_params() - untied.vocab_size * untied.dim
    assert counts_of(untied).flops_per_token(4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096


@pytest.mark.parametrize(
    "overrides",
    [
        dict(n_kv_heads=4),  # MHA
        dict(n_kv_heads=2),  # GQA
        dict(n_kv_heads=1),  # MQA
        dict(tie_embeddings=False, qkv_bias=True),
        dict(parallel_block=True),
        dict(rope_scaling_factor=8.0, rope_original_max_seq_len=32),
        dict(head_dim=32),
    ],
)
def test_forward_backward_shapes_and_finite(overrides):
    cfg = model_config("debug", **overrides)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    # Untrained logits are near zero: loss on unrelated targets ≈ log(vocab).
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_model_is_causal():
    model = build_model(model_config("debug"), seed=0)
    tokens = torch.randint(0, 512, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_init_is_seeded_and_independent_of_device_placement():
    a = build_model(model_config("debug"), seed=3).state_dict()
    b = build_model(model_config("debug"), seed=3).state_dict()
    c = build_model(model_config("debug"), seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])
    # Output projections are scaled down by sqrt(2 * n_layers).
    std_q = a["layers.0.attn.q_proj.weight"].std().item()
    std_o = a["layers.0.attn.o_proj.weight"].std().item()
    assert std_o == pytest.approx(std_q / 2, rel=0.15)
    assert torch.equal(a["norm.weight"], torch.ones(64))


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    plain = inverse_frequencies(RopeSpec(head_dim=64, theta=500000.0))
    scaled = inverse_frequencies(RopeSpec(head_dim=64, theta=500000.0, scaling_factor=8.0))
    torch.testing.assert_close(scaled[:4], plain[:4])  # short wavelengths untouched
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8)  # long wavelengths stretched
    assert not torch.allclose(scaled, plain)


