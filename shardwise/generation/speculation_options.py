"""`--speculate` and `--num-speculative-tokens` checked into `SpeculationOptions`, without torch: the
CLI builds its parsers and checks these flags before anything imports torch (the planner's commands
run where torch is not installed). The engine's side is `speculation.py`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECULATE_KINDS = ("ngram", "draft:RUN")
MAX_SPECULATIVE_TOKENS = 16
"""A larger K verifies mostly rejected tokens: each costs a column of the verify step."""
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 8, "draft": 4}
"""The most tokens proposed a step, by proposer (k adapts below it per sequence: `speculation.POLICY`).
ngram 8: benchmarks/speculation.py's copy prompts, demo target, batch 1, greedy (2026-11-28, Xeon-2-AMX,
1 thread): target steps per generated token at K = 4, 6, 8, 12, 16 with k fixed 0.651, 0.624, 0.612,
0.600, 0.592, with `POLICY`'s replayed speedup 1.64 (K 4), 1.69 (8), 1.68 (10), 1.72 (16); 8 as the
verify step grows with its width (width 9: 1.5 plain steps, 17: 1.8) and gains little above it on
prompts that copy less. A draft model's 4: each proposal costs a draft step, and its acceptance
(0.60) keeps its rounds short."""
SPECULATION_MAX_BATCH = {"ngram": 2, "draft": 1}
"""Decoding sequences above which a step decodes plainly, by proposer. Measured with
benchmarks/speculation.py's `batch_sweep` (2026-11-27, commit 4332c71, Xeon-2-AMX, 1 thread, shared
with other work; demo model trained 1,200 steps, debug draft 2,400 steps, copying prompts,
acceptance 0.53 ngram / 0.60 draft), speculative / plain tokens per second at 1, 2, 4, 8 sequences
in two runs: ngram 1.31 / 1.37, 1.10 / 1.08, 0.91 / 0.91, 0.81 / 0.83; draft 1.02 / 1.08,
0.83 / 0.80, 0.91 / 0.77, 0.63 / 0.57. Again at ngram K 8 (2026-11-28, commit ded96dd, nothing
else running) at 2 and 4 sequences: ngram 1.23 / 1.03, draft 0.84 / 0.77. A step of several rows
already multiplies several rows per weight read, which is what verifying K+1 tokens of one row buys."""


@dataclass(frozen=True)
class SpeculationOptions:
    """`--speculate` and `--num-speculative-tokens`, checked."""

    kind: str  # "ngram" or "draft"
    num_tokens: int | None = None  # None: DEFAULT_SPECULATIVE_TOKENS of the kind
    draft_run: Path | None = None
    max_batch: int | None = None  # None: SPECULATION_MAX_BATCH of the kind

    def __post_init__(self):
        if self.num_tokens is None:
            object.__setattr__(self, "num_tokens", DEFAULT_SPECULATIVE_TOKENS[self.kind])

    @property
    def batch_cutoff(self) -> int:
        return SPECULATION_MAX_BATCH[self.kind] if self.max_batch is None else self.max_batch


def speculation_options(speculate: str | None, num_tokens: int | None) -> SpeculationOptions | None:
    """The options of `--speculate VALUE --num-speculative-tokens K` (None: no speculation); a ValueError
    naming the flag and the value for what is not valid."""
    if num_tokens is not None and not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens = {num_tokens} is invalid: propose 1 to "
                         f"{MAX_SPECULATIVE_TOKENS} tokens a step")
    if speculate is None:
        if num_tokens is not None:
            raise ValueError(f"--num-speculative-tokens = {num_tokens} needs --speculate ngram or draft:RUN")
        return None
    if speculate == "ngram":
        return SpeculationOptions(kind="ngram", num_tokens=num_tokens)
    if speculate.startswith("draft:") and speculate[len("draft:"):]:
        return SpeculationOptions(kind="draft", num_tokens=num_tokens, draft_run=Path(speculate[len("draft:"):]))
    raise ValueError(f"--speculate = {speculate!r} is invalid: use ngram (prompt lookup) or draft:RUN (RUN: a "
                     "run with the same tokenizer, the draft model)")
