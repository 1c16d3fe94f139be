"""Running the model for the engine: one forward over a step's rows, logits of one position per row.

`prefill_logits` and `decode_logits` turn the scheduler's batches (`scheduler.PrefillRow`,
`scheduler.DecodeBatch`) into the step's tensors: tokens, positions, the cache columns written and
read (`StepRows`).

`ModelRunner` holds the model and its `SlotKVCache` (`EncoderDecoderRunner`: an encoder-decoder's,
with `EncoderDecoderCache`). The decode step (one token per row, rows 0..n-1, a bucketed key length)
can be compiled with `torch.compile`, each runner its own copy (`own_code`); on CUDA the compiled
step uses CUDA graphs (what mode "reduce-overhead" sets), on CPU inductor's C++ wrapper. Shapes are left to dynamo's automatic dynamic shapes:
the first recompile (a new row count or key length) makes them symbolic, so a server compiles
twice, not once per bucket (measured: a recompile per bucket made the first minutes of serving
slow). The cache write is plain indexing into each layer's cache, done in place
(`slot_cache.static_keys_values`). Prefill runs eager: its shapes vary with every prompt and it is
compute-bound, where compiling gains little.

Under tensor parallelism (`TensorParallelRunner`) every rank holds a shard of the model and of
the cache. Rank 0 runs the engine; before each forward it broadcasts the step (tokens, rows,
positions) to the other ranks, which run the same forward in `follow()`; the vocabulary-sharded
logits are gathered on every rank (a collective), and only rank 0 samples. The prefix cache's copies
between a slot and its pool (`copy_prefix`) travel the same way, so every rank's shard of the cache
and of the pool holds the same columns.
"""

from __future__ import annotations

import itertools
import sys
import types

import torch

from shardwise.generation.cpu_weight_layout import store_linear_weights_transposed
from shardwise.generation.encoder_decoder_cache import EncoderDecoderCache
from shardwise.generation.prefix_index import PrefixCopy
from shardwise.generation.scheduler import DecodeBatch, PrefillRow, power_of_two_at_least
from shardwise.generation.slot_cache import SlotKVCache, StepRows
from shardwise.models.t5.model import DECODER_START_ID

MIN_KEY_BUCKET = 32


def torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


RUNNER_NUMBERS = itertools.count()


