"""Tokenized examples, back to back: the token ids, each token's loss flag, where each example starts,
and the row it came from; and what data.overlong does with an example that does not fit a sequence.

An example of n tokens gives n - 1 (input, target) positions, so it fits one train.seq_len sequence
when n <= seq_len + 1. A longer one is, by data.overlong:

    truncate  cut to its first seq_len + 1 tokens (and left out, counted, if that leaves no target
              that carries the loss: a prompt longer than the sequence)
    drop      left out
    error     the run stops, naming its row

and the counts travel with the result (`FitCounts`), for the run's log.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.chat_masks import Encoded

ARRAYS = ("tokens", "offsets", "loss", "origins")


@dataclass(frozen=True)
class ExampleStore:
    tokens: np.ndarray
    """Every example's token ids, back to back (uint16, or uint32 for a vocabulary past 65535)."""
    offsets: np.ndarray
    """int64 [num_examples + 1]: example k is tokens[offsets[k]:offsets[k + 1]]."""
    loss: np.ndarray
    """bool, one per token: whether it is a target that carries the loss."""
    origins: np.ndarray
    """int64 [num_examples, 2]: (index into `sources`, row number) of each example."""
    sources: tuple[str, ...]
    """The files (or named source) the rows came from."""

    @property
    def num_examples(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, loss flags bool) of example `index`."""
        part = slice(int(self.offsets[index]), int(self.offsets[index + 1]))
        return self.tokens[part].astype(np.int64), np.asarray(self.loss[part], dtype=bool)

    def where(self, index: int) -> str:
        source, row = self.origins[index]
        return f"{self.sources[source]} row {row}"

    def sha256(self) -> str:
        hasher = hashlib.sha256()
        for name in ARRAYS:
            hasher.update(np.ascontiguousarray(getattr(self, name)).tobytes())
        return hasher.hexdigest()

    def select(self, indices: np.ndarray, max_tokens: int | None = None) -> ExampleStore:
        """The examples `indices`, in that order, each cut to its first `max_tokens` tokens."""
        starts = self.offsets[indices]
        lengths = self.lengths[indices] if max_tokens is None else np.minimum(self.lengths[indices], max_tokens)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return ExampleStore(tokens=self.tokens[positions], offsets=offsets, loss=self.loss[positions],
                            origins=self.origins[indices], sources=self.sources)

    def save(self, directory: Path, prefix: str = "") -> None:
        for name in ARRAYS:
            np.save(directory / f"{prefix}{name}.npy", getattr(self, name))


def load_store(directory: Path, sources: list[str], prefix: str = "") -> ExampleStore:
    arrays = {name: np.load(directory / f"{prefix}{name}.npy", mmap_mode="r") for name in ARRAYS}
    return ExampleStore(**arrays, sources=tuple(sources))


def store_of(encoded: list[Encoded], origins: list[tuple[int, int]], sources: list[str],
             vocab_size: int) -> ExampleStore:
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32
    offsets = np.concatenate([[0], np.cumsum([len(example.ids) for example in encoded])]).astype(np.int64)
    tokens = np.concatenate([example.ids for example in encoded]).astype(dtype) if encoded else np.zeros(0, dtype)
    loss = np.concatenate([example.loss for example in encoded]) if encoded else np.zeros(0, bool)
    loss[offsets[:-1]] = False  # nothing predicts an example's first token
    return ExampleStore(tokens=tokens, offsets=offsets, loss=loss,
                        origins=np.asarray(origins, dtype=np.int64).reshape(-1, 2), sources=tuple(sources))


# ---- data.overlong ----

@dataclass(frozen=True)
class FitCounts:
    """What data.overlong did: the examples read, how many were longer than a sequence, what became of them."""

    examples: int
    overlong: int = 0
    truncated: int = 0
    dropped: int = 0
    """Left out: overlong with data.overlong = "drop", or truncated to no target that carries the loss."""

    def __add__(self, other: FitCounts) -> FitCounts:
        return FitCounts(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.examples, self.overlong, self.truncated, self.dropped

    def describe(self, seq_len: int, action: str) -> str:
        if not self.overlong:
            return f"none longer than train.seq_len + 1 = {seq_len + 1} tokens"
        left_out = f" ({self.dropped} then had no target with loss and were left out)" if self.dropped else ""
        done = f"{self.truncated} truncated{left_out}" if action == "truncate" else f"{self.dropped} dropped"
        return (f"{self.overlong} longer than train.seq_len + 1 = {seq_len + 1} tokens: {done} "
                f"(data.overlong = {action})")


def fit_to_sequence(stores: list[ExampleStore], seq_len: int,
                    action: str) -> tuple[list[ExampleStore], FitCounts]:
    """The examples that fit one sequence of `seq_len` positions, by data.overlong (module docstring).
    `stores` are parallel (a preference set's chosen and rejected): example k is long if it is long in any,
    and kept or left out in all."""
    overlong_in = [store.lengths > seq_len + 1 for store in stores]
    overlong = np.flatnonzero(np.logical_or.reduce(overlong_in))
    if len(overlong) and action == "error":
        first = int(overlong[0])
        store = next(store for store, long in zip(stores, overlong_in) if long[first])
        raise ValueError(f"data.overlong = 'error': {store.where(first)} is {int(store.lengths[first])} tokens, more "
                         f"than one sequence holds (train.seq_len + 1 = {seq_len + 1}); use data.overlong = "
                         '"truncate" or "drop", or a longer train.seq_len')
    num_examples = stores[0].num_examples
    if action == "drop":
        kept = np.setdiff1d(np.arange(num_examples), overlong)
        return [store.select(kept) for store in stores], FitCounts(num_examples, len(overlong), 0, len(overlong))
    cut = [store.select(np.arange(num_examples), max_tokens=seq_len + 1) for store in stores]
    with_loss = np.flatnonzero(np.logical_and.reduce([loss_tokens(store) > 0 for store in cut]))
    counts = FitCounts(num_examples, len(overlong), len(overlong), num_examples - len(with_loss))
    return [store.select(with_loss) for store in cut], counts


def loss_tokens(store: ExampleStore) -> np.ndarray:
    """int64 [num_examples]: each example's targets that carry the loss (its first token never does)."""
    if store.num_examples == 0:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(np.asarray(store.loss, dtype=np.int64), store.offsets[:-1])
