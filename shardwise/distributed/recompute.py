"""Activation recomputation (`train.recompute`), applied to each block from outside the model.

  none       autograd keeps whatever each op saves for backward.
  full       each block keeps only its input; its forward runs again inside backward
             (Chen et al., 2016). Activation memory per block falls to the residual-stream
             input, at the price of one more forward of every block (~+33% compute).
  selective  the policy of Korthikanti et al. (2022), on torch's selective activation
             checkpointing: the outputs of matrix multiplications (the q/k/v/o and MLP
             projections, `aten.mm`/`aten.addmm`) are kept; everything else in the block —
             norms, RoPE, SiLU and the gating product, and attention itself (scores, softmax,
             weighted sum, whose memory grows with the sequence length squared in the math
             kernel) — is recomputed in backward. The projections, the expensive part, never run twice.

How it attaches: each block's class is swapped for a subclass whose forward runs the block's
own forward under `torch.utils.checkpoint` (non-reentrant) — the way FSDP2's `fully_shard` swaps a module's
class — so no instance's `forward` is reassigned (the subclass calls the block's own forward
through `super()`) and no wrapper module enters the tree: parameter names,
state dicts and checkpoints are unchanged (torch's `checkpoint_wrapper` would prefix every
name with `_checkpoint_wrapped_module.`, and names seed the initialisation and key the
checkpoints). It composes with FSDP2 (which hooks the module call; its class swap comes
after this one), tensor parallelism (collectives inside the block run again in the
recomputation, in the same order on every rank), context and pipeline parallelism.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

KEPT_BY_SELECTIVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


class Recomputed:
    """Mixed into a block's class: the block's call keeps only its inputs and recomputes the
    rest in backward (`recompute_mode`: full or selective)."""

    recompute_mode = "full"

    def forward(self, *args, **kwargs):
        # The block's own forward, checkpointed; module hooks (FSDP's all-gather) stay outside.
        run = super().forward
        if self.recompute_mode == "selective":
            return checkpoint(run, *args, use_reentrant=False, context_fn=selective_context, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


_RECOMPUTED_CLASSES: dict[tuple[type, str], type] = {}


def recomputed_class(cls: type, mode: str) -> type:
    """The subclass of `cls` that recomputes (one per class and mode, so instances share it)."""
    key = (cls, mode)
    if key not in _RECOMPUTED_CLASSES:
        _RECOMPUTED_CLASSES[key] = type(f"Recomputed{cls.__name__}", (Recomputed, cls), {"recompute_mode": mode})
    return _RECOMPUTED_CLASSES[key]


def apply_recompute(parts, plan, mode: str) -> None:
    """Make every block of the model parts recompute its activations in backward (`mode`: full or
    selective; none leaves them alone)."""
    if mode == "none":
        return
    for part in parts:
        for _, _, block in plan.all_blocks(part):
            block.__class__ = recomputed_class(type(block), mode)
