"""What a model learns from a window of tokens: the (inputs, targets) pair of its objective.

    causal LM (llama, gpt2)  inputs = window[:-1], targets = window[1:] (the next token)
    masked LM (bert)         inputs = window[:-1] with some tokens corrupted, targets = the original
                             token at those positions and -100 (ignored by the loss) elsewhere
    span corruption (t5)     inputs = window[:-1] with spans of SPAN_LENGTH tokens each replaced by
                             one sentinel, then end-of-text; targets = each sentinel followed by the
                             span it hid, then end-of-text (Raffel et al., 2020, section 3.1.4)

Masked LM follows BERT (Devlin et al., 2019): of the chosen positions, 80% become the mask token,
10% a random token, 10% stay as they are. One thing differs on purpose: each sequence gets exactly
round(data.mask_fraction x seq_len) positions (BERT and HF's collator draw each position with that
probability). Every micro-batch then holds the same number of predicted tokens, so the mean of
the micro-batches' (and the data-parallel ranks') mean losses is the mean over the global batch,
and every layout equals one process exactly, as for the causal objective.

Span corruption likewise hides exactly max(1, round(data.mask_fraction x seq_len / SPAN_LENGTH))
spans of SPAN_LENGTH tokens (T5 draws span lengths around a mean of 3): every sequence's inputs and
targets have the same lengths, so no padding is needed and the layouts stay exact.

The draw of sample k (the loader's global sample counter) comes from a generator seeded by
(train.seed, k): the same masks whichever rank, micro-batch or resume reads the sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardwise.core.model_counts import SPAN_LENGTH
from shardwise.data.tokenizer import eos_id
from shardwise.models.families import spec_of


MASK_TOKEN = "<mask>"
"""The mask token a tokenizer trained here for a masked LM gets (id 1, after end-of-text)."""
OTHER_MASK_TOKENS = ("[MASK]",)
"""Mask tokens of pretrained tokenizers (BERT's WordPiece), tried when MASK_TOKEN is absent."""
IGNORE_INDEX = -100
MASK_STREAM = 0x6D61736B
"""Separates the masking draws from the loader's permutations, which use (seed, epoch)."""
NUM_SENTINELS = 32
"""Sentinel tokens a tokenizer trained for span corruption gets (<extra_id_0> ... <extra_id_31>): the
most spans one sequence may hide (seq_len up to 640 at mask_fraction 0.15)."""


def sentinel_tokens(count: int = NUM_SENTINELS) -> tuple[str, ...]:
    return tuple(f"<extra_id_{i}>" for i in range(count))


def objective_of(family: str) -> str:
    """The training objective of a model family (its spec's)."""
    return spec_of(family).objective


def special_tokens_of(family: str) -> tuple[str, ...]:
    """Special tokens a tokenizer trained for this family needs besides end-of-text."""
    objective = objective_of(family)
    return (MASK_TOKEN,) if objective == "masked_lm" else sentinel_tokens() if objective == "span_corruption" else ()


def mask_id(tokenizer) -> int:
    for token in (MASK_TOKEN, *OTHER_MASK_TOKENS):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(
        f"data.tokenizer: the tokenizer has no mask token ({', '.join((MASK_TOKEN, *OTHER_MASK_TOKENS))}) for the "
        f"masked-LM objective of model.family bert; add {MASK_TOKEN!r} as a special token or leave data.tokenizer "
        "empty to train one")


def causal_lm(windows_BS1: torch.Tensor, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return windows_BS1[:, :-1].contiguous(), windows_BS1[:, 1:].contiguous()


@dataclass(frozen=True)
class MaskedLM:
    mask_id: int
    vocab_size: int
    """Random replacements are drawn from [0, vocab_size): the tokenizer's vocabulary."""
    fraction: float
    seed: int

    def masked_per_sequence(self, seq_len: int) -> int:
        return max(1, round(self.fraction * seq_len))

    def __call__(self, windows_BS1: torch.Tensor, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = windows_BS1[:, :-1].numpy().copy()
        targets = np.full_like(inputs, IGNORE_INDEX)
        count = self.masked_per_sequence(inputs.shape[1])
        for row, sample in enumerate(samples):
            rng = np.random.default_rng([self.seed, MASK_STREAM, int(sample)])
            positions = rng.choice(inputs.shape[1], size=count, replace=False)
            kind = rng.random(count)
            replacements = rng.integers(0, self.vocab_size, size=count)
            targets[row, positions] = inputs[row, positions]
            inputs[row, positions] = np.where(kind < 0.8, self.mask_id,
                                              np.where(kind < 0.9, replacements, inputs[row, positions]))
        return torch.from_numpy(inputs), torch.from_numpy(targets)


@dataclass(frozen=True)
class SpanCorruption:
    sentinel_ids: tuple[int, ...]
    eos_id: int
    fraction: float
    seed: int
    multiple: int = 1
    """data.length_multiple: both lengths rounded to a multiple of it (inputs down, targets up)."""

    def num_spans(self, seq_len: int) -> int:
        spans = max(1, round(self.fraction * seq_len / SPAN_LENGTH))
        if spans > len(self.sentinel_ids) or spans * (SPAN_LENGTH + 1) > seq_len:
            raise ValueError(f"train.seq_len = {seq_len} is invalid for span corruption: it hides {spans} spans, "
                             f"more than the tokenizer's {len(self.sentinel_ids)} sentinels allow; use a shorter "
                             "train.seq_len or a smaller data.mask_fraction")
        return spans

    def __call__(self, windows_BS1: torch.Tensor, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = windows_BS1[:, :-1].numpy()
        seq_len = tokens.shape[1]
        spans = self.num_spans(seq_len)
        kept = seq_len - spans * SPAN_LENGTH
        kept -= (kept + spans + 1) % self.multiple  # the window's last tokens dropped: a whole input length
        if kept + 1 < spans:
            raise ValueError(f"data.length_multiple = {self.multiple} is invalid for train.seq_len = {seq_len}: it "
                             "leaves too few tokens around the spans; use a smaller multiple or a longer seq_len")
        target_len = -(-(spans * (SPAN_LENGTH + 1) + 1) // self.multiple) * self.multiple
        inputs = np.empty((len(tokens), kept + spans + 1), dtype=np.int64)
        targets = np.full((len(tokens), target_len), IGNORE_INDEX, dtype=np.int64)  # the padding: ignored
        for row, sample in enumerate(samples):
            rng = np.random.default_rng([self.seed, MASK_STREAM, int(sample)])
            # Span i is inserted after `cuts[i]` kept tokens: distinct cuts keep spans apart.
            cuts = np.sort(rng.choice(kept + 1, size=spans, replace=False))
            source, pieces_in, pieces_out, last = tokens[row], [], [], 0
            for i, cut in enumerate(cuts):
                start = cut + i * SPAN_LENGTH
                pieces_in += [source[last:start], [self.sentinel_ids[i]]]
                pieces_out += [[self.sentinel_ids[i]], source[start:start + SPAN_LENGTH]]
                last = start + SPAN_LENGTH
            inputs[row] = np.concatenate(pieces_in + [source[last:kept + spans * SPAN_LENGTH], [self.eos_id]])
            spelled = np.concatenate(pieces_out + [[self.eos_id]])
            targets[row, :len(spelled)] = spelled
        return torch.from_numpy(inputs), torch.from_numpy(targets)


def sentinel_ids(tokenizer) -> tuple[int, ...]:
    ids = tuple(tokenizer.token_to_id(token) for token in sentinel_tokens(100))
    found = ids[:ids.index(None)] if None in ids else ids
    if not found:
        raise ValueError("data.tokenizer: the tokenizer has no sentinel tokens (<extra_id_0>, ...) for the span "
                         "corruption of model.family t5; use a T5 tokenizer or leave data.tokenizer empty to train one")
    return found


def pair_maker(cfg, tokenizer):
    """The (inputs, targets) maker of `cfg.model.family`'s text objective."""
    if objective_of(cfg.model.family) == "span_corruption":
        return SpanCorruption(sentinel_ids=sentinel_ids(tokenizer), eos_id=eos_id(tokenizer),
                              fraction=cfg.data.mask_fraction, seed=cfg.train.seed, multiple=cfg.data.length_multiple)
    if objective_of(cfg.model.family) != "masked_lm":
        return causal_lm
    return MaskedLM(mask_id=mask_id(tokenizer), vocab_size=tokenizer.get_vocab_size(), fraction=cfg.data.mask_fraction,
                    seed=cfg.train.seed)
