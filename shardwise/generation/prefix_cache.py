"""Prefix caching: requests that share a prompt prefix (a system prompt, few-shot examples, a chat's
earlier turns) reuse its keys and values instead of recomputing them.

The KV cache keeps one static slot per sequence (`slot_cache.py` says why), so the cache cannot
share pages between sequences as vLLM's paged blocks do. The prefix cache is a pool beside it:
`PrefixPool`, per layer keys and values [kv_heads, num_blocks, block_size, head_dim], bounded by
`--prefix-cache-mb` (per process: under tensor parallelism each rank holds its heads' share), and
`PrefixIndex` (torch-free) says which token blocks it holds. The engine calls `PrefixCache`:
- `reuse`, before each prefill: a prefilling sequence whose prompt starts with held blocks gets
  their columns copied into its slot, and its `num_cached` jumps past them. At least one prompt
  token is always left to run, so the first output token's logits come from a forward; a prompt
  wholly held reuses all but its last token (the block's columns beyond it are written again by
  that token's forward, with the same values). A sequence is looked up again whenever the pool
  gained blocks since its last lookup: 16 clients arriving at once are prefilled in arrival order,
  and the second one finds the first one's blocks by the time its prefill starts;
- `hold_back_shared`, on each prefill batch: a row whose next block an earlier row of the same
  step computes waits one step, then restores it;
- `keep_prefilled`, after each prefill chunk: the new whole blocks of each row's prompt are copied
  into the pool (a long prompt's blocks are there before its prefill ends);
- `keep_finished`: a sequence that ended ("stop" or "length") leaves its output's whole blocks too,
  so a chat's next turn, which repeats the answer, reuses it.
Copying is exact: position p of a sequence is column p of its slot wherever it came from, and a
block's keys depend only on the tokens up to its end (causal attention). A sliding-window model's
slot keeps every position, so its columns copy the same way.

Why a copy and not a recompute: restoring 1,024 columns is one gather and one copy per layer,
milliseconds, where recomputing them is a forward over 1,024 tokens (benchmarks/prefix_cache.py).
SGLang's zero-copy reuse (a new sequence in the slot whose previous occupant shared its prefix) is
left out: it would make admission choose slots by prefix, for the cost of one copy.

Under tensor parallelism every rank holds the same blocks of its own heads: the leader decides
(the index lives only there) and `TensorParallelRunner.copy_prefix` broadcasts each copy, which
the followers run in order with the forwards.
"""

from __future__ import annotations

import collections
import weakref

import torch

from shardwise.generation.prefix_index import RESTORE, STORE, PrefixCopy, PrefixIndex

BLOCK_SIZE = 16
"""Tokens per block: the granularity of reuse (vLLM's default block size)."""
DEFAULT_PREFIX_CACHE_MB = 256
"""The pool of a decoder's run unless --prefix-cache-mb says otherwise (per process)."""


class PrefixPool:
    """Each process's pool of blocks: allocated at the first store, when the slot cache exists
    (its heads, width and dtype are the pool's); `max_bytes` bounds it."""

    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE):
        self.max_bytes, self.block_size = max_bytes, block_size
        self.keys: list[torch.Tensor] | None = None
        self.values: list[torch.Tensor] | None = None
        self.block_bytes = 0

    def num_blocks(self, cache) -> int:
        if self.keys is None:
            self.allocate(cache)
        return self.keys[0].shape[1]

    def allocate(self, cache) -> None:
        _, heads, _, head_dim = cache.keys[0].shape
        self.block_bytes = 2 * len(cache.keys) * heads * self.block_size * head_dim * cache.keys[0].element_size()
        shape = (heads, self.max_bytes // self.block_bytes, self.block_size, head_dim)
        # empty, not zeros: on CPU the pages of blocks never written are never committed
        self.keys = [layer.new_empty(shape) for layer in cache.keys]
        self.values = [layer.new_empty(shape) for layer in cache.values]

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys or []) + (self.values or []))

    def run(self, cache, copy: PrefixCopy) -> None:
        if self.keys is None:
            self.allocate(cache)
        ids = torch.tensor(copy.block_ids, device=self.keys[0].device)
        columns = slice(copy.first_column, copy.first_column + len(copy.block_ids) * self.block_size)
        for pool, layer in zip(self.keys + self.values, cache.keys + cache.values):
            heads, _, _, head_dim = pool.shape
            in_slot = layer[copy.slot, :, columns]  # [heads, n * block_size, head_dim]
            if copy.op == RESTORE:
                in_slot.copy_(pool.index_select(1, ids).view(heads, -1, head_dim))
            else:
                pool.index_copy_(1, ids, in_slot.reshape(heads, len(copy.block_ids), self.block_size, head_dim))


