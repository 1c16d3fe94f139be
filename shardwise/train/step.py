"""One optimizer step of a laid-out model: forward and backward of the step's micro-batches
(directly, or through the pipeline schedule), the gradient sync, clipping and AdamW."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from shardwise.config.schema import Config
from shardwise.distributed.parallelize import ParallelModel
from shardwise.models.common.loss import autocast_context, loss_of
from shardwise.models.common.moe import set_aux_loss_scale


def forward_backward(pm: ParallelModel, micro_batches, cfg: Config, device) -> float:
    """Gradients of the mean loss over the accumulated micro-batches; returns this rank's mean
    loss. Each micro-batch holds the same number of tokens, so the mean of means is the mean
    over the rank's share of the global batch."""
    total = torch.zeros((), device=device)
    count = len(micro_batches)
    set_aux_loss_scale(pm.model, 1 / count)  # MoE aux losses are scaled as the loss is
    for index, (inputs, targets) in enumerate(micro_batches):
        is_last = index == count - 1
        with pm.sync.micro_batch(is_last), pm.loss_context():
            loss = loss_of(pm.module, inputs.to(device), targets.to(device), autocast_dtype=cfg.train.autocast_dtype,
                           device=device, targets_kwarg=pm.targets_kwarg(cfg)) / count
            loss.backward()
        pm.sync.after_backward(is_last)
        detached = loss.detach()
        total += detached.full_tensor() if isinstance(detached, DTensor) else detached
    return float(total)


def pipeline_forward_backward(pm: ParallelModel, micro_batches, cfg: Config, device) -> float:
    """The same through the pipeline schedule, which runs all micro-batches (with the same
    `token_loss`) and divides the gradients by their count itself; the gradient sync sees the
    whole schedule as accumulation, then reduces once."""
    set_aux_loss_scale(pm.model, 1.0)
    with pm.sync.micro_batch(is_last=False), pm.loss_context(), autocast_context(device, cfg.train.autocast_dtype):
        loss = pm.pipeline.step(micro_batches, device)
    pm.sync.after_backward(is_last=True)
    pm.pipeline.finish_gradients()
    return loss


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
    if pm.context is not None:
        micro_batches = pm.context.split_batches(micro_batches)
    run = forward_backward if pm.pipeline is None else pipeline_forward_backward
    loss = run(pm, micro_batches, cfg, device)
    if poison:
        loss = float("nan")
        poison_gradients(pm)
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    grad_norm = pm.sync.clip_grad_norm_(max_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
        pm.sync.after_step()
    return loss, grad_norm