def own_code(method):
    """The bound `method` as a function with a code object of its own. Dynamo keeps compiled code per
    code object, shared by every function of that code; with the model's guards skipped, a second
    runner's model in the same process (a test's, a benchmark's) would otherwise run the first one's
    graph (seen: a gated T5 decoded with an ungated one's code, on CUDA)."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(RUNNER_NUMBERS)}")
    return types.MethodType(types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__),
                            method.__self__)


class ModelRunner:
    def __init__(self, model, *, num_slots: int, capacity: int | None = None, compile: bool = False,
                 owns_model: bool = False):
        """`owns_model`: the runner may change how the model's weights are stored (on CPU, linear
        weights transposed: `cpu_weight_layout`), for a model loaded only to be served; a model that
        goes on training or is saved afterwards (the trainer's closing sample) keeps its layout."""
        if num_slots < 1:
            raise ValueError(f"max_batch = {num_slots} is invalid: serve at least 1 sequence at a time")
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = model.cfg.vocab_size
        if capacity is not None and not 1 <= capacity <= model.cfg.max_seq_len:
            raise ValueError(f"context_len = {capacity} is invalid: the model's max_seq_len is "
                             f"{model.cfg.max_seq_len}; use 1 to that (or None for all of it)")
        self.capacity = capacity or model.cfg.max_seq_len
        self.cache = self.make_cache(num_slots)
        if owns_model and self.device.type == "cpu":  # up to 4.5x faster products of a step's few rows
            store_linear_weights_transposed(model)
        self.decode_forward = self.logits_of
        if compile:
            # No guards on the model's modules and parameters: a runner never swaps them, and checking
            # them every step cost a fifth of a batch-1 decode step of the demo model on CPU (measured
            # 338 -> 414 tokens/s). Guards on the step's inputs (shapes, the cache) stay. Safe only
            # because the compiled function is this runner's own (`own_code`), and only for a step
            # that compiles whole. A model with data-dependent modules (MoE's experts) keeps them:
            # its step compiles whole today (`MoE.every_expert`), but where it broke at the experts,
            # the frames resumed after the break took a layer's weights as locals, and without
            # guards on them a frame compiled for one layer's weights ran for others (seen: greedy
            # tokens differed from eager's from the first).
            options = {}
            if not any(getattr(module, "data_dependent", False) for module in model.modules()):
                options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            # On CPU inductor's C++ wrapper calls the kernels without the Python wrapper's per-tensor
            # checks and views (measured 347 -> 487 tokens/s at batch 1, demo model), for about 3x the
            # compile time (~50 s on 2 cores). CUDA graphs replay the step without either wrapper.
            if self.device.type == "cpu":
                options["cpp_wrapper"] = True
            if self.device.type == "cuda":  # mode "reduce-overhead", which torch.compile takes only without options
                options["triton.cudagraphs"] = True
            self.decode_forward = torch.compile(own_code(self.logits_of), options=options)

    def forward(self, tokens_BS: torch.Tensor, rows: StepRows, *, last_index: torch.Tensor | None,
                every_position: bool = False) -> torch.Tensor:
        """Logits [B, vocab] (fp32) of each row's last token (`last_index[b]`, or the only one);
        `every_position`: [B, S, vocab], a speculative step's verification, through the decode
        step's function (compiled with --compile: its width becomes one more dynamic dimension)."""
        if every_position:
            return self.decode_forward(tokens_BS, rows.positions_BS, rows.write_BS, rows.key_len, None, None, True)
        if last_index is None and rows.slots_B is None and tokens_BS.shape[1] == 1:
            return self.decode_forward(tokens_BS, rows.positions_BS, rows.write_BS, rows.key_len)
        return self.logits_of(tokens_BS, rows.positions_BS, rows.write_BS, rows.key_len, rows.slots_B, last_index)

    def prefill_logits(self, batch: list[PrefillRow]) -> torch.Tensor:
        """Logits [B, vocab] at the last token of each row's chunk: row b writes its sequence's next
        prompt tokens at their positions (from `num_cached`) into its slot; a shorter chunk's padding
        writes the scratch column."""
        width = max(take for _, take in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        positions = torch.zeros(len(batch), width, dtype=torch.long)
        write = torch.full((len(batch), width), self.capacity, dtype=torch.long)  # the scratch column
        for b, (seq, take) in enumerate(batch):
            span = torch.arange(seq.num_cached, seq.num_cached + take)
            tokens[b, :take] = torch.tensor(seq.prompt_ids[seq.num_cached:seq.num_cached + take])
            positions[b, :take] = write[b, :take] = span
        key_len = max(seq.num_cached + take for seq, take in batch)
        rows = StepRows(torch.tensor([seq.slot for seq, _ in batch], device=self.device), positions.to(self.device),
                        write.to(self.device), key_len)
        last = torch.tensor([take - 1 for _, take in batch])
        return self.forward(tokens.to(self.device), rows, last_index=last.to(self.device))

    def decode_logits(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [num_rows, vocab]: row = slot, each sequence's last token at its next position;
        idle rows write the scratch column. Attention reads `key_bucket` columns."""
        tokens = torch.zeros(batch.num_rows, 1, dtype=torch.long)
        positions = torch.zeros(batch.num_rows, 1, dtype=torch.long)
        write = torch.full((batch.num_rows, 1), self.capacity, dtype=torch.long)  # the scratch column
        for seq in batch.seqs:
            tokens[seq.slot, 0] = seq.output_ids[-1]
            positions[seq.slot, 0] = write[seq.slot, 0] = seq.num_cached - seq.position_offset
        longest = max(seq.num_cached - seq.position_offset for seq in batch.seqs) + 1
        key_len = min(key_bucket(longest, self.device.type), self.capacity)
        rows = StepRows(None, positions.to(self.device), write.to(self.device), key_len)
        return self.forward(tokens.to(self.device), rows, last_index=None)

    prefix_pool = None
    """The prefix cache's pool of blocks (`prefix_cache.enable_prefix_caching`); None: no prefix caching."""

    def copy_prefix(self, copy: PrefixCopy) -> None:
        """Copy whole blocks of cache columns between a slot and the prefix pool (the engine's
        `PrefixCache` decides which)."""
        self.prefix_pool.run(self.cache, copy)

    encoder_decoder = False
    """Whether a prompt is an encoder's input (`EncoderDecoderRunner`) rather than the decoder's prefix."""

    def make_cache(self, num_slots: int):
        return SlotKVCache(num_layers=self.model.cfg.n_layers, num_slots=num_slots, capacity=self.capacity)

    def run_model(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model(tokens_BS, kv_cache=self.cache)

    def logits_of(self, tokens_BS, positions_BS, write_BS, key_len: int, slots_B=None, last_index=None,
                  every_position: bool = False):
        self.cache.begin(StepRows(slots_B, positions_BS, write_BS, key_len, output_B=last_index))
        logits = self.run_model(tokens_BS)  # [B, 1, vocab]: the model's head ran at `last_index` only
        if hasattr(logits, "full_tensor"):  # tensor parallel: logits sharded by vocabulary
            logits = logits.full_tensor()
        return (logits if every_position else logits[:, -1]).float()

    def thread_setup(self):
        """A function for a thread that will run the decode step: on CUDA with torch < 2.13 it gives
        that thread this thread's CUDA-graph trees, kept in thread-local state that a Python thread
        does not inherit (pytorch#123177: the compiled step's replay asserted in the engine thread)."""
        trees = sys.modules.get("torch._inductor.cudagraph_trees")
        if self.device.type != "cuda" or trees is None or torch_release() >= (2, 13):
            return lambda: None
        state = {name: trees.get_obj(trees.local, name) for name in ("tree_manager_containers", "tree_manager_locks")}

        def setup():
            for name, value in state.items():
                setattr(trees.local, name, value)
        return setup

    def no_grad(self):
        """The grad mode of a step: inference mode (no version counters, no autograd records)."""
        return torch.inference_mode()

    def close(self) -> None:
        pass


class EncoderDecoderRunner(ModelRunner):
    """The runner of an encoder-decoder (T5): a sequence's prompt is the encoder's input, encoded
    once when the sequence starts (`start`), which also runs the decoder's start token; the decode
    steps then run the decoder alone over `EncoderDecoderCache` (compiled as a decoder's are).
    The decoder's positions count from its start token; `capacity` bounds the prompt and the
    decoder's tokens alike."""

    encoder_decoder = True

    def make_cache(self, num_slots: int):
        return EncoderDecoderCache(num_layers=self.model.fields.n_decoder_layers, num_slots=num_slots,
                                   capacity=self.capacity)

    def run_model(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model.decode_cached(tokens_BS, self.cache)

    def start(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Encode each prompt into its slot, then the logits [B, vocab] (fp32) of the decoder's
        first step (its start token, at position 0)."""
        return self.start_padded(*padded(prompts), torch.tensor(slots, device=self.device))

    def start_padded(self, ids_BS: torch.Tensor, real_BS: torch.Tensor, slots_B: torch.Tensor) -> torch.Tensor:
        """`start` of right-padded prompts (`real_BS`: True at a prompt's tokens)."""
        ids, real = ids_BS, real_BS.bool()
        zeros = torch.zeros(len(ids), 1, dtype=torch.long, device=self.device)
        self.cache.begin(StepRows(slots_B, zeros, zeros, 1))
        self.cache.set_source_lengths(slots_B, real.sum(1).to(self.device))
        self.model.encode_into(ids.to(self.device), real.to(self.device), self.cache)
        start = torch.full((len(ids), 1), DECODER_START_ID, dtype=torch.long, device=self.device)
        return self.logits_of(start, zeros, zeros, 1, slots_B)


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


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, longest] and where the real tokens are."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    real = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
        real[row, :len(prompt)] = True
    return ids, real


def kv_cache_bytes(model_cfg, *, num_slots: int, capacity: int, num_shards: int = 1) -> int:
    """A lower bound on one rank's KV cache: keys and values (fp32, as a run's weights are) of every
    layer's self-attention heads (split over `num_shards` tensor-parallel ranks), every slot, every
    column (the context and the scratch column). An encoder-decoder's cross-attention comes on top."""
    head_dim = model_cfg.head_dim or model_cfg.dim // model_cfg.n_heads
    heads = max(model_cfg.n_kv_heads // num_shards, 1)
    return 2 * model_cfg.n_layers * heads * head_dim * (capacity + 1) * num_slots * 4


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory the device has free now (None: not known): CUDA's free memory, else the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def runner_for(model, *, group=None, **options) -> ModelRunner:
    """The runner of a model: an encoder-decoder's or a decoder's, one process's or (`group`) tensor
    parallel over the group's ranks."""
    encoder_decoder = getattr(model, "is_encoder_decoder", False)
    if group is None:
        return (EncoderDecoderRunner if encoder_decoder else ModelRunner)(model, **options)
    kind = TensorParallelEncoderDecoderRunner if encoder_decoder else TensorParallelRunner
    return kind(model, group=group, **options)


class TensorParallelRunner(ModelRunner):
    """Rank 0 leads (the engine calls `forward`); the other ranks `follow()` until `close()`."""

    HEADER = 8  # batch, width, key_len, has_slots, has_last_index, stop, start (an encoder-decoder's), prefix copy

    def __init__(self, model, *, group, **kwargs):
        super().__init__(model, **kwargs)
        self.group = group
        self.leader = torch.distributed.get_global_rank(group, 0)

    def forward(self, tokens_BS, rows: StepRows, *, last_index, every_position: bool = False):
        # A verify step (`every_position`) needs no flag of its own: a follower runs it as any
        # step of width > 1 (eager, every position's logits gathered), the same collectives.
        self.send(tokens_BS, rows, last_index)
        return super().forward(tokens_BS, rows, last_index=last_index, every_position=every_position)

    def send(self, tokens_BS, rows: StepRows, last_index, stop: bool = False, start: bool = False) -> None:
        batch, width = tokens_BS.shape
        header = torch.tensor([batch, width, rows.key_len, rows.slots_B is not None, last_index is not None, stop,
                               start, 0])
        parts = [header, tokens_BS.flatten().cpu(), rows.positions_BS.flatten().cpu(), rows.write_BS.flatten().cpu()]
        if rows.slots_B is not None:
            parts.append(rows.slots_B.cpu())
        if last_index is not None:
            parts.append(last_index.cpu())
        self.broadcast(torch.cat(parts))

    def copy_prefix(self, copy: PrefixCopy) -> None:
        """Every rank copies the same blocks of its own heads: header (copy.op last), then the copy."""
        header = [0] * (self.HEADER - 1) + [copy.op]
        self.broadcast(torch.tensor([*header, copy.slot, copy.first_column, *copy.block_ids]))
        super().copy_prefix(copy)

    def broadcast(self, message: torch.Tensor) -> None:
        message = message.to(self.device)
        size = torch.tensor([message.numel()], device=self.device)
        torch.distributed.broadcast(size, self.leader, group=self.group)
        torch.distributed.broadcast(message, self.leader, group=self.group)

    def receive(self):
        size = torch.zeros(1, dtype=torch.long, device=self.device)
        torch.distributed.broadcast(size, self.leader, group=self.group)
        message = torch.zeros(int(size), dtype=torch.long, device=self.device)
        torch.distributed.broadcast(message, self.leader, group=self.group)
        batch, width, key_len, has_slots, has_last, stop, start, prefix_op = message[:self.HEADER].tolist()
        if stop:
            return None
        if prefix_op:
            slot, first_column, *block_ids = message[self.HEADER:].tolist()
            return PrefixCopy(prefix_op, slot, first_column, block_ids)
        body = message[self.HEADER:].split([batch * width] * 3 + [batch] * (has_slots + has_last))
        tokens, positions, write = (part.view(batch, width) for part in body[:3])
        rest = list(body[3:])
        slots = rest.pop(0) if has_slots else None
        last_index = rest.pop(0) if has_last else None
        return tokens, StepRows(slots, positions, write, key_len), last_index, bool(start)

    def no_grad(self):
        # Not inference mode: DTensor redistributes the tied output head's table (a parameter, made
        # outside inference mode) and sets version counters, which inference tensors refuse.
        return torch.no_grad()

    def follow(self) -> None:
        """A non-leading rank: run every step the leader broadcasts, until it closes."""
        with self.no_grad():
            while (step := self.receive()) is not None:
                if isinstance(step, PrefixCopy):
                    ModelRunner.copy_prefix(self, step)
                    continue
                tokens, rows, last_index, start = step
                if start:  # an encoder-decoder's new sequences: the prompts travel as tokens, `real` as positions
                    self.start_padded(tokens, rows.positions_BS, rows.slots_B)
                else:
                    ModelRunner.forward(self, tokens, rows, last_index=last_index)

    def close(self) -> None:
        """Tell the other ranks to stop following; they may have stopped already (a stop signal reaches
        every rank of a launch), which is not an error here."""
        empty = torch.zeros(1, 1, dtype=torch.long)
        try:
            self.send(empty, StepRows(None, empty, empty, 1), None, stop=True)
        except (RuntimeError, torch.distributed.DistError):
            pass


class TensorParallelEncoderDecoderRunner(TensorParallelRunner, EncoderDecoderRunner):
    """An encoder-decoder over tensor-parallel ranks: the leader also broadcasts each `start` (the
    padded prompts, where their tokens are, their slots), which the followers run in `follow()`."""

    def start(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        ids, real = padded(prompts)
        slots_B = torch.tensor(slots)
        self.send(ids, StepRows(slots_B, real.long(), torch.zeros_like(ids), 0), None, start=True)
        return self.start_padded(ids.to(self.device), real.to(self.device), slots_B.to(self.device))
