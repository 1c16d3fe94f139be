"""The functional KV cache behind `shardwise export` (generation/functional_cache.py): prefill and
decode through it give each row the logits of the model's plain forward over that row alone, for
every decoder kind (GQA, a sliding window shorter than the prompts, q/k/v biases and q/k norms,
GPT-2's learned positions, mixture-of-experts), in a left-padded batch of different lengths."""

import pytest
import torch

from shardwise.config.presets import model_config
from shardwise.infer.export_programs import Decode, Prefill, export_programs
from shardwise.models.build import build_on_meta

VARIANTS = {
    "llama": ("debug", {}),
    "mistral-window": ("debug", {"sliding_window": 4}),
    "qwen-biases-norms": ("debug", {"qkv_bias": True, "qk_norm": True}),
    "gpt2": ("gpt2-debug", {}),
    "moe": ("moe-debug", {}),
}


def built(variant: str):
    preset, overrides = VARIANTS[variant]
    model = build_on_meta(model_config(preset, max_seq_len=64, **overrides))
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    return model.eval()


def padded_batch(vocab_size: int, lengths: list[int]):
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    tokens = torch.stack([torch.cat([torch.zeros(width - len(row), dtype=torch.long), row]) for row in rows])
    return rows, tokens, torch.tensor([width - n for n in lengths])


@torch.no_grad()
def check_two_decode_steps(prefill, decode, model, lengths: list[int]) -> None:
    """Each row's logits after prefill and after two decode steps equal its own unpadded forward's."""
    rows, tokens, pad = padded_batch(model.cfg.vocab_size, lengths)
    logits, keys, values = prefill(tokens, pad)
    for _ in range(2):
        expected = torch.stack([model(row[None])[0, -1] for row in rows])
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)  # fp32 reassociation only
        chosen = logits.argmax(dim=-1)
        rows = [torch.cat([row, token[None]]) for row, token in zip(rows, chosen)]
        logits, new_keys, new_values = decode(chosen[:, None].contiguous(), pad, keys, values)
        assert new_keys.shape == (*keys.shape[:3], 1, keys.shape[4])
        keys, values = torch.cat([keys, new_keys], dim=3), torch.cat([values, new_values], dim=3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batch_matches_each_row_alone(variant):
    model = built(variant)
    check_two_decode_steps(Prefill(model), Decode(model), model, [9, 1, 6])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mistral-window", "gpt2", "moe"])
def test_exported_programs_take_any_batch_and_length(variant):
    """torch.export's programs (traced at batch 2, prompt 3, cache 3) run other sizes, batch and prompt 1
    included: nothing was specialised to the example. The kinds that trace differently from Llama's
    (a window, learned positions, the experts' static-shape sum); AOTInductor compiles these graphs as
    they are (tests/infer/test_export.py compiles Llama's; a compile takes ~40 s, too long for each)."""
    model = built(variant)
    programs = export_programs(model)
    prefill, decode = (programs[name].module() for name in ("prefill", "decode"))
    check_two_decode_steps(prefill, decode, model, [7, 2, 5, 4])
    check_two_decode_steps(prefill, decode, model, [1])
