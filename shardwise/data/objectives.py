"""What a model learns from a window of tokens: the (inputs, targets) pair of its objective.

    causal LM (llama, gpt2)  inputs = window[:-1], targets = window[1:] (the next token)
    masked LM (bert)         inputs = window[:-1] with some tokens corrupted, targets = the original
                             token at those positions and -100 (ignored by the loss) elsewhere

Masked LM follows BERT (Devlin et al., 2019): of the chosen positions, 80% become the mask token,
10% a random token, 10% stay as they are. One thing differs on purpose: each sequence gets exactly
round(data.mask_fraction x seq_len) positions (BERT and HF's collator draw each position with that
probability). Every micro-batch then holds the same number of predicted tokens, so the mean of
the micro-batches' (and the data-parallel ranks') mean losses is the mean over the global batch,
and every layout equals one process exactly, as for the causal objective.

The draw of sample k (the loader's global sample counter) comes from a generator seeded by
(train.seed, k): the same masks whichever rank, micro-batch or resume reads the sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


MASK_TOKEN = "<mask>"
"""The mask token a tokenizer trained here for a masked LM gets (id 1, after end-of-text)."""
OTHER_MASK_TOKENS = ("[MASK]",)
"""Mask tokens of pretrained tokenizers (BERT's WordPiece), tried when MASK_TOKEN is absent."""
IGNORE_INDEX = -100
MASK_STREAM = 0x6D61736B
"""Separates the masking draws from the loader's permutations, which use (seed, epoch)."""


def objective_of(family: str) -> str:
    """The training objective of a model family."""
    return {"bert": "masked_lm", "vit": "image_classification"}.get(family, "causal_lm")


def special_tokens_of(family: str) -> tuple[str, ...]:
    """Special tokens a tokenizer trained for this family needs besides end-of-text."""
    return (MASK_TOKEN,) if objective_of(family) == "masked_lm" else ()


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


def pair_maker(cfg, tokenizer):
    """The (inputs, targets) maker of `cfg.model.family`'s text objective."""
    if objective_of(cfg.model.family) != "masked_lm":
        return causal_lm
    return MaskedLM(mask_id=mask_id(tokenizer), vocab_size=tokenizer.get_vocab_size(), fraction=cfg.data.mask_fraction,
                    seed=cfg.train.seed)