class PrefixCache:
    """The engine's side: which blocks to restore and store, and the counts /metrics reports."""

    def __init__(self, runner, block_size: int = BLOCK_SIZE):
        self.runner, self.block_size = runner, block_size
        self.index: PrefixIndex | None = None  # made at the first store: its size follows the cache's shape
        self.stats = collections.Counter()  # hits, misses (sequences), reused_tokens
        self.version = 0  # stores so far: a sequence is looked up again only after one
        self.looked_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.hashes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def pool(self) -> PrefixPool:
        return self.runner.prefix_pool

    def reuse(self, seqs) -> None:
        """Restore the held prefix of each prefilling sequence into its slot (beyond what it has)."""
        if self.index is None:
            return
        for seq in seqs:
            if not seq.prefilling or self.looked_at.get(seq) == self.version:
                continue
            self.looked_at[seq] = self.version
            ids = self.index.match(seq.prompt_ids)
            reusable = min(len(ids) * self.block_size, len(seq.prompt_ids) - 1)  # one token left to run
            if reusable <= seq.num_cached:
                continue
            first = seq.num_cached // self.block_size
            last = -(-reusable // self.block_size)
            self.runner.copy_prefix(PrefixCopy(RESTORE, seq.slot, first * self.block_size, ids[first:last]))
            seq.num_reused += reusable - seq.num_cached
            seq.num_cached = reusable

    def hold_back_shared(self, batch: list) -> list:
        """The prefill rows less those whose next block an earlier row computes in this step: they
        wait one step and restore it then (`generate` over prompts sharing a system prompt admits them
        all at once, and one step would otherwise compute the shared blocks once per prompt). The
        first row always runs."""
        kept, computed = [], set()  # chain hashes of the whole blocks the kept rows finish now
        for row in batch:
            seq, take = row
            hashes = self.chain_hashes(seq)
            next_block = seq.num_cached // self.block_size
            if next_block < len(hashes) and hashes[next_block] in computed:
                continue
            kept.append(row)
            computed.update(hashes[next_block:(seq.num_cached + take) // self.block_size])
        return kept

    def chain_hashes(self, seq) -> list[int]:
        """One hash per whole prompt block, of the prompt up to its end (a collision only delays a row)."""
        if seq not in self.hashes:
            chain, size = [], self.block_size
            for start in range(0, len(seq.prompt_ids) - size + 1, size):
                chain.append(hash((chain[-1] if chain else 0, tuple(seq.prompt_ids[start:start + size]))))
            self.hashes[seq] = chain
        return self.hashes[seq]

    def keep_prefilled(self, batch, done_rows: list[int]) -> None:
        """Store the whole prompt blocks each row has cached; count the prompts now whole."""
        for seq, _ in batch:
            self.store(seq, seq.prompt_ids[:seq.num_cached])
        for row in done_rows:
            seq = batch[row].seq
            self.stats["hits" if seq.num_reused else "misses"] += 1
            self.stats["reused_tokens"] += seq.num_reused

    def keep_finished(self, seq) -> None:
        """Store a finished sequence's blocks, its output's too (all but the last token are cached)."""
        if seq.slot is not None:
            self.store(seq, (seq.prompt_ids + seq.output_ids)[:seq.num_cached])

    def store(self, seq, tokens: list[int]) -> None:
        if len(tokens) < self.block_size:
            return
        if self.index is None:
            self.index = PrefixIndex(self.pool.num_blocks(self.runner.cache), self.block_size)
        first, ids = self.index.insert(tokens)
        if ids:
            try:
                self.runner.copy_prefix(PrefixCopy(STORE, seq.slot, first * self.block_size, ids))
            except BaseException:  # (out of memory, say) the blocks were never filled: no one may restore them
                self.index.forget(tokens, first)
                raise
            self.version += 1

    def counts(self) -> dict[str, int]:
        """What /metrics reports: sequences that reused a prefix or not, tokens reused, blocks
        evicted, bytes of the pool holding blocks, and the pool's bound."""
        used = self.index.num_used if self.index else 0
        return {"hits": self.stats["hits"], "misses": self.stats["misses"],
                "reused_tokens": self.stats["reused_tokens"],
                "evicted_blocks": self.index.num_evicted if self.index else 0,
                "bytes_used": used * self.pool.block_bytes, "bytes_limit": self.pool.max_bytes}


def enable_prefix_caching(runner, max_bytes: int) -> PrefixCache:
    """Give `runner` a pool of `max_bytes` (on every rank); the PrefixCache the leader's engine uses."""
    runner.prefix_pool = PrefixPool(max_bytes)
    return PrefixCache(runner)


def prefix_cache_bytes(prefix_cache_mb: int | None, model_cfg, *, encoder_decoder: bool, num_shards: int) -> int:
    """--prefix-cache-mb checked before the model loads: the pool's bytes per process (0: off).
    None: the default, on for decoders (as vLLM's automatic prefix caching is), off for an
    encoder-decoder, whose prompt is the encoder's input (bidirectional: no prefix of it stands alone)."""
    if prefix_cache_mb is None:
        return 0 if encoder_decoder else DEFAULT_PREFIX_CACHE_MB * 2**20
    if prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb = {prefix_cache_mb} is invalid: use 0 (off) or a positive size in MiB")
    if prefix_cache_mb and encoder_decoder:
        raise ValueError(f"--prefix-cache-mb = {prefix_cache_mb} is invalid: an encoder-decoder's prompt is its "
                         "encoder's input, whose prefixes cannot be reused; use 0 or leave it out")
    need = block_bytes_estimate(model_cfg, num_shards)
    if 0 < prefix_cache_mb * 2**20 < need:
        raise ValueError(f"--prefix-cache-mb = {prefix_cache_mb} is invalid: one block of {BLOCK_SIZE} tokens of "
                         f"this model takes {need / 2**20:.2f} MiB; use at least {-(-need // 2**20)} (or 0: off)")
    return prefix_cache_mb * 2**20


def block_bytes_estimate(model_cfg, num_shards: int) -> int:
    """One block's keys and values in every layer, fp32 (as a run's weights are), one rank's heads:
    the KV cache of one slot of BLOCK_SIZE columns."""
    from shardwise.generation.runner import kv_cache_bytes

    return kv_cache_bytes(model_cfg, num_slots=1, capacity=BLOCK_SIZE - 1, num_shards=num_shards)
