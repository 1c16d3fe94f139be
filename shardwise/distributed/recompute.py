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

The block's `forward` is wrapped on the instance (`torch.utils.checkpoint`, non-reentrant), so
parameter names, state dicts and checkpoints are unchanged, and it composes with FSDP2 (which
hooks the module call), tensor parallelism (collectives inside the block run again in the
recomputation, in the same order on every rank), context and pipeline parallelism.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

KEPT_BY_SELECTIVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(selective_policy)


def checkpointed(forward, mode: str, *args, **kwargs):
    if mode == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(parts, mode: str) -> None:
    """Make every block of the model parts recompute its activations in backward (`mode`: full or
    selective; none leaves them alone)."""
    if mode == "none":
        return
    for part in parts:
        for block in part.layers.values():
            block.forward = functools.partial(checkpointed, block.forward, mode)
