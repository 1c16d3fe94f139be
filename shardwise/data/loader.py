"""Stateful, rank-aware batches of token windows: the same global batch for 1 or N ranks.

The token stream is cut into `num_windows = (num_tokens - 1) // seq_len` non-overlapping
windows of seq_len + 1 tokens; window w starts at token w * seq_len. The objective
(data/objectives.py) makes each window's (inputs, targets): for a causal LM its first seq_len
tokens and its last seq_len (shifted by one), for a masked LM its first seq_len tokens, some
masked, and the tokens they hid.

Sample k of the run (a global counter) is window `perm_e[k % num_windows]` with
e = k // num_windows, where perm_e is a permutation drawn from a numpy Generator seeded
by (seed, e): every rank computes the same order without talking to the others.

Step s consumes samples s*G .. s*G + G - 1 (G = global_batch_size). Rank r of dp owns the
contiguous slice [r*G/dp, (r+1)*G/dp) and cuts it into micro-batches of micro_batch_size
consecutive samples, so concatenating the ranks' micro-batches gives the 1-rank global
batch: the parity tests compare exactly that. The state is the global step, which stays
meaningful when the data-parallel size changes between save and resume.
"""

from __future__ import annotations

import numpy as np
import torch

from shardwise.core.errors import invalid
from shardwise.data.objectives import causal_lm
from shardwise.data.prepare import TokenFile

STATE_VERSION = 1


class TokenLoader:
    def __init__(self, tokens: TokenFile, *, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 seed: int, dp_rank: int = 0, dp_size: int = 1, vocab_size: int | None = None,
                 make_pair=causal_lm):
        """`make_pair(windows [n, seq_len + 1], sample indices [n]) -> (inputs, targets)`: the objective."""
        check_fits(tokens, seq_len, vocab_size)
        self.tokens = tokens
        self.set_order(seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                       seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_windows=(tokens.num_tokens - 1) // seq_len,
                       make_pair=make_pair, data_sha256=tokens.meta["sha256"], data_size=tokens.num_tokens)

    def set_order(self, *, seq_len: int, global_batch_size: int, micro_batch_size: int, seed: int, dp_rank: int,
                  dp_size: int, num_windows: int, make_pair, data_sha256: str, data_size: int) -> None:
        """The sampling state every loader shares (checked first): `num_windows` samples in a seeded
        order, this rank's slice of each global batch, the objective, and what the saved state names."""
        check_batch_layout(global_batch_size, micro_batch_size, dp_rank, dp_size)
        check_seed(seed)
        self.seq_len = int(seq_len)
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.seed = int(seed)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.num_windows = num_windows
        self.make_pair = make_pair
        self.data_sha256, self.data_size = data_sha256, data_size
        self._step = 0
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def step(self) -> int:
        """Steps consumed so far (the index of the step `next_step` returns next)."""
        return self._step

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on this rank (the gradient-accumulation count)."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next step: (inputs, targets), int64 [micro_batch_size, seq_len]."""
        self._step += 1
        return self.batch_of_step(self._step - 1)

    def batch_of_step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of step `step` (0-based), without moving the loader's position."""
        samples_per_rank = self.global_batch_size // self.dp_size
        first = step * self.global_batch_size + self.dp_rank * samples_per_rank
        samples = np.arange(first, first + samples_per_rank)
        windows = self.windows_of_samples(samples)
        micro_batches = []
        for start in range(0, samples_per_rank, self.micro_batch_size):
            chunk = slice(start, start + self.micro_batch_size)
            micro_batches.append(self.make_pair(self.read_windows(windows[chunk]), samples[chunk]))
        return micro_batches

    def windows_of_samples(self, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(samples, self.num_windows)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            windows[in_epoch] = self.permutation(int(epoch))[positions[in_epoch]]
        return windows

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            # One step spans at most two epochs (unless G > num_windows); older ones are done with.
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_windows)
        return self._permutations[epoch]

    def read_windows(self, windows: np.ndarray) -> torch.Tensor:
        offsets = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return torch.from_numpy(self.tokens.tokens[offsets].astype(np.int64))

    def state_dict(self) -> dict:
        """JSON-serialisable position; rank-independent, so any dp size can resume from it."""
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "samples_consumed": self._step * self.global_batch_size,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "data_sha256": self.data_sha256,
            "num_tokens": self.data_size,  # tokens, or images for an image loader
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues where `state` was saved: the next batches equal an uninterrupted run's."""
        missing = [key for key in ("step", "seed", "seq_len", "global_batch_size", "data_sha256") if key not in state]
        if missing:
            raise ValueError(f"data loader state: missing {', '.join(missing)}; resume from a checkpoint shardwise wrote")
        current = self.state_dict()
        for key, field in (("seq_len", "train.seq_len"), ("global_batch_size", "train.global_batch_size"),
                           ("seed", "train.seed"), ("data_sha256", "data (data.* settings and unchanged files)"),
                           ("num_tokens", "data.val_fraction (it sets the training split's size)")):
            if key in state and state[key] != current[key]:
                raise ValueError(
                    f"data loader state: {key} = {state[key]!r} in the checkpoint but {current[key]!r} now; "
                    f"resume with the same {field} or start a new run"
                )
        self._step = int(state["step"])


def is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_batch_layout(global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    for name, value in (("train.global_batch_size", global_batch_size), ("train.micro_batch_size", micro_batch_size),
                        ("parallel.dp", dp_size)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} = {value!r} is invalid: use a positive integer")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"train.global_batch_size = {global_batch_size} is invalid: use a multiple of train.micro_batch_size * dp "
            f"({micro_batch_size} * {dp_size} = {micro_batch_size * dp_size})"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank = {dp_rank} is out of range for dp_size = {dp_size}; use 0 <= dp_rank < dp_size")


def check_seed(seed: int) -> None:
    if not is_integer(seed) or seed < 0:
        raise ValueError(f"train.seed = {seed!r} is invalid: use a non-negative integer")


def check_fits(tokens: TokenFile, seq_len: int, vocab_size: int | None) -> None:
    if not is_integer(seq_len) or seq_len < 1:
        raise ValueError(f"train.seq_len = {seq_len!r} is invalid: use a positive integer")
    if (tokens.num_tokens - 1) // seq_len == 0:
        raise ValueError(
            f"train.seq_len = {seq_len} is longer than the corpus ({tokens.num_tokens} tokens); "
            "use a shorter train.seq_len or more data"
        )
    max_token_id = tokens.meta["max_token_id"]
    if vocab_size is not None and max_token_id >= vocab_size:
        raise ValueError(
            f"data: token id {max_token_id} is outside the model vocabulary ({vocab_size}); "
            f"use model.vocab_size >= {max_token_id + 1} or re-tokenize"
        )


def check_one_batch(cfg, num_samples: int, what: str) -> None:
    """Refuse training data that holds fewer samples than one global batch: the loader would repeat
    samples within a step, every step, and train on far less data than asked without a word."""
    if num_samples >= cfg.train.global_batch_size:
        return
    held_out = f" after data.val_fraction = {cfg.data.val_fraction}" if cfg.data.val_fraction else ""
    raise invalid("train.global_batch_size", cfg.train.global_batch_size,
                  f"one step needs that many samples, but the training data (data.source {cfg.data.source!r}"
                  f"{held_out}) holds {what}; use train.global_batch_size <= {num_samples} (a multiple of "
                  f"train.micro_batch_size), a shorter train.seq_len, or more data (data.source, data.max_corpus_bytes)")
