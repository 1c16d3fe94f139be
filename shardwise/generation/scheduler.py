"""Which sequences the engine's next step runs: the batching policy alone, without torch, threads
or a model (the engine is the loop around it, `runner` runs the model).

State: the waiting line (first come, first served), one KV-cache slot per running sequence, and
the sequences whose clients went away. Each engine step asks, in this order:
1. `take_cancelled`: the cancelled sequences, taken out of the waiting line; the engine ends them,
   and `free` gives their slots back at once;
2. `admit`: waiting sequences into the free slots, lowest slot first; a sequence keeps its slot
   until it ends;
3. `prefill_batch`: prompt tokens of the prefilling sequences in arrival order, at most
   `prefill_chunk` a step, so a long prompt is prefilled over several steps and never stalls the
   running decodes for longer than one chunk. An encoder's prompt (`whole_prompts`: its attention
   is bidirectional) is taken whole: whole prompts while the budget lasts, at least one;
4. `decode_batch`, after the prefill ran (a prompt finished now decodes in the same step): one
   token for every running sequence whose prompt is cached, as rows 0..n-1 of the cache, n the
   highest such slot + 1 rounded up to a power of two (at most the slots), so that a compiled
   decode step sees few distinct shapes.
`prefilled`, `started` and `decoded` then count what the runner wrote into the cache.

Nothing is ever preempted: a slot holds a whole context, so a running sequence cannot run out of
cache; sequences beyond the slots wait (the server bounds that line: `--max-queue`, then 429).

The engine calls `add`, `cancel`, `take_cancelled`, `take_waiting` and `admit` under its lock
(requests come from other threads); the rest only from the thread that steps.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

from shardwise.generation.sequence import Sequence


class PrefillRow(NamedTuple):
    """One row of a prefill step: the next `num_tokens` prompt tokens of `seq`, from `seq.num_cached`."""

    seq: Sequence
    num_tokens: int


@dataclass
class DecodeBatch:
    """The sequences of a decode step, in slot order (row = slot), and the rows the step runs."""

    seqs: list[Sequence]
    num_rows: int


class Scheduler:
    def __init__(self, num_slots: int, *, prefill_chunk: int, whole_prompts: bool = False):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk = {prefill_chunk} is invalid: prefill at least 1 token per step")
        self.prefill_chunk, self.whole_prompts = prefill_chunk, whole_prompts
        self.slots: list[Sequence | None] = [None] * num_slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.cancelled: set[Sequence] = set()

    # ---- the line and the slots ----
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        self.cancelled.add(seq)

    def take_cancelled(self) -> set[Sequence]:
        """The sequences cancelled since the last call, none of them left waiting."""
        cancelled, self.cancelled = self.cancelled, set()
        for seq in cancelled:
            if seq in self.waiting:
                self.waiting.remove(seq)
        return cancelled

    def take_waiting(self) -> list[Sequence]:
        """Empty the waiting line (the engine failed: they end without running)."""
        waiting, self.waiting = list(self.waiting), collections.deque()
        return waiting

    def admit(self) -> list[Sequence]:
        """Waiting sequences into free slots, in arrival order, lowest slot first; those admitted."""
        admitted = []
        for slot, occupant in enumerate(self.slots):
            if occupant is None and self.waiting:
                seq = self.waiting.popleft()
                seq.slot = slot
                self.slots[slot] = seq
                admitted.append(seq)
        return admitted

    def free(self, seq: Sequence) -> None:
        """A sequence ended: its slot (if it had one) is free for the next `admit`."""
        if seq.slot is not None:
            self.slots[seq.slot] = None
            seq.slot = None

    def running(self) -> list[Sequence]:
        return [seq for seq in self.slots if seq is not None]

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return sum(seq is not None for seq in self.slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self.cancelled or any(self.slots))

    # ---- one step ----
    def prefill_batch(self) -> list[PrefillRow]:
        """The prefilling sequences' next tokens, in arrival order, within the chunk budget."""
        budget, batch = self.prefill_chunk, []
        for seq in sorted((s for s in self.running() if s.prefilling), key=lambda s: s.id):
            left = len(seq.prompt_ids) - seq.num_cached
            if budget <= 0 or (self.whole_prompts and batch and left > budget):
                break
            take = left if self.whole_prompts else min(budget, left)
            batch.append(PrefillRow(seq, take))
            budget -= take
        return batch

    def prefilled(self, batch: list[PrefillRow]) -> list[int]:
        """Count each row's tokens as cached; the rows whose prompt is now whole (they sample a token)."""
        done = []
        for row, (seq, take) in enumerate(batch):
            seq.num_cached += take
            if not seq.prefilling:
                done.append(row)
        return done

    def started(self, seqs: list[Sequence]) -> None:
        """An encoder-decoder's sequences whose prompts were encoded: the prompt sits before the
        decoder's position 0, and the decoder's start token is cached at that position."""
        for seq in seqs:
            seq.position_offset = len(seq.prompt_ids)
            seq.num_cached = seq.position_offset + 1

    def decode_batch(self) -> DecodeBatch | None:
        """Every running sequence with its prompt cached and a token to feed (None: none has)."""
        seqs = [seq for seq in self.running() if not seq.prefilling and seq.output_ids]
        if not seqs:
            return None
        rows_needed = max(seq.slot for seq in seqs) + 1
        return DecodeBatch(seqs, min(power_of_two_at_least(rows_needed), len(self.slots)))

    def decoded(self, batch: DecodeBatch, num_new: list[int] | None = None) -> None:
        """Count what the step cached: one token a sequence, or (a speculative step) `num_new[i]`,
        its last token and the drafts it kept."""
        for i, seq in enumerate(batch.seqs):
            seq.num_cached += 1 if num_new is None else num_new[i]


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
