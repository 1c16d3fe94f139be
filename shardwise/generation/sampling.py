"""Choosing the next token of each running sequence, as OpenAI's API defines the knobs.

Per row, in this order: logit_bias is added; presence and frequency penalties are subtracted
(`logit -= frequency * count + presence * (count > 0)` over the tokens this sequence has
generated, as OpenAI documents); temperature 0 (or below GREEDY_BELOW, where logits / T would
overflow to inf and the softmax to NaN) takes the argmax, otherwise logits / T are
restricted to the top_k most likely and the smallest set whose probability reaches top_p,
and one token is drawn with the sequence's own generator. A request's seed therefore fixes
its output whatever else is in the batch (choice i of `n` uses seed + i).

Log-probabilities returned to the client are the model's own (log_softmax of the raw logits,
before bias, penalties and temperature), which is what a client comparing models wants.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature this small samples the argmax anyway (vLLM's threshold too)
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as OpenAI's API types it (choice i of n draws with seed + i)


class InvalidRequest(ValueError):
    """A request value the engine refuses, with the request field (`param`) it is about: the server
    answers it 400, naming the field."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: every token."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    """Strings that end the output; the output never includes them."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (besides the tokenizer's end-of-text unless ignore_eos)."""
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    """None: no log-probabilities; k: the chosen token's and the k most likely alternatives'."""
    logit_bias: dict[int, float] = field(default_factory=dict)

    def check(self, vocab_size: int | None, names: dict[str, str] | None = None) -> "SamplingParams":
        """Raises InvalidRequest naming the field (as `names` spells it: a CLI flag), the value and the
        range (the server's 400); token ids and top_k are checked when `vocab_size` is given."""
        def bad(name, value, want):
            raise InvalidRequest(f"{(names or {}).get(name, name)} = {value!r} is invalid: {want}", param=name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "ask for at least 1 token")
        if not (0 <= self.temperature <= 2):  # also NaN, which every comparison fails
            bad("temperature", self.temperature, "use a value from 0 (greedy) to 2")
        if not (0 < self.top_p <= 1):
            bad("top_p", self.top_p, "use a value in (0, 1]")
        if self.top_k < 0 or (vocab_size and self.top_k > vocab_size):
            bad("top_k", self.top_k, "use 0 (every token) or a positive count"
                + (f" up to the vocabulary's {vocab_size}" if vocab_size else ""))
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                bad(name, getattr(self, name), "use a value from -2 to 2")
        if self.seed is not None and not (SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", self.seed, "use a 64-bit signed integer")
        self.check_stops(bad)
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            bad("logprobs", self.logprobs, f"ask for 0 to {MAX_TOP_LOGPROBS} alternatives")
        if vocab_size:
            self.check_token_ids(bad, vocab_size)
        if any(not (-100 <= bias <= 100) for bias in self.logit_bias.values()):
            bad("logit_bias", self.logit_bias, "biases go from -100 to 100")
        return self

    def check_stops(self, bad) -> None:
        if len(self.stop) > 4:
            bad("stop", list(self.stop), "give at most 4 stop strings")
        if any(not s for s in self.stop):
            bad("stop", list(self.stop), "stop strings must not be empty")

    def check_token_ids(self, bad, vocab_size: int) -> None:
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            outside = [token_id for token_id in ids if not (0 <= token_id < vocab_size)]
            if outside:
                bad(name, outside[0], f"token ids go from 0 to {vocab_size - 1} (the vocabulary)")

    def generator(self, device, choice: int = 0) -> torch.Generator:
        seed = secrets.randbits(63) if self.seed is None else self.seed + choice
        return torch.Generator(device=device).manual_seed(seed)


@dataclass
class TokenChoice:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), most likely first


def choose_tokens(logits_BV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                  counts: list[torch.Tensor | None]) -> list[TokenChoice]:
    """One token per row. `counts[b]` is row b's generated-token histogram [vocab] (None when it
    has no penalty)."""
    logits = logits_BV.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    logits = adjusted_logits(logits, params, counts)
    greedy = [p.temperature < GREEDY_BELOW for p in params]
    chosen = logits.argmax(dim=-1)
    if not all(greedy):
        rows = [b for b, g in enumerate(greedy) if not g]
        probs = sampling_probs(logits[rows], [params[b] for b in rows])
        for i, b in enumerate(rows):
            chosen[b] = torch.multinomial(probs[i], 1, generator=generators[b])[0]
    chosen_ids = chosen.tolist()
    choices = [TokenChoice(token_id) for token_id in chosen_ids]
    if raw_logprobs is not None:
        for b, p in enumerate(params):
            if p.logprobs is None:
                continue
            choices[b].logprob = float(raw_logprobs[b, chosen_ids[b]])
            if p.logprobs:
                top = torch.topk(raw_logprobs[b], p.logprobs)
                choices[b].top = list(zip(top.indices.tolist(), top.values.tolist()))
    return choices


def adjusted_logits(logits_BV: torch.Tensor, params: list[SamplingParams], counts) -> torch.Tensor:
    for b, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits_BV.device)
            logits_BV[b, ids] += torch.tensor(list(p.logit_bias.values()), device=logits_BV.device)
        if counts[b] is not None:
            logits_BV[b] -= p.frequency_penalty * counts[b] + p.presence_penalty * (counts[b] > 0).float()
    return logits_BV


def sampling_probs(logits_BV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax(logits / T) over each row's top_k and top_p nucleus (at least one token kept)."""
    device = logits_BV.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits_BV / temperature
    vocab = logits.shape[-1]
    if any(p.top_k or p.top_p < 1 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=device)[:, None]
        drop = rank >= top_k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # keep a token while the mass before it < top_p
        drop |= mass_before >= top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)
