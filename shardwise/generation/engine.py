"""The inference engine: continuous batching over a static-slot KV cache.

Three parts, as vLLM's engine core keeps them: the `Scheduler` decides each step which sequences
prefill (and how many prompt tokens), which decode, which wait, and frees a slot when its sequence
ends (the policy, pure: `scheduler.py`); the `ModelRunner` turns those batches into a forward and
returns logits (`runner.py`); this module is the loop between them. Each iteration (`step`):
1. end the cancelled sequences (a client that went away) and admit waiting ones into free slots;
2. prefill one chunk of prompt tokens, and sample the first token of each prompt now whole;
3. decode one token for every running sequence (with `speculator`: verify its proposed tokens too,
   one forward, several tokens a sequence: `speculation.py`);
4. hand each new token to its sequence: finished sequences free their slot at once.
With a `PrefixCache` (`prefix_cache.py`): after 1., a prefilling sequence gets the keys and values
of its prompt's cached prefix copied into its slot; in 2., a row whose next block an earlier row is
computing waits a step, and each chunk's whole blocks are stored; in 4., so are a finished one's.

The engine thread is the only one touching the model; `submit` and `cancel` may be called from
any thread. Outputs go to each sequence's `on_output` callback, in the engine thread.

A step that raises (a bug, an out-of-memory) ends only the sequences that held a slot in it, with
finish_reason "error" and an error id that the log line of the failure carries too; the waiting
ones run at later steps. Only `MAX_FAILED_STEPS` failures in a row (nothing succeeds any more: a
broken device, a lost rank) stop the engine: every sequence then ends, later submissions are
refused, and the server's /health answers 503.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from typing import Callable

import torch

from shardwise.generation.prefix_cache import PrefixCache
from shardwise.generation.runner import ModelRunner, runner_for
from shardwise.generation.sampling import InvalidRequest, SamplingParams, TokenChoice, choose_tokens
from shardwise.generation.scheduler import DecodeBatch, PrefillRow, Scheduler
from shardwise.generation.sequence import Output, Sequence
from shardwise.generation.speculation import Speculator, verify_rows
from shardwise.generation.text_stream import TextStream


LOG = logging.getLogger("shardwise.engine")
MAX_FAILED_STEPS = 3
"""Steps failing in a row after which the engine stops (each failure alone ends only its step's sequences)."""


class EngineStopped(RuntimeError):
    """A submission to an engine that has stopped or failed."""


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, *, eos_id: int | None, prefill_chunk: int = 256,
                 prefix_cache: PrefixCache | None = None, speculator: Speculator | None = None):
        self.scheduler = Scheduler(runner.cache.num_slots, prefill_chunk=prefill_chunk,
                                   whole_prompts=runner.encoder_decoder)
        self.runner, self.tokenizer, self.eos_id = runner, tokenizer, eos_id
        self.max_batch = runner.cache.num_slots  # one sequence per cache slot
        self.context_len = runner.capacity
        self.vocab_size = runner.vocab_size
        self.lock = threading.Condition()  # guards the scheduler's waiting line and cancellations
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = self.pausing = self.failed = False
        self.failed_steps = 0  # in a row
        self.serving = False  # while serve_forever steps, in whichever thread
        self.stats = collections.Counter()
        self.prefix_cache = prefix_cache  # None: every prompt is computed whole
        if speculator is not None and runner.encoder_decoder:
            raise ValueError("--speculate is invalid for an encoder-decoder run (its decoder's cache is not a "
                             "prefix of the prompt); leave --speculate out")
        self.speculator = speculator

    # ---- any thread ----
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequest (a ValueError naming the request field) for what the model cannot run."""
        if not prompt_ids:
            raise InvalidRequest("prompt is empty: give at least one token of text", param="prompt")
        if len(prompt_ids) >= self.context_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                                 f"{self.context_len}; shorten it to at most {self.context_len - 1} tokens",
                                 param="prompt")
        outside = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if outside is not None:
            raise InvalidRequest(f"prompt token id = {outside} is invalid: token ids go from 0 to "
                                 f"{self.vocab_size - 1} (the vocabulary)", param="prompt")
        params.check(self.vocab_size)

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[Output], None],
               *, choice: int = 0) -> Sequence:
        self.check_prompt(prompt_ids, params)
        stop_ids = set(params.stop_token_ids)
        if self.eos_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_id)
        seq = Sequence(list(prompt_ids), params, on_output, params.generator(self.runner.device, choice),
                       TextStream(self.tokenizer, params.stop), frozenset(stop_ids), id=next(self.ids))
        with self.lock:
            if self.failed or self.stopping:
                raise EngineStopped("the engine has stopped (see the server log); restart the server")
            self.scheduler.add(seq)
            self.lock.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        with self.lock:
            self.scheduler.cancel(seq)
            self.lock.notify()

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting()

    def num_running(self) -> int:
        return self.scheduler.num_running()

    def start(self) -> None:
        """Run `serve_forever` in a background thread until `stop` (an in-process server, as the tests
        run one). `shardwise serve` runs it in its main thread instead: see `serve_forever`."""
        self.thread = threading.Thread(target=self.serve_forever, args=(self.runner.thread_setup(),),
                                       name="shardwise-engine", daemon=True)
        self.serving = True  # already, for /health: the thread sets it too, a moment later
        self.thread.start()

    def pause(self) -> None:
        """Make `serve_forever` return after its current step (from any thread); it may be called again."""
        with self.lock:
            self.pausing = True
            self.lock.notify()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()
        self.runner.close()

    # ---- the engine thread ----
    def serve_forever(self, thread_setup=lambda: None) -> None:
        """Step whenever there is work, in the calling thread, until `pause` or `stop`.

        On CPU, call it from the thread that built the model and ran its warm-up: every thread that
        runs torch ops keeps its own OpenMP team, and with two teams on a 2-core machine each small
        op in the second thread took 2-3x longer (a 16-row matmul 42 -> 133 us; with
        OMP_WAIT_POLICY=PASSIVE the first thread slowed the same way, so the likely cause is that
        libgomp stops spinning its idle workers once it manages more threads than there are cores,
        and every parallel region then waits for a wake-up). A batch-16 decode step of the demo model
        ran ~2x slower in a second thread. `shardwise serve` therefore steps the engine in its main
        thread and runs the HTTP server (which runs no torch ops) beside it."""
        thread_setup()
        self.serving = True
        try:
            while True:
                with self.lock:
                    while not (self.stopping or self.pausing) and not self.has_work():
                        self.lock.wait()
                    if self.stopping or self.pausing:
                        self.pausing = False
                        return
                try:
                    self.step()
                    self.failed_steps = 0
                except Exception as err:  # a bug or out of memory: its step's sequences end, not the engine
                    if self.fail_step(err) >= MAX_FAILED_STEPS:
                        self.fail_all()
                        return
        finally:
            self.serving = False

    def fail_step(self, err: Exception) -> int:
        """End the sequences of the step that raised `err` with finish_reason "error" and an error id,
        the one the log line names; the steps failed in a row."""
        error_id = uuid.uuid4().hex[:12]
        failed = self.scheduler.running()
        self.failed_steps += 1
        if self.failed_steps >= MAX_FAILED_STEPS:
            with self.lock:  # before its sequences end: a request sent once they have is refused, not taken
                self.failed = True
        LOG.error("shardwise: error: engine step failed (error id %s): %s: %s; its %d sequences end with an error, "
                  "the engine goes on (%d of %d failed steps in a row)", error_id, type(err).__name__, err,
                  len(failed), self.failed_steps, MAX_FAILED_STEPS, exc_info=err)
        for seq in failed:
            seq.error_id = error_id
            self.finish(seq, "error", token=None, text="")
        return self.failed_steps

    def fail_all(self) -> None:
        """End every sequence with finish_reason "error"; later submissions are refused."""
        error_id = uuid.uuid4().hex[:12]
        LOG.error("shardwise: error: the engine stopped (error id %s) after %d failed steps in a row; restart "
                  "the server", error_id, self.failed_steps)
        with self.lock:
            self.failed = True
            waiting = self.scheduler.take_waiting()
        for seq in [*waiting, *self.scheduler.running()]:
            seq.error_id = error_id
            self.finish(seq, "error", token=None, text="")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run_until_done(self) -> None:
        """Step until every submitted sequence has ended (offline generation)."""
        while self.has_work():
            self.step()

    def step(self) -> None:
        with self.runner.no_grad():
            self.step_without_grad()

    def step_without_grad(self) -> None:
        self.end_cancelled()
        with self.lock:
            self.scheduler.admit()
        if self.prefix_cache:
            self.prefix_cache.reuse(self.scheduler.running())
        prefill = self.scheduler.prefill_batch()
        if self.prefix_cache:
            prefill = self.prefix_cache.hold_back_shared(prefill)
        if prefill:
            self.prefill(prefill)
        decoding = self.scheduler.decode_batch()  # after the prefill: a prompt cached now decodes at once
        if decoding:
            self.decode(decoding)

    def end_cancelled(self) -> None:
        with self.lock:
            cancelled = self.scheduler.take_cancelled()
        for seq in cancelled:
            if seq.finish_reason is None:
                self.finish(seq, "cancelled", token=None, text="")

    def prefill(self, batch: list[PrefillRow]) -> None:
        if self.runner.encoder_decoder:
            self.start_decoders([seq for seq, _ in batch])
            return
        logits = self.runner.prefill_logits(batch)
        if self.speculator is not None:  # before `prefilled` counts the chunk: the draft writes it too
            self.speculator.prefill(batch)
        self.stats["prefill_tokens"] += sum(take for _, take in batch)
        done = self.scheduler.prefilled(batch)
        if self.prefix_cache:
            self.prefix_cache.keep_prefilled(batch, done)
        if done:
            self.sample([batch[row].seq for row in done], logits[done])

    def start_decoders(self, seqs: list[Sequence]) -> None:
        """An encoder-decoder's prefill: each prompt through the encoder, then the decoder's start
        token (cached at decoder position 0), whose logits give the first output token."""
        logits = self.runner.start([seq.prompt_ids for seq in seqs], [seq.slot for seq in seqs])
        self.stats["prefill_tokens"] += sum(len(seq.prompt_ids) for seq in seqs)
        self.scheduler.started(seqs)
        self.sample(seqs, logits)

    def decode(self, batch: DecodeBatch) -> None:
        proposals = self.speculator.proposals(batch.seqs) if self.speculator is not None else None
        if proposals:
            self.decode_speculatively(batch, proposals)
            return
        logits = self.runner.decode_logits(batch)
        self.scheduler.decoded(batch)
        self.stats["decode_steps"] += 1
        self.sample(batch.seqs, logits[[seq.slot for seq in batch.seqs]])

    def decode_speculatively(self, batch: DecodeBatch, proposals) -> None:
        """One forward verifying every row's proposal (rows without one decode plainly in it)."""
        tokens, rows = verify_rows(batch.seqs, proposals, batch.num_rows, self.runner.capacity, self.runner.device)
        logits = self.runner.forward(tokens, rows, last_index=None, every_position=True)

        def plain_choices(seqs):
            return choose_tokens(logits[[seq.slot for seq in seqs], 0], [s.params for s in seqs],
                                 [s.generator for s in seqs], [s.counts for s in seqs])

        new = self.speculator.verified(batch.seqs, proposals, logits, plain_choices)
        self.scheduler.decoded(batch, [len(tokens) for tokens in new])
        self.stats["decode_steps"] += 1
        self.stats["draft_tokens_proposed"] += sum(len(p.tokens) for p in proposals.values())
        self.stats["draft_tokens_accepted"] += sum(len(t) - 1 for seq, t in zip(batch.seqs, new) if seq in proposals)
        for seq, choices in zip(batch.seqs, new):
            for choice in choices:
                if seq.finish_reason is not None:  # a stop among the accepted tokens ends it there
                    break
                self.append_token(seq, choice if isinstance(choice, TokenChoice) else TokenChoice(choice))

    def sample(self, seqs: list[Sequence], logits_BV: torch.Tensor) -> None:
        choices = choose_tokens(logits_BV, [s.params for s in seqs], [s.generator for s in seqs],
                                [s.counts for s in seqs])
        now = time.perf_counter()
        for seq, choice in zip(seqs, choices):
            seq.first_token_at = seq.first_token_at or now
            self.append_token(seq, choice)

    def append_token(self, seq: Sequence, choice: TokenChoice) -> None:
        token_id = choice.token_id
        seq.output_ids.append(token_id)
        self.stats["generated_tokens"] += 1
        if seq.params.presence_penalty or seq.params.frequency_penalty:
            if seq.counts is None:
                seq.counts = torch.zeros(self.vocab_size, device=self.runner.device)
            seq.counts[token_id] += 1
        if token_id in seq.stop_ids:
            self.finish(seq, "stop", token=choice, text=seq.stream.flush())
            return
        text = seq.stream.push(token_id)
        if seq.stream.stopped:
            self.finish(seq, "stop", token=choice, text=text)
        elif len(seq.output_ids) >= seq.params.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= self.context_len:
            self.finish(seq, "length", token=choice, text=text + seq.stream.flush())
        else:
            seq.on_output(Output(seq, choice, text))

    def finish(self, seq: Sequence, reason: str, *, token: TokenChoice | None, text: str) -> None:
        seq.finish_reason = reason
        if self.prefix_cache and reason in ("stop", "length"):
            self.prefix_cache.keep_finished(seq)
        self.scheduler.free(seq)
        self.stats[f"finished_{reason}"] += 1
        seq.on_output(Output(seq, token, text, reason))


