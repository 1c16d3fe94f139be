"""The chunked loss under tensor parallelism: each rank takes its rows of a head weight split by
vocabulary (a DTensor, Shard(0): `tensor_parallel.py`'s head and tied head roles, uneven pieces as
torch.chunk cuts them), a chunk of tokens at a time, with the softmax's statistics summed over the
ranks per chunk: Y = [Y_1 ... Y_t] by columns, m = max_r max(Y_r), s = sum_r sum(exp(Y_r - m)),
the target's logit from the rank that holds it. `apply_tp` hands `vocab_parallel_operands` to the
model (`model.split_vocabulary`), whose `decoder_output` passes it to
`models/common/chunked_loss.linear_cross_entropy`: the model itself imports no torch.distributed.

Written by hand: torch's `loss_parallel` takes the cross-entropy of the whole [tokens, vocab / t]
logits of each rank; this never makes them (38x less loss memory per rank at tp 2,
docs/benchmarks.md, "Loss memory").
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary split over tensor-parallel ranks: those from `start` on (as
    many as its weight has), the rest on the other ranks of `group`."""
    start: int
    group: object
    rows: int
    """The rows of the largest shard (torch.chunk's piece): every rank takes as many tokens a chunk,
    so that their all-reduces pair up (a rank with fewer rows would otherwise take more)."""

    def local_targets(self, targets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each target as a row of this shard, clamped into it; whether this shard holds it)."""
        local = targets - self.start
        owned = (local >= 0) & (local < rows)
        return local.clamp(0, rows - 1), owned

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return tensor


def vocab_parallel_operands(h: torch.Tensor, weight: DTensor) -> tuple[torch.Tensor, torch.Tensor, VocabShard]:
    """(the whole h as a local tensor, this rank's weight rows, their VocabShard) for a head weight
    split by vocabulary rows on one mesh dimension. h may be plain (replicated over the ranks) or a
    sequence-parallel DTensor; it is all-gathered where split. The gradient of h each rank makes is
    its columns' part, so h's backward sums it over the ranks (all-reduce, or reduce-scatter back
    to the sequence slices); the weight rows' gradient is this rank's own."""
    mesh, placements = weight.device_mesh, weight.placements
    split = [dim for dim, p in enumerate(placements) if p.is_shard(0)]
    if len(split) != 1 or any(not p.is_replicate() for dim, p in enumerate(placements) if dim != split[0]):
        raise ValueError(f"the chunked loss takes a head weight split by vocabulary rows on one mesh "
                         f"dimension; got placements {placements}; set train.chunked_loss = false")
    tp_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[split[0]]]
    piece = -(-weight.shape[0] // tp_mesh.size())
    if piece * (tp_mesh.size() - 1) >= weight.shape[0]:  # every rank decides alike, before any collective
        raise ValueError(f"the chunked loss needs vocabulary rows on every one of {tp_mesh.size()} tensor-parallel "
                         f"ranks; {weight.shape[0]} rows leave one without (config/layout_rules.vocab_violations)")
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, tp_mesh, [Replicate()], run_check=False)
    whole = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
    h_local = whole.to_local(grad_placements=[Partial()] * h.device_mesh.ndim)
    start = tp_mesh.get_local_rank() * piece
    return h_local, weight.to_local(), VocabShard(start, tp_mesh.get_group(), piece)
