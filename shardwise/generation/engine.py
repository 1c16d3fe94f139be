"""The inference engine: continuous batching over a static-slot KV cache.

Each iteration (`step`):
1. admit waiting sequences into free slots (a sequence keeps its slot until it ends);
2. prefill: one forward over at most `prefill_chunk` prompt tokens, taken from the prefilling
   sequences in arrival order, so a long prompt is prefilled over several iterations and never
   stalls the running decodes for longer than one chunk;
3. decode: one forward of one token for every decoding sequence, rows 0..n-1 of the cache
   (n the highest busy slot + 1, rounded up to a power of two; idle rows write to the scratch
   column), attending over `key_len` columns (the longest sequence, rounded up: `key_bucket`),
   so a compiled decode step sees few distinct shapes;
4. sample each row with its own parameters and generator; finished sequences free their slot
   at once, and so do cancelled ones (a client that went away).

The engine thread is the only one touching the model; `submit` and `cancel` may be called from
any thread. Outputs go to each sequence's `on_output` callback, in the engine thread.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardwise.generation.runner import ModelRunner, runner_for
from shardwise.generation.sampling import SamplingParams, TokenChoice, choose_tokens
from shardwise.generation.slot_cache import StepRows
from shardwise.generation.text_stream import TextStream

MIN_KEY_BUCKET = 32


class EngineStopped(RuntimeError):
    """A submission to an engine that has stopped or failed."""


@dataclass
class Output:
    """What one step added to a sequence: its new token (if any), the text that became final,
    and, on the last output, why it ended ("stop", "length", "cancelled", or "error": the engine failed)."""

    sequence: "Sequence"
    token: TokenChoice | None
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[Output], None]
    generator: torch.Generator
    stream: TextStream
    stop_ids: frozenset[int]
    id: int = 0
    slot: int | None = None
    num_cached: int = 0  # positions whose keys/values are in the slot
    position_offset: int = 0  # cached tokens before the decoder's position 0: an encoder-decoder's prompt
    output_ids: list[int] = field(default_factory=list)
    counts: torch.Tensor | None = None
    finish_reason: str | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def text(self) -> str:
        """The output text so far (all of it once finished; stop strings cut it)."""
        return self.stream.text

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, *, eos_id: int | None, prefill_chunk: int = 256):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk = {prefill_chunk} is invalid: prefill at least 1 token per step")
        self.runner, self.tokenizer, self.eos_id = runner, tokenizer, eos_id
        self.max_batch, self.prefill_chunk = runner.cache.num_slots, prefill_chunk  # one sequence per cache slot
        self.context_len = runner.capacity
        self.vocab_size = runner.vocab_size
        self.slots: list[Sequence | None] = [None] * self.max_batch
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.cancelled: set[Sequence] = set()
        self.lock = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = self.pausing = self.failed = False
        self.serving = False  # while serve_forever steps, in whichever thread
        self.stats = collections.Counter()

    # ---- any thread ----
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token of text")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                             f"{self.context_len}; shorten it to at most {self.context_len - 1} tokens")
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
            self.waiting.append(seq)
            self.lock.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        with self.lock:
            self.cancelled.add(seq)
            self.lock.notify()

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return sum(seq is not None for seq in self.slots)

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
                except Exception:  # a bug or out of memory: end every sequence rather than leave clients waiting
                    traceback.print_exc()
                    self.fail_all()
                    return
        finally:
            self.serving = False

    def fail_all(self) -> None:
        """End every sequence with finish_reason "error"; later submissions are refused."""
        with self.lock:
            self.failed = True
            waiting, self.waiting = list(self.waiting), collections.deque()
        for seq in [*waiting, *(s for s in self.slots if s is not None)]:
            self.finish(seq, "error", token=None, text="")

    def has_work(self) -> bool:
        return bool(self.waiting or self.cancelled or any(self.slots))

    def run_until_done(self) -> None:
        """Step until every submitted sequence has ended (offline generation)."""
        while self.has_work():
            self.step()

    def step(self) -> None:
        with self.runner.no_grad():
            self.step_without_grad()

    def step_without_grad(self) -> None:
        self.drop_cancelled()
        self.admit()
        prefill = self.prefill_batch()
        if prefill:
            self.prefill(prefill)
        decoding = [seq for seq in self.slots if seq is not None and not seq.prefilling and seq.output_ids]
        if decoding:
            self.decode(decoding)

    def drop_cancelled(self) -> None:
        with self.lock:
            cancelled, self.cancelled = self.cancelled, set()
            for seq in cancelled:
                if seq in self.waiting:
                    self.waiting.remove(seq)
        for seq in cancelled:
            if seq.finish_reason is None:
                self.finish(seq, "cancelled", token=None, text="")

    def admit(self) -> None:
        with self.lock:
            for slot, occupant in enumerate(self.slots):
                if occupant is None and self.waiting:
                    seq = self.waiting.popleft()
                    seq.slot = slot
                    self.slots[slot] = seq

    def prefill_batch(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to prefill now) for the prefilling sequences, within the chunk budget.
        An encoder takes a prompt whole (its attention is bidirectional): whole prompts while the
        budget lasts, at least one."""
        budget, batch = self.prefill_chunk, []
        for seq in sorted((s for s in self.slots if s is not None and s.prefilling), key=lambda s: s.id):
            left = len(seq.prompt_ids) - seq.num_cached
            if budget <= 0 or (self.runner.encoder_decoder and batch and left > budget):
                break
            take = left if self.runner.encoder_decoder else min(budget, left)
            batch.append((seq, take))
            budget -= take
        return batch

    def prefill(self, batch: list[tuple[Sequence, int]]) -> None:
        if self.runner.encoder_decoder:
            self.start_decoders([seq for seq, _ in batch])
            return
        width = max(take for _, take in batch)
        device, scratch = self.runner.device, self.runner.capacity
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        positions = torch.zeros(len(batch), width, dtype=torch.long)
        write = torch.full((len(batch), width), scratch, dtype=torch.long)
        for b, (seq, take) in enumerate(batch):
            span = torch.arange(seq.num_cached, seq.num_cached + take)
            tokens[b, :take] = torch.tensor(seq.prompt_ids[seq.num_cached:seq.num_cached + take])
            positions[b, :take] = write[b, :take] = span
        key_len = max(seq.num_cached + take for seq, take in batch)
        rows = StepRows(torch.tensor([seq.slot for seq, _ in batch], device=device), positions.to(device),
                        write.to(device), key_len)
        last = torch.tensor([take - 1 for _, take in batch])
        logits = self.runner.forward(tokens.to(device), rows, last_index=last.to(device))
        self.stats["prefill_tokens"] += sum(take for _, take in batch)
        done = []
        for b, (seq, take) in enumerate(batch):
            seq.num_cached += take
            if not seq.prefilling:
                done.append(b)
        if done:
            self.sample([batch[b][0] for b in done], logits[done])

    def start_decoders(self, seqs: list[Sequence]) -> None:
        """An encoder-decoder's prefill: each prompt through the encoder, then the decoder's start
        token (cached at decoder position 0), whose logits give the first output token."""
        logits = self.runner.start([seq.prompt_ids for seq in seqs], [seq.slot for seq in seqs])
        self.stats["prefill_tokens"] += sum(len(seq.prompt_ids) for seq in seqs)
        for seq in seqs:
            seq.position_offset = len(seq.prompt_ids)
            seq.num_cached = seq.position_offset + 1
        self.sample(seqs, logits)

    def decode(self, decoding: list[Sequence]) -> None:
        device, scratch = self.runner.device, self.runner.capacity
        rows_needed = max(seq.slot for seq in decoding) + 1
        num_rows = min(power_of_two_at_least(rows_needed), self.max_batch)
        tokens = torch.zeros(num_rows, 1, dtype=torch.long)
        positions = torch.zeros(num_rows, 1, dtype=torch.long)
        write = torch.full((num_rows, 1), scratch, dtype=torch.long)
        for seq in decoding:
            tokens[seq.slot, 0] = seq.output_ids[-1]
            positions[seq.slot, 0] = write[seq.slot, 0] = seq.num_cached - seq.position_offset
        longest = max(seq.num_cached - seq.position_offset for seq in decoding) + 1
        key_len = min(key_bucket(longest, self.runner.device.type), self.runner.capacity)
        rows = StepRows(None, positions.to(device), write.to(device), key_len)
        logits = self.runner.forward(tokens.to(device), rows, last_index=None)
        for seq in decoding:
            seq.num_cached += 1
        self.stats["decode_steps"] += 1
        self.sample(decoding, logits[[seq.slot for seq in decoding]])

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
        if seq.slot is not None:
            self.slots[seq.slot] = None
            seq.slot = None
        self.stats[f"finished_{reason}"] += 1
        seq.on_output(Output(seq, token, text, reason))


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def key_bucket(longest: int, device_type: str) -> int:
    """The key columns a decode step attends, at least `longest` (MIN_KEY_BUCKET at least). On CUDA a
    power of two: each distinct shape records a CUDA graph of its own. Elsewhere the next multiple of
    16: the compiled step's key length is symbolic after its first recompile, so any length runs
    without compiling, and attention, which reads every column, then reads < 16 columns beyond the
    longest sequence instead of up to as many again (measured, 16 rows of the demo model, 32-39
    prompt tokens + 128: 6.12 -> 5.69 ms a step)."""
    if device_type == "cuda":
        return max(power_of_two_at_least(longest), MIN_KEY_BUCKET)
    return max(-(-longest // 16) * 16, MIN_KEY_BUCKET)


def engine_for_model(model, tokenizer, *, eos_id: int | None, max_batch: int = 16, **runner_options) -> Engine:
    """An engine over one process's model (`shardwise.infer.load.open_engine` opens a run on N ranks)."""
    return Engine(runner_for(model, num_slots=max_batch, **runner_options), tokenizer, eos_id=eos_id)


def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Sequence]:
    """Offline: every prompt (n choices each) through the engine at once, stepping in this thread;
    the finished sequences in prompt order."""
    seqs = [engine.submit(ids, params, lambda out: None, choice=choice) for ids in prompts for choice in range(n)]
    engine.run_until_done()
    return seqs