def engine_for_model(model, tokenizer, *, eos_id: int | None, max_batch: int = 16, speculation=None,
                     draft_model=None, **runner_options) -> Engine:
    """An engine over one process's model (`shardwise.infer.load.open_engine` opens a run on N ranks);
    `speculation` (`speculation.SpeculationOptions`) with, for a draft, the `draft_model`."""
    runner = runner_for(model, num_slots=max_batch, **runner_options)
    return Engine(runner, tokenizer, eos_id=eos_id, speculator=speculator_for(
        runner, speculation, draft_model, compile=runner_options.get("compile", False)))


def speculator_for(runner: ModelRunner, options, draft_model, **draft_options) -> Speculator | None:
    """The engine's speculator (None: none asked for); a draft model gets its own runner and cache,
    with the target's slots and capacity (`draft_options`: `ModelRunner`'s compile, owns_model)."""
    if options is None:
        return None
    draft_runner = None
    if draft_model is not None:
        draft_runner = ModelRunner(draft_model, num_slots=runner.cache.num_slots, capacity=runner.capacity,
                                   **draft_options)
    return Speculator(options, capacity=runner.capacity, draft_runner=draft_runner)


def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Sequence]:
    """Offline: every prompt (n choices each) through the engine at once, stepping in this thread;
    the finished sequences in prompt order."""
    seqs = [engine.submit(ids, params, lambda out: None, choice=choice) for ids in prompts for choice in range(n)]
    engine.run_until_done()
    return seqs
