"""Named model shapes. The Llama 3 entries carry the published shapes (Llama 3.1 8B/70B/405B,
Llama 3.2 1B/3B) and Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json); `demo` is the
few-million-parameter model of `shardwise train`, `debug` is the tiny one tests use, `moe-debug`
its mixture-of-experts twin with the same active parameters (top-2 of 4 experts of half the width)."""

from __future__ import annotations

from shardwise.core.model import ModelConfig
from shardwise.models.families import validate_model

LLAMA3_COMMON = dict(
    vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192,
)

PRESETS: dict[str, dict] = {
    "debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=512, max_seq_len=256),
    "demo": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=4096, max_seq_len=1024),
    "moe-debug": dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=512, max_seq_len=256,
        n_experts=4, experts_per_token=2, moe_ffn_dim=80,
    ),
    "mixtral-8x7b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000, max_seq_len=32768,
        rope_theta=1e6, norm_eps=1e-5, tie_embeddings=False, n_experts=8, experts_per_token=2,
        router_norm_topk=True, aux_loss_coef=0.02, z_loss_coef=0.0,
    ),
    "llama3-1b": dict(
        LLAMA3_COMMON, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        tie_embeddings=True, rope_scaling_factor=32.0,
    ),
    "llama3-3b": dict(
        LLAMA3_COMMON, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
        tie_embeddings=True, rope_scaling_factor=32.0,
    ),
    "llama3-8b": dict(
        LLAMA3_COMMON, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        tie_embeddings=False, rope_scaling_factor=8.0,
    ),
    "llama3-70b": dict(
        LLAMA3_COMMON, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        tie_embeddings=False, rope_scaling_factor=8.0,
    ),
    "llama3-405b": dict(
        LLAMA3_COMMON, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
        tie_embeddings=False, rope_scaling_factor=8.0,
    ),
    # GPT-2 (model.family = "gpt2"): `gpt2` has the shapes of the published 124M model (HF "gpt2"),
    # `gpt2-debug` is the tiny one tests use (the debug preset's width, vocabulary and length).
    "gpt2-debug": dict(
        family="gpt2", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=512, max_seq_len=256,
        tie_embeddings=True,
    ),
    "gpt2": dict(
        family="gpt2", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3072, vocab_size=50257,
        max_seq_len=1024, norm_eps=1e-5, tie_embeddings=True,
    ),
    # BERT (model.family = "bert"): `bert-base` has the shapes of bert-base-uncased, `bert-debug` is tiny.
    "bert-debug": dict(
        family="bert", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=512, max_seq_len=256,
        norm_eps=1e-12, tie_embeddings=True,
    ),
    "bert-base": dict(
        family="bert", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3072, vocab_size=30522,
        max_seq_len=512, norm_eps=1e-12, tie_embeddings=True,
    ),
    # ViT (model.family = "vit"): `vit-base` is ViT-B/16 at 224 pixels (google/vit-base-patch16-224),
    # `vit-debug` a tiny one over 8x8 grey images (scikit-learn's digits) in 2x2 patches. The
    # vocabulary is unused (no token table); it stays at 1.
    "vit-debug": dict(
        family="vit", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=1, max_seq_len=17,
        norm_eps=1e-12, tie_embeddings=False, image_size=8, patch_size=2, n_channels=1, n_classes=10,
    ),
    "vit-base": dict(
        family="vit", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3072, vocab_size=1, max_seq_len=197,
        norm_eps=1e-12, tie_embeddings=False, image_size=224, patch_size=16, n_channels=3, n_classes=1000,
    ),
    # T5 (model.family = "t5"): `t5-small` is google-t5/t5-small (v1.0: ReLU MLP, tied head); `t5-debug`
    # a tiny v1.0. T5's init_std is HF's initializer_factor (1.0), scaled per weight by the model.
    "t5-debug": dict(
        family="t5", dim=64, n_layers=2, n_decoder_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128,
        vocab_size=512, max_seq_len=256, norm_eps=1e-6, tie_embeddings=True, init_std=1.0,
    ),
    "t5-small": dict(
        family="t5", dim=512, n_layers=6, n_decoder_layers=6, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=2048,
        vocab_size=32128, max_seq_len=512, norm_eps=1e-6, tie_embeddings=True, init_std=1.0,
    ),
}


def model_config(preset: str, **overrides):
    """The ModelConfig of a preset, with field overrides, validated."""
    if preset not in PRESETS:
        raise ValueError(f"model.preset = {preset!r} is invalid: use one of {', '.join(PRESETS)}")
    cfg = ModelConfig(preset=preset, **{**PRESETS[preset], **overrides})
    validate_model(cfg)
    return cfg
