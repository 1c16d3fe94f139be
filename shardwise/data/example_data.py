"""A run's chat, instruction or preference examples: from the cache (data/example_cache.py), split,
fitted to train.seq_len (data.overlong), packed or padded, and the loaders of both splits.

The validation split is the last round(data.val_fraction x examples) examples, whole, never trained
on: it depends only on the data and the fraction, as the text split does (data/splits.py). data.overlong
applies to each split alone; its counts are in the data summary (`summary`), which the run's log shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardwise.core.errors import invalid
from shardwise.data.chat_template import ChatTemplate
from shardwise.data.example_cache import cached_examples, read_entry
from shardwise.data.example_loader import ExampleLoader
from shardwise.data.example_store import ExampleStore, FitCounts, fit_to_sequence
from shardwise.data.loader import check_one_batch
from shardwise.data.packing import pack_examples, padding_fraction
from shardwise.data.prepare import TOKENIZER_FILE
from shardwise.data.tokenizer import load_tokenizer


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    meta: dict
    """The entry's meta.json: vocab_size, eos_id, num_examples, sources, chat_template, ..."""


@dataclass
class ExampleSet:
    """Chat or prompt_completion examples (one store), or preference pairs (two parallel stores:
    chosen, rejected), split and fitted to train.seq_len; rows of example indices where packed."""

    tokenizer: Tokenizer
    tokenizer_path: Path
    tokens: CacheEntry
    """What was tokenized (named so for the checks a token file gets: its meta's vocab_size)."""
    train: list[ExampleStore]
    val: list[ExampleStore] | None
    counts: FitCounts
    """What data.overlong did, both splits together."""
    train_rows: list[np.ndarray] | None = None
    val_rows: list[np.ndarray] | None = None

    @property
    def pad_id(self) -> int:
        return int(self.tokens.meta["eos_id"])

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template the rows were rendered with (None: without one), for the run to keep beside its
        tokenizer (data/chat_template.py's `save_chat_template`) so that `shardwise serve` renders alike."""
        record = self.tokens.meta.get("chat_template")
        if not record:
            return None
        return ChatTemplate(record["source"], special_tokens=record["special_tokens"], source_name=record["name"])

    def summary(self, cfg) -> str:
        """One line for the run's log: the examples, what data.overlong did, the rows and their padding."""
        data, seq_len = cfg.data, cfg.train.seq_len
        val = f", {self.val[0].num_examples} validation" if self.val else ""
        line = (f"data: {self.counts.examples} {data.format} examples ({self.train[0].num_examples} training{val}); "
                f"{self.counts.describe(seq_len, data.overlong)}")
        if data.format == "preference":
            return line
        rows = len(self.train_rows) if self.train_rows is not None else self.train[0].num_examples
        padding = padding_fraction(self.train[0], rows, seq_len)
        return f"{line}; {rows} training rows of {seq_len} ({'packed' if data.packing else 'padded'}, " \
               f"{padding:.1%} padding)"


def prepare_examples(cfg, *, verify: bool = True, announce: bool = False) -> ExampleSet:
    """The run's examples (see the module docstring); `announce`: print the summary line."""
    entry = cached_examples(cfg.data, verify=verify)
    meta, stores = read_entry(entry)
    parts = list(stores.values())
    num_examples = parts[0].num_examples
    num_val = round(num_examples * cfg.data.val_fraction)
    cut = num_examples - num_val
    seq_len, overlong = cfg.train.seq_len, cfg.data.overlong
    train, counts = fit_to_sequence([part.select(np.arange(cut)) for part in parts], seq_len, overlong)
    val = None
    if num_val:
        val, val_counts = fit_to_sequence([part.select(np.arange(cut, num_examples)) for part in parts], seq_len,
                                          overlong)
        counts = counts + val_counts
    examples = ExampleSet(tokenizer=load_tokenizer(entry / TOKENIZER_FILE), tokenizer_path=entry / TOKENIZER_FILE,
                          tokens=CacheEntry(entry, meta), train=train, val=val, counts=counts)
    if cfg.data.packing:
        examples.train_rows = pack_examples(train[0].lengths - 1, seq_len, cfg.train.seed)
        examples.val_rows = pack_examples(val[0].lengths - 1, seq_len, cfg.train.seed) if val else None
    if announce:
        print(examples.summary(cfg), flush=True)
    return examples


def build_example_loaders(cfg, examples: ExampleSet, *, dp_rank: int = 0,
                          dp_size: int = 1) -> tuple[ExampleLoader, ExampleLoader | None]:
    """The training loader and, with data.val_fraction > 0, the validation loader; a split too small for
    one global batch (training) or train.eval_batches of them (validation) is refused here."""
    settings = dict(seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
                    micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, pad_id=examples.pad_id,
                    dp_rank=dp_rank, dp_size=dp_size)
    train = ExampleLoader(examples.train[0], examples.train_rows, **settings)
    check_one_batch(cfg, train.num_windows, f"{examples.train[0].num_examples} examples in {train.num_windows} rows "
                                            f"of train.seq_len = {cfg.train.seq_len}")
    if cfg.data.val_fraction and not examples.val:
        raise invalid("data.val_fraction", cfg.data.val_fraction,
                      f"it holds out none of the {examples.counts.examples} examples; use a larger data.val_fraction")
    if not examples.val:
        return train, None
    val = ExampleLoader(examples.val[0], examples.val_rows, **settings)
    needed = cfg.train.eval_batches * cfg.train.global_batch_size
    if needed > val.num_windows:
        raise invalid("train.eval_batches", cfg.train.eval_batches,
                      f"it needs {needed} rows but the validation split (data.val_fraction = {cfg.data.val_fraction}) "
                      f"holds {val.num_windows}; use train.eval_batches <= "
                      f"{val.num_windows // cfg.train.global_batch_size} or a larger data.val_fraction")
    return train, val
