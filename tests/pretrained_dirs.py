"""Tiny pretrained sources for the train.init_from tests (tests/train/test_init_from.py,
tests/distributed/test_init_from_layouts.py): Hugging Face directories written by `transformers`' own
`save_pretrained` from a tiny config, with a tokenizer.json beside them, as a downloaded model has.
Imported by name: tests/ is on sys.path (its conftest.py lives there).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
"""The models' vocabulary; the tokenizer's (trained to 300 entries at most) fits inside it."""


def llama_config(**overrides):
    import transformers

    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return transformers.LlamaConfig(**(values | overrides))


def gpt2_config(**overrides):
    import transformers

    values = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**(values | overrides))


CONFIGS = {"llama": llama_config, "gpt2": gpt2_config}


@torch.no_grad()
def write_hf_dir(out: Path, family: str = "llama", **overrides) -> Path:
    """`out` holding a seeded random `transformers` model of the family (norms and biases moved off their
    init values of one and zero, so a dropped or swapped one shows) and a byte-level tokenizer.json."""
    import transformers

    from shardwise.data.tokenizer import save_tokenizer, train_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](**overrides))
    for name, param in model.named_parameters():
        if name.endswith("bias") or "norm" in name or ".ln_" in name:
            param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out)
    documents = [(Path(torch.__file__).parent / name).read_text() for name in ("functional.py", "serialization.py")]
    save_tokenizer(train_tokenizer(documents, 300), out / "tokenizer.json")
    return out


def hf_model(directory: Path):
    """The directory's model as `transformers` loads it, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
