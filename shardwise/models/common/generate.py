"""Autoregressive sampling with a KV cache: one forward over the prompt, then one token at a time."""

from __future__ import annotations

import torch

from shardwise.models.common.kv_cache import KVCache


def sample_next(logits_BV: torch.Tensor, *, temperature: float, top_k: int, generator) -> torch.Tensor:
    """Greedy when temperature == 0, else softmax(logits / T) restricted to the top k."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / temperature
    if top_k:
        kth = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    probs = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """The new token ids (without the prompt); stops early at `eos_id`."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one character to start from")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature} is invalid: use 0 (greedy) or a positive value")
    if top_k < 0:
        raise ValueError(f"top_k = {top_k} is invalid: use 0 (all tokens) or a positive count")
    device = next(model.parameters()).device
    max_len = min(len(prompt_ids) + max_new_tokens, model.cfg.max_seq_len)
    if len(prompt_ids) >= max_len:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the model takes at most {model.cfg.max_seq_len}; shorten it"
        )
    cache = KVCache(model.cfg, batch_size=1, max_len=max_len, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt_ids], device=device)
    new_ids: list[int] = []
    while cache.length + tokens.shape[1] <= max_len:
        logits = model(tokens, kv_cache=cache)
        if hasattr(logits, "full_tensor"):  # tensor parallel: logits sharded by vocabulary
            logits = logits.full_tensor()
        logits = logits[:, -1]
        next_id = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
        new_ids.append(int(next_id))
        if new_ids[-1] == eos_id or len(new_ids) == max_new_tokens:
            break
        tokens = next_id[:, None]
    return new_ids
