"""One optimizer step of a laid-out model: forward and backward of the step's micro-batches
(directly, or through the pipeline schedule), the gradient sync, clipping and AdamW.

The loss is the global batch's: the sum of its token losses over the number of its loss tokens
(targets not -100; what TRL and transformers call num_items_in_batch), on every layout. A
micro-batch's mean loss is weighted by its share of those tokens: with R ranks averaging gradients
(dp x cp), its mean over c tokens is divided by N / (R c), N the global count, so the averaged
gradient is that of the global loss whatever the split. Text streams give every micro-batch the
same count (`equal_loss_tokens`): N is R x this rank's count, no count is exchanged, and each
micro-batch's divisor is exactly the number of micro-batches, as a mean of means. Examples (chat,
prompt_completion, packed or padded) do not: one all-reduce of the count per step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.config.schema import Config
from shardwise.distributed.parallelize import ParallelModel
from shardwise.models.common.loss import (autocast_context, document_ids_kwargs, loss_of, loss_tokens,
                                          micro_batch_parts)
from shardwise.models.common.moe import set_aux_loss_scale
from shardwise.train.dpo import dpo_forward_backward


def equal_loss_tokens(cfg: Config) -> bool:
    """Whether every micro-batch of the run holds the same number of loss tokens: a text stream's
    objectives do (causal windows, masked LM's and span corruption's fixed counts per sequence,
    images); examples masked by data.loss_on, padded or packed do not."""
    return cfg.data.format == "text"


def global_loss_tokens(pm: ParallelModel, micro_batches, cfg: Config, device) -> int:
    """N: the loss tokens of the whole global batch (at least 1), from this rank's micro-batches
    (after the context-parallel split)."""
    local = sum(loss_tokens(micro_batch_parts(mb)[1]) for mb in micro_batches)
    ranks = pm.dims.dp * pm.dims.cp
    if equal_loss_tokens(cfg) or ranks == 1:
        return max(local * ranks, 1)
    count = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(count)  # over every rank: tensor and pipeline ranks hold copies of their dp rank's count
    return max(int(count) // (pm.dims.tp * pm.dims.pp), 1)


def tokens_per_rank(pm: ParallelModel, micro_batches, cfg: Config, device) -> float:
    """N / R: the global batch's loss tokens over the ranks that average gradients (dp x cp)."""
    return global_loss_tokens(pm, micro_batches, cfg, device) / (pm.dims.dp * pm.dims.cp)


def forward_backward(pm: ParallelModel, micro_batches, cfg: Config, device) -> float:
    """Gradients of the global batch's loss (its token losses' sum over its loss tokens, see the
    module docstring) from this rank's micro-batches; returns this rank's part of it times R,
    whose mean over the ranks is the global loss."""
    per_rank = tokens_per_rank(pm, micro_batches, cfg, device)
    total = torch.zeros((), device=device)
    count = len(micro_batches)
    set_aux_loss_scale(pm.model, 1 / count)  # MoE aux losses are scaled per micro-batch, not per token
    for index, micro_batch in enumerate(micro_batches):
        inputs, targets, document_ids = micro_batch_parts(micro_batch)
        tokens = loss_tokens(targets)
        is_last = index == count - 1
        with pm.sync.micro_batch(is_last), pm.loss_context():
            loss = loss_of(pm.module, inputs.to(device), targets.to(device), autocast_dtype=cfg.train.autocast_dtype,
                           device=device, targets_kwarg=pm.targets_kwarg(cfg),
                           model_kwargs=document_ids_kwargs(pm.plan, document_ids, device))
            # loss x R c / N, written as one division (a mean of means divides by exactly count)
            loss = loss / (per_rank / tokens) if tokens else loss * 0.0
            loss.backward()
        pm.sync.after_backward(is_last)
        detached = loss.detach()
        total += detached.full_tensor() if isinstance(detached, DTensor) else detached
    return float(total)


def pipeline_forward_backward(pm: ParallelModel, micro_batches, cfg: Config, device) -> float:
    """The same through the pipeline schedule, which runs all micro-batches (with the same
    `token_loss`, weighted by the same shares of the loss tokens) and divides the gradients by
    their count itself; the gradient sync sees the whole schedule as accumulation, then reduces once."""
    set_aux_loss_scale(pm.model, 1.0)
    per_micro_batch = tokens_per_rank(pm, micro_batches, cfg, device) / len(micro_batches)
    with pm.sync.micro_batch(is_last=False), pm.loss_context(), autocast_context(device, cfg.train.autocast_dtype):
        loss = pm.pipeline.step(micro_batches, device, tokens_per_micro_batch=per_micro_batch)
    pm.sync.after_backward(is_last=True)
    pm.pipeline.finish_gradients()
    return loss


def split_for_context(pm: ParallelModel, micro_batches):
    """This rank's share of each sequence under context parallelism. Its ring and all-to-all
    attention have no document mask: Config.validate_post_training refuses packing and document
    masks with cp > 1, and a packed micro-batch that got here anyway never reaches them."""
    if pm.context is None:
        return micro_batches
    if any(micro_batch_parts(micro_batch)[2] is not None for micro_batch in micro_batches):
        raise ValueError(f"parallel.cp = {pm.dims.cp} takes no packed or document-masked batches (data.packing, "
                         "data.document_mask): its attention has no document mask; use parallel.cp = 1")
    return pm.context.split_batches(micro_batches)


def poison_gradients(pm: ParallelModel) -> None:
    """An injected fault (train/faults.py, `nan@STEP`): the gradients an overflow would leave."""
    grads = [param.grad for param in pm.model.parameters() if param.grad is not None]
    for grad in [*grads, *pm.sync.grad_tensors()]:  # ZeRO keeps its reduced shards apart
        grad.fill_(float("nan"))


def train_step(pm: ParallelModel, optimizer, micro_batches, cfg: Config, device, *,
               poison: bool = False) -> tuple[float, float]:
    """One optimizer step over the accumulated micro-batches: (this rank's mean loss, global grad
    norm before clipping). A non-finite global grad norm (the same on every rank) skips the
    optimizer step: what to do about it is the caller's (train.on_nonfinite)."""
    if cfg.train.objective == "dpo":  # preference pairs (train/dpo.py): the step's reward sums come third
        loss, rewards = dpo_forward_backward(pm, micro_batches, cfg, device)
        return (*apply_gradients(pm, optimizer, cfg, loss, poison=poison), rewards)
    micro_batches = split_for_context(pm, micro_batches)
    run = forward_backward if pm.pipeline is None else pipeline_forward_backward
    loss = run(pm, micro_batches, cfg, device)
    return apply_gradients(pm, optimizer, cfg, loss, poison=poison)


def apply_gradients(pm: ParallelModel, optimizer, cfg: Config, loss: float, *,
                    poison: bool = False) -> tuple[float, float]:
    """After forward and backward: clip, and the optimizer step unless the global grad norm is not
    finite; (the loss, the grad norm before clipping)."""
    if poison:
        loss = float("nan")
        poison_gradients(pm)
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    grad_norm = pm.sync.clip_grad_norm_(max_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
        pm.sync.after_step()
    return loss, grad_norm
