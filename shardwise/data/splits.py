"""The held-out validation split (data.val_fraction) and the loaders of both splits.

The validation split is the end of the token stream: the last round(val_fraction x tokens)
tokens, never trained on. Cutting the stream (not sampling windows) keeps the two splits free
of shared text, and depends on nothing but the data and the fraction, so every layout and every
resume sees the same split. The training loader's state records its token count, so a resume
with another fraction (which would reorder training) is refused.

Evaluation reads the first `train.eval_batches` global batches of the validation loader's
seeded order, the same ones every time, each data-parallel rank its slice as in training.
"""

from __future__ import annotations

import dataclasses

from shardwise.config.schema import Config
from shardwise.data.loader import TokenLoader, check_one_batch
from shardwise.data.objectives import causal_lm
from shardwise.data.prepare import TokenFile


def split_tokens(tokens: TokenFile, val_fraction: float) -> tuple[TokenFile, TokenFile | None]:
    """(training tokens, validation tokens or None when val_fraction is 0)."""
    num_val = round(tokens.num_tokens * val_fraction)
    if num_val == 0:
        return tokens, None
    num_train = tokens.num_tokens - num_val
    return (dataclasses.replace(tokens, tokens=tokens.tokens[:num_train]),
            dataclasses.replace(tokens, tokens=tokens.tokens[num_train:]))


def build_loaders(cfg: Config, tokens: TokenFile, *, dp_rank: int = 0, dp_size: int = 1,
                  make_pair=causal_lm) -> tuple[TokenLoader, TokenLoader | None]:
    """The training loader and, with data.val_fraction > 0, the validation loader; an evaluation
    that needs more sequences than the validation split holds is refused here, before any work."""
    train_tokens, val_tokens = split_tokens(tokens, cfg.data.val_fraction)
    settings = dict(seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
                    micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed,
                    vocab_size=cfg.model.vocab_size, dp_rank=dp_rank, dp_size=dp_size, make_pair=make_pair)
    train_loader = TokenLoader(train_tokens, **settings)
    check_one_batch(cfg, train_loader.num_windows, f"{train_tokens.num_tokens} tokens, {train_loader.num_windows} "
                                                   f"sequences of train.seq_len = {cfg.train.seq_len}")
    if cfg.data.val_fraction and val_tokens is None:
        raise ValueError(f"data.val_fraction = {cfg.data.val_fraction} holds out no token of the {tokens.num_tokens}; "
                         "use a larger data.val_fraction")
    if val_tokens is None:
        return train_loader, None
    needed = cfg.train.eval_batches * cfg.train.global_batch_size
    available = (val_tokens.num_tokens - 1) // cfg.train.seq_len
    if needed > available:
        most = available // cfg.train.global_batch_size
        raise ValueError(
            f"train.eval_batches = {cfg.train.eval_batches} needs {needed} sequences of {cfg.train.seq_len} tokens but "
            f"the validation split (data.val_fraction = {cfg.data.val_fraction}, {val_tokens.num_tokens} tokens) holds "
            f"{available}; use train.eval_batches <= {most} or a larger data.val_fraction"
            if most else
            f"data.val_fraction = {cfg.data.val_fraction} holds out {val_tokens.num_tokens} tokens, fewer than one "
            f"global batch of {cfg.train.global_batch_size} x {cfg.train.seq_len}; use a larger data.val_fraction")
    return train_loader, TokenLoader(val_tokens, **settings)
