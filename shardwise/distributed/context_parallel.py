"""Context parallelism over the `cp` mesh axis: every rank holds 1/cp of each sequence (tokens,
activations, keys and values), so activation memory per rank falls as 1/cp.

`parallel.cp_mode`:
  ring      ring attention (`ring_attention.py`): key/value blocks travel around the ring. With
            `parallel.cp_load_balance` (default) the sequence is cut into 2·cp chunks and rank r
            holds chunks r and 2cp-1-r ("zigzag"), so under the causal mask every rank has the
            same work; contiguous chunks leave rank cp-1 with cp times rank 0's.
  alltoall  Ulysses (Jacobs et al., 2023): an all-to-all turns [heads, S/cp] into [heads/cp, S]
            before attention and back after it; heads (and kv heads) must divide by cp. Each rank
            then holds whole sequences in order, so a sliding window (`model.sliding_window`)
            is the single-process mask; ring attention has no window (refused by the config
            checks, `layout_rules.cp_window_violations`).

The layout is applied from outside the model, by its plan: a forward pre-hook gives each model
part the global positions of its tokens (`plan.positions_kwarg`; RoPE follows the chunking),
and each block's attention module (`plan.attention`) has its `core_attention` swapped. Everything else in a block is per token and needs no
change. Gradients of the (replicated) parameters are then averaged over dp x cp ranks by the
data-parallel strategy: each cp rank's loss is the mean over its equal share of the tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.distributed.comms import all_to_all_heads_to_sequence, all_to_all_sequence_to_heads
from shardwise.distributed.ring_attention import Ring, ring_attention
from shardwise.models.common.attention import causal_attention
from shardwise.models.common.moe import moe_layers


def chunk_ids(cp: int, *, load_balance: bool) -> list[list[int]]:
    """The sequence chunks each cp rank holds, in its local order: zigzag [r, 2cp-1-r] of 2cp
    chunks, or [r] of cp contiguous chunks."""
    if load_balance:
        return [[r, 2 * cp - 1 - r] for r in range(cp)]
    return [[r] for r in range(cp)]


def local_positions(seq_len: int, cp: int, rank: int, *, load_balance: bool) -> torch.Tensor:
    """Global positions (indices into the sequence) of rank `rank`'s tokens, in local order."""
    chunks = chunk_ids(cp, load_balance=load_balance)
    size = seq_len // (2 * cp if load_balance else cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks[rank]])


class UlyssesAttention:
    """Attention over the whole sequence on heads/cp heads: all-to-all in, causal attention, all-to-all out."""

    def __init__(self, group):
        self.group = group

    # Eager inside a compiled block, as RingAttention's core is (compile/regional.py compiles each block
    # whole): the collectives break dynamo's graph anyway, and traced, every frame down to the
    # all-to-all (comms.py) was compiled as a graph of its own, once for q's heads and again for k/v's:
    # 15 graphs per rank, now 5, 4 of them ring attention's too (test_compile.py's compiled cp2-alltoall
    # after cp2-ring: 17.7 s, now 1.5 s; 2026-11-27, 421d201, 2-core Xeon, torch 2.13.0+cpu). The core
    # only moves data and calls attention: it computes the same either way.
    @torch.compiler.disable
    def __call__(self, q, k, v, window: int = 0):
        if q.is_meta:  # shape inference (pipeline stages): nothing to exchange
            return torch.empty_like(q)
        q, k, v = (all_to_all_sequence_to_heads(x, self.group) for x in (q, k, v))
        return all_to_all_heads_to_sequence(causal_attention(q, k, v, window), self.group)


class RingAttention:
    """The ring-attention core of one model; `work`: [score elements computed, seconds in attention
    kernels] on this rank (see `ring_attention`)."""

    def __init__(self, group, *, load_balance: bool):
        self.ring = Ring(group)
        self.chunks_of = chunk_ids(self.ring.size, load_balance=load_balance)
        self.work = [0, 0.0]

    @torch.compiler.disable  # eager inside a compiled block, so that no frame of its own is compiled
    def __call__(self, q, k, v):
        if q.is_meta:
            return torch.empty_like(q)
        return ring_attention(q, k, v, ring=self.ring, chunks_of=self.chunks_of, work=self.work)


class ContextParallel:
    """This rank's share of each sequence, and the attention that joins the shares."""

    def __init__(self, cfg, plan, cp_mesh):
        par = cfg.parallel
        self.plan = plan
        self.load_balance = par.cp_mode == "ring" and par.cp_load_balance
        self.group = cp_mesh.get_group()
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()
        self.positions = local_positions(cfg.train.seq_len, self.size, self.rank, load_balance=self.load_balance)
        self.attention = RingAttention(self.group, load_balance=self.load_balance) if par.cp_mode == "ring" \
            else UlyssesAttention(self.group)

    def apply(self, parts) -> None:
        """Give every attention module the distributed core, every model part its tokens' positions,
        and every MoE layer the whole micro-batch's expert counts for its load-balancing loss."""
        for part in parts:
            for block in getattr(part, self.plan.blocks).values():
                block.get_submodule(self.plan.attention).core_attention = self.attention
            for layer in moe_layers(part).values():
                layer.whole_sequence_counts = self.whole_sequence_counts
            part.register_forward_pre_hook(self.add_positions, with_kwargs=True)

    def whole_sequence_counts(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, int]:
        if counts_E.is_meta:
            return counts_E, self.size
        total = counts_E.clone()
        dist.all_reduce(total, group=self.group)
        return total, self.size

    def add_positions(self, module, args, kwargs):
        if kwargs.get(self.plan.positions_kwarg) is None:
            kwargs[self.plan.positions_kwarg] = self.positions.to(args[0].device)
        return args, kwargs

    def split(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [batch, sequence] tensor (inputs or targets)."""
        return tokens_BS[:, self.positions.to(tokens_BS.device)]

    def split_batches(self, micro_batches):
        return [(self.split(x), self.split(y)) for x, y in micro_batches]


def apply_cp(parts, plan, cfg, cp_mesh) -> ContextParallel:
    """Context parallelism on every model part; returns what splits each batch for this rank."""
    context = ContextParallel(cfg, plan, cp_mesh)
    context.apply(parts)
    return context
