"""Helpers shared by the HF interop tests (test_hf_adapter, test_hf_moe, test_qwen3_and_sliding_window,
test_gpt2, test_bert, test_vit): tiny random `transformers` models with nothing left at a telling init value, and the
logits gap between ours and HF's. Imported as `from hf_helpers import ...`: pytest puts a test
file's directory on sys.path (as tests/distributed does with `harness`).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def perturb_norms_and_biases(model: torch.nn.Module, also: tuple[str, ...] = ()) -> None:
    """Init leaves norms at one and biases at zero, which would hide a swapped or dropped tensor: every
    parameter named with "norm" (or one of `also`, e.g. GPT-2's "ln", HF's zero-initialised routers),
    or ending in "bias", gets seeded noise."""
    torch.manual_seed(2)
    for name, param in model.named_parameters():
        if name.endswith("bias") or any(part in name for part in ("norm", *also)):
            param.add_(torch.randn_like(param) * 0.2)


def random_hf_model(config, attn_implementation: str = "sdpa", *, also: tuple[str, ...] = (),
                    auto: str = "AutoModelForCausalLM"):
    """A seeded `transformers.<auto>` model of `config`, perturbed as above, in eval mode."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config, attn_implementation=attn_implementation)
    perturb_norms_and_biases(model, also)
    return model.eval()


@torch.no_grad()
def max_abs_diff(ours: torch.nn.Module, hf_model, tokens_BS: torch.Tensor) -> float:
    """The largest logit difference between our model and HF's on `tokens_BS`."""
    return (ours.eval()(tokens_BS) - hf_model(tokens_BS).logits).abs().max().item()
