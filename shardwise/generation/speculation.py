"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the model.

A decode step of a sequence whose last token is x_{L-1} (its keys not cached yet) normally feeds
x_{L-1} and samples one token. With a proposal d_1..d_k it feeds [x_{L-1}, d_1, ..., d_k] at
positions L-1..L+k-1 in one forward (`verify_rows`: every position's logits, `runner.forward(...,
every_position=True)`), keeps the longest accepted prefix d_1..d_a and one more token from the
target model (the correction at the first rejection, or a bonus token after the last draft): 1 to
k+1 tokens for one forward of the model, whose weights are read once either way.

Two proposers (`--speculate`):
- `ngram` (prompt lookup, no draft model): the tokens that followed the latest earlier
  occurrence of the last n-gram (n = NGRAM_MAX down to 1) of prompt + output (`NgramIndex`).
  Code edits, which copy the prompt, are its case.
- `draft:RUN` (`DraftProposer`): a smaller run with the same tokenizer runs k decode steps of its
  own over a KV cache with the same slots as the target's, prefilled with the same prompt chunks.

Exactness (`accept_row`): a greedy row keeps d_j while it is the target's argmax, so its output is
plain decoding's token for token. A sampled row uses rejection sampling (Leviathan et al. 2023,
Chen et al. 2023): d_j ~ q is kept with probability min(1, p(d_j) / q(d_j)); at the first rejection
the token is drawn from norm(max(p - q, 0)); after k kept, the bonus token from p. The output is
then distributed as the target's p (temperature, top-k, top-p, logit_bias all in p). For the ngram
proposer q is a point mass at d_j: keep with probability p(d_j), else draw from p with d_j removed.
A sequence with presence/frequency penalties (p of position j would depend on the drafts before
it) or asking for logprobs (the draft tokens carry none) decodes plainly: no proposals.

Nothing is rolled back after a rejection: position p of a sequence lives at column p of its slot,
so the rejected columns are overwritten by later steps before any query reads them (`num_cached`
is the truth). The draft's cache is kept consistent the same way (`SequenceSpeculation.draft_cached`).

When it pays (`Speculator.proposals`): up to SPECULATION_MAX_BATCH decoding sequences (above it a
step's rows already share each weight read and a wider verify step costs more than it saves:
measured, benchmarks/speculation.py); per sequence, k adapts (after a partial round: kept + 1;
after a full one: k + 1 for a draft model, 2k for ngram), and rounds that keep fewer drafts than
pay for them make the sequence decode plainly for a while, doubling (`POLICY`), so that a sequence
whose proposals are never accepted verifies in a few of its steps (about log2(tokens)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.generation.runner import key_bucket
from shardwise.generation.sampling import GREEDY_BELOW, SamplingParams, adjusted_logits, sampling_probs
from shardwise.generation.sequence import Sequence
from shardwise.generation.slot_cache import StepRows
from shardwise.generation.speculation_options import SpeculationOptions

NGRAM_MAX = 3
"""The longest n-gram looked up (vLLM's prompt_lookup_max default is 3 too)."""
MAX_BACKOFF_STEPS = 128


@dataclass(frozen=True)
class RoundPolicy:
    """How a proposer's k and back-off follow its rounds (`SequenceSpeculation.record`)."""

    break_even: float  # a round that keeps fewer than break_even x k drafts is lost
    doubles: bool  # after a fully accepted round k doubles (else k + 1), up to --num-speculative-tokens
    free_misses: int  # lost rounds in a row before the back-off starts
    first_skip: int  # plain steps after the first lost round past those; doubling, at most MAX_BACKOFF_STEPS


POLICY = {"ngram": RoundPolicy(break_even=0.05, doubles=True, free_misses=2, first_skip=1),
          "draft": RoundPolicy(break_even=0.4, doubles=False, free_misses=0, first_skip=4)}
"""A round of k drafts that keeps a of them gains a + 1 tokens; after a partial one k becomes a + 1.

draft: its verify step costs about 1 + 0.03k plain steps and its k steps 0.36 of a plain step each
(demo target, debug draft, eager, 2026-11-27, Xeon-2-AMX, 1 thread): it pays when a >= 0.4k; a lost
round backs off 4, 8, 16, ... plain steps. With --compile (2026-11-28, same machine, commit 9682507):
a plain step 1.28 ms, verify widths 2, 3, 5, 9: 1.18, 1.22, 1.28, 1.59 plain steps, the draft's
step 0.34 ms (0.26 of a plain step; in the engine 0.28 ms vs 1.10 ms): a round of 4 costs about 2.3
plain steps, so the same 0.4 holds.

ngram: its proposals cost nothing, but the verify step grows with its width (demo target, eager,
1 thread, CPU time per step relative to width 1, 2026-11-28, Xeon-2-AMX under other work: width
2, 3, 5, 9, 17: 1.05, 1.04, 1.18, 1.50, 1.78), so after a rejection it probes with one draft
(k = a + 1 = 1, a step of width 2), two such lost probes are free, then it backs off 1, 2, 4, ...
steps; a fully accepted round doubles k (a loop or a copied stretch goes on). Chosen by replaying
benchmarks/speculation.py's six copy prompts' greedy outputs (greedy acceptance is fixed by the
output) under each policy with those costs (+0.05 a verify step): target steps per generated token,
modeled speedup / never-accepted ratio, K = 8: fixed k with the 4, 8, 16 back-off 0.612, 1.46 / 0.98;
this policy 0.527, 1.69 / 0.99 (K = 4, 10, 16: 1.64, 1.68, 1.72; first skip 2: 1.50; one free miss:
1.56; +0.15 a verify step: 1.59 / 0.98)."""


@dataclass(eq=False)
class SequenceSpeculation:
    """One sequence's speculation: its adaptive k, its counts, its n-gram index, its draft's cache."""

    k: int
    proposed: int = 0
    accepted: int = 0
    misses: int = 0  # lost rounds in a row (`RoundPolicy.break_even`)
    skip_steps: int = 0  # plain steps left before the next proposal
    draft_cached: int = 0  # positions whose keys the draft model holds in the slot
    ngrams: "NgramIndex" = field(default_factory=lambda: NgramIndex())

    def record(self, num_proposed: int, num_accepted: int, max_k: int, policy: RoundPolicy) -> None:
        """Count a round, adapt k, and back off after lost rounds (`POLICY`)."""
        self.proposed += num_proposed
        self.accepted += num_accepted
        if num_accepted < num_proposed:
            self.k = num_accepted + 1
        else:
            self.k = min(max_k, 2 * num_proposed if policy.doubles else num_proposed + 1)
        if num_accepted >= policy.break_even * num_proposed:
            self.misses = 0
            return
        self.misses += 1
        if self.misses > policy.free_misses:
            self.skip_steps = min(policy.first_skip << (self.misses - 1 - policy.free_misses), MAX_BACKOFF_STEPS)


def acceptance_rate(seq: Sequence) -> float | None:
    """Accepted / proposed draft tokens of a sequence (None: none proposed)."""
    state = seq.speculation
    return state.accepted / state.proposed if state is not None and state.proposed else None


class NgramIndex:
    """Where each n-gram (n = 1..NGRAM_MAX) of a token list last ended, kept up to date as tokens
    are appended, so a lookup costs O(new tokens), not O(length)."""

    def __init__(self):
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # grams ending before this index are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix n-gram of `tokens`
        that occurred before ([] when none did), as a copy that may overlap itself (`repeated`)."""
        for end in range(self.indexed + 1, len(tokens)):  # every gram but those ending at the end
            for n in range(1, min(NGRAM_MAX, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)
        for n in range(min(NGRAM_MAX, len(tokens)), 0, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return repeated(tokens, end, k)
        return []


def repeated(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens guessing that `tokens` goes on as it went on from `start`: tokens[start:], then, past
    the end, the guess itself (an LZ77 copy overlapping itself). A latest occurrence close to the end
    is a loop of period len(tokens) - start ("#\\n#\\n", a run of blank lines), whose continuation is
    the same loop: without this the proposal stopped at the end, one or two tokens for a whole step
    (benchmarks/speculation.py's demo target loops like that in most of its answers)."""
    guess = tokens[start:start + k]
    period = len(tokens) - start
    while len(guess) < k:
        guess.append(guess[len(guess) - period])
    return guess


def tokens_of(seq: Sequence) -> list[int]:
    return seq.prompt_ids + seq.output_ids


def speculates(params: SamplingParams) -> bool:
    """Whether a request's sequence may be given proposals (see the module docstring)."""
    return not (params.presence_penalty or params.frequency_penalty or params.logprobs is not None)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


@dataclass
class Proposal:
    """Draft tokens for one sequence and, from a draft model that sampled them, their
    distributions q [k, vocab] (None: point masses, or greedy)."""

    tokens: list[int]
    q_KV: torch.Tensor | None = None


def accept_row(logits_SV: torch.Tensor, proposal: Proposal, params: SamplingParams,
               generator: torch.Generator) -> list[int]:
    """The tokens a verified row keeps: the accepted drafts, then the target's own token (the
    correction at the first rejection, or the bonus after the last draft). `logits_SV` holds the
    target's logits after the row's last token and after each draft (k + 1 positions)."""
    drafts = proposal.tokens
    k = len(drafts)
    logits = logits_SV[:k + 1]
    if params.logit_bias:  # the only adjustment of a speculating row (no penalties: `speculates`)
        logits = adjusted_logits(logits.clone(), [params] * (k + 1), [None] * (k + 1))
    if is_greedy(params):
        target = logits.argmax(dim=-1).tolist()
        kept = next((j for j in range(k) if drafts[j] != target[j]), k)
        return drafts[:kept] + [target[kept]]
    p_SV = sampling_probs(logits, [params] * (k + 1))
    device = p_SV.device
    draft_ids = torch.tensor(drafts, device=device)
    p_of_drafts = p_SV[torch.arange(k, device=device), draft_ids]
    q_of_drafts = torch.ones_like(p_of_drafts) if proposal.q_KV is None else \
        proposal.q_KV[torch.arange(k, device=device), draft_ids]
    uniform = torch.rand(k, generator=generator, device=device)
    kept_K = (uniform * q_of_drafts < p_of_drafts).tolist()  # u < p/q, without dividing by q = 0
    kept = next((j for j in range(k) if not kept_K[j]), k)
    if kept == k:
        return drafts + [int(torch.multinomial(p_SV[k], 1, generator=generator))]
    return drafts[:kept] + [int(torch.multinomial(residual(p_SV[kept], proposal, kept), 1, generator=generator))]


def residual(p_V: torch.Tensor, proposal: Proposal, j: int) -> torch.Tensor:
    """norm(max(p - q, 0)) at a rejected draft j (multinomial normalises); q a point mass at the
    draft for the ngram proposer. A rejection implies p != q, so some mass is left."""
    if proposal.q_KV is None:
        left = p_V.clone()
        left[proposal.tokens[j]] = 0
    else:
        left = (p_V - proposal.q_KV[j]).clamp(min=0)
    return left if float(left.sum()) > 0 else p_V


def verify_rows(seqs: list[Sequence], proposals: dict[Sequence, Proposal], num_rows: int, capacity: int,
                device: torch.device) -> tuple[torch.Tensor, StepRows]:
    """The verify step's tokens [num_rows, 1 + longest proposal] and rows: row = slot (as a decode
    step's), each sequence's last token then its drafts at their positions; padding (and idle rows)
    writes the scratch column."""
    width = 1 + max(len(p.tokens) for p in proposals.values())
    tokens = torch.zeros(num_rows, width, dtype=torch.long)
    positions = torch.zeros(num_rows, width, dtype=torch.long)
    write = torch.full((num_rows, width), capacity, dtype=torch.long)
    longest = 0
    for seq in seqs:
        fed = [seq.output_ids[-1], *(proposals[seq].tokens if seq in proposals else ())]
        start = seq.num_cached - seq.position_offset
        tokens[seq.slot, :len(fed)] = torch.tensor(fed)
        positions[seq.slot, :len(fed)] = write[seq.slot, :len(fed)] = torch.arange(start, start + len(fed))
        longest = max(longest, start + len(fed))
    rows = StepRows(None, positions.to(device), write.to(device), min(key_bucket(longest, device.type), capacity))
    return tokens.to(device), rows


class DraftProposer:
    """A draft model's proposals: its own runner and KV cache, with the target's slots and capacity."""

    def __init__(self, runner):
        self.runner = runner

    def prefill(self, batch) -> None:
        """The same prompt chunks as the target's prefill (`scheduler.PrefillRow`s, before they count),
        from where the draft's cache ends: a prefix the target's prefix cache restored into its slot
        (`num_cached` jumped past it) is computed here, so the draft attends a whole prompt too."""
        self.feed_eager([(seq, seq.prompt_ids[seq.speculation.draft_cached:seq.num_cached + take]) for seq, take in batch])

    def propose(self, wanted: dict[Sequence, int]) -> dict[Sequence, Proposal]:
        """k_s draft tokens for each sequence s: first the tokens its draft cache lacks (the last
        one, or more after plain steps or a fully accepted round), then one draft step per token."""
        seqs = list(wanted)
        drafts: dict[Sequence, list[int]] = {seq: [] for seq in seqs}
        dists: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in seqs}
        logits = self.feed([(seq, tokens_of(seq)[seq.speculation.draft_cached:]) for seq in seqs])
        active = seqs
        while True:
            for seq, token, q_V in zip(active, *self.choose(logits, active)):
                drafts[seq].append(token)
                if q_V is not None:
                    dists[seq].append(q_V)
            active = [seq for seq in active if len(drafts[seq]) < wanted[seq]]
            if not active:
                break
            logits = self.feed([(seq, drafts[seq][-1:]) for seq in active])
        return {seq: Proposal(drafts[seq], torch.stack(dists[seq]) if dists[seq] else None) for seq in seqs}

    def feed(self, rows: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        """Run `tokens` of each sequence at its next draft positions; logits [B, vocab] after the last.

        One or two tokens a row (a round's draft steps; the two a fully accepted round leaves) run
        laid out as the target's decode and verify steps (row = slot, idle rows writing the scratch
        column, a `key_bucket` of columns read), through the draft runner's decode step, which
        --compile compiles (width 1 its decode form, width 2 its verify form: logits at every
        position); more (the tokens of plain steps) as `feed_eager`."""
        if max(len(tokens) for _, tokens in rows) > 2:
            return self.feed_eager(rows)
        device = self.runner.device
        ids, positions, write = self.step_tensors(rows, [seq.slot for seq, _ in rows])
        key_len = min(key_bucket(max(seq.speculation.draft_cached for seq, _ in rows), device.type),
                      self.runner.capacity)
        step = StepRows(None, positions, write, key_len)
        slots = torch.tensor([seq.slot for seq, _ in rows], device=device)
        if ids.shape[1] == 1:
            return self.runner.forward(ids, step, last_index=None)[slots]
        last = torch.tensor([len(tokens) - 1 for _, tokens in rows], device=device)
        return self.runner.forward(ids, step, last_index=None, every_position=True)[slots, last]

    def feed_eager(self, rows: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        """`feed` eagerly, row b for rows[b]'s slot, logits at each row's last token only: prompt
        chunks (the first of which allocates the cache, which a compiled step must not) and the
        tokens of plain steps."""
        device = self.runner.device
        ids, positions, write = self.step_tensors(rows, list(range(len(rows))))
        key_len = max(seq.speculation.draft_cached for seq, _ in rows)
        slots = torch.tensor([seq.slot for seq, _ in rows], device=device)
        last = torch.tensor([len(tokens) - 1 for _, tokens in rows], device=device)
        return self.runner.forward(ids, StepRows(slots, positions, write, key_len), last_index=last)

    def step_tensors(self, rows: list[tuple[Sequence, list[int]]], row_of: list[int]):
        """Tokens, positions and write columns [num rows, widest], rows[i] at row row_of[i] (the
        others, and padding, write the scratch column); each sequence's draft cache counts them."""
        width, num_rows = max(len(tokens) for _, tokens in rows), 1 + max(row_of)
        ids = torch.zeros(num_rows, width, dtype=torch.long)
        positions = torch.zeros(num_rows, width, dtype=torch.long)
        write = torch.full((num_rows, width), self.runner.capacity, dtype=torch.long)
        for row, (seq, tokens) in zip(row_of, rows):
            start = seq.speculation.draft_cached
            ids[row, :len(tokens)] = torch.tensor(tokens)
            positions[row, :len(tokens)] = write[row, :len(tokens)] = torch.arange(start, start + len(tokens))
            seq.speculation.draft_cached += len(tokens)
        device = self.runner.device
        return ids.to(device), positions.to(device), write.to(device)

    @staticmethod
    def choose(logits_BV: torch.Tensor, seqs: list[Sequence]):
        """Each row's draft token, and q (the distribution it was drawn from; None: greedy)."""
        params = [seq.params for seq in seqs]
        logits = adjusted_logits(logits_BV.float(), params, [None] * len(seqs))
        tokens, dists = logits.argmax(dim=-1).tolist(), [None] * len(seqs)
        sampled = [b for b, p in enumerate(params) if not is_greedy(p)]
        if sampled:
            probs = sampling_probs(logits[sampled], [params[b] for b in sampled])
            for i, b in enumerate(sampled):
                tokens[b] = int(torch.multinomial(probs[i], 1, generator=seqs[b].generator))
                dists[b] = probs[i]
        return tokens, dists


class Speculator:
    """The engine's speculation: which sequences get proposals this step, verifying them, and the counts."""

    def __init__(self, options: SpeculationOptions, *, capacity: int, draft_runner=None):
        self.options, self.capacity = options, capacity
        self.draft = None if draft_runner is None else DraftProposer(draft_runner)

    def state(self, seq: Sequence) -> SequenceSpeculation:
        if seq.speculation is None:
            seq.speculation = SequenceSpeculation(k=self.options.num_tokens)
        return seq.speculation

    def prefill(self, batch) -> None:
        for seq, _ in batch:
            self.state(seq)
        if self.draft is not None:
            self.draft.prefill(batch)

    def room(self, seq: Sequence) -> int:
        """Drafts a sequence may take: one token of the round is always the target's, and the last
        draft's position must stay inside the context."""
        return min(seq.params.max_tokens - len(seq.output_ids) - 1,
                   self.capacity - len(seq.prompt_ids) - len(seq.output_ids))

    def proposals(self, seqs: list[Sequence]) -> dict[Sequence, Proposal]:
        """This step's proposals ({}: a plain decode step)."""
        if len(seqs) > self.options.batch_cutoff:
            return {}
        wanted = {}
        for seq in seqs:
            state = self.state(seq)
            if not speculates(seq.params):
                continue
            if state.skip_steps:
                state.skip_steps -= 1
                continue
            k = min(state.k, self.room(seq))
            if k > 0:
                wanted[seq] = k
        if not wanted:
            return {}
        if self.draft is not None:
            return self.draft.propose(wanted)
        found = {seq: seq.speculation.ngrams.propose(tokens_of(seq), k) for seq, k in wanted.items()}
        return {seq: Proposal(tokens) for seq, tokens in found.items() if tokens}

    def verified(self, seqs: list[Sequence], proposals: dict[Sequence, Proposal], logits_BSV: torch.Tensor,
                 plain_tokens) -> list[list]:
        """Each sequence's new tokens (ints for verified rows; `plain_tokens(rows)`'s TokenChoices for
        rows without a proposal), the counts recorded, the draft's cache trimmed to what is kept."""
        plain = [seq for seq in seqs if seq not in proposals]
        plain_choices = dict(zip(plain, plain_tokens(plain))) if plain else {}
        new = []
        for seq in seqs:
            if seq not in proposals:
                new.append([plain_choices[seq]])
                continue
            kept = accept_row(logits_BSV[seq.slot], proposals[seq], seq.params, seq.generator)
            state = seq.speculation
            state.record(len(proposals[seq].tokens), len(kept) - 1, self.options.num_tokens, POLICY[self.options.kind])
            # the draft keeps only positions the target keeps: all but the round's last token
            state.draft_cached = min(state.draft_cached, len(tokens_of(seq)) + len(kept) - 1)
            new.append(kept)
        return new
