"""Evaluation on the validation split (data.val_fraction) under any layout: the training forward,
without backward, over the same `train.eval_batches` global batches every time.

Every path of the training step is kept, so the validation loss of a layout equals one process's
(tests/distributed/test_validation.py): context parallelism splits each sequence as in training,
tensor parallelism takes the loss over each rank's vocabulary columns (chunked, or from
vocabulary-sharded logits with `train.chunked_loss = false`), and a pipeline runs its schedule
forward only (torch's `schedule.eval`). The model is in eval mode, so MoE layers add no auxiliary
loss and record no routing statistics: `val_loss` is the language-model loss alone, the mean over
every evaluated loss token (token-weighted: micro-batches of examples hold different counts).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.data.training_data import is_image_run
from shardwise.distributed.grad_sync import mean_over_dp
from shardwise.distributed.parallelize import ParallelModel
from shardwise.models.common.loss import (autocast_context, correct_predictions, document_ids_kwargs, loss_of,
                                          loss_tokens, micro_batch_parts, token_loss)
from shardwise.train.step import split_for_context


def micro_batch_losses(pm: ParallelModel, micro_batches, cfg, device, *,
                       count_correct: bool = False) -> tuple[list[float], list[int]]:
    """This rank's loss of each micro-batch, forward only (empty off a pipeline's last stage), and
    with `count_correct` a classifier's right answers in each."""
    if pm.pipeline is not None:
        with pm.loss_context(), autocast_context(device, cfg.train.autocast_dtype):
            return pm.pipeline.evaluate(micro_batches, device, count_correct=count_correct)
    losses, correct = [], []
    for micro_batch in micro_batches:
        inputs, targets, document_ids = micro_batch_parts(micro_batch)
        inputs, targets = inputs.to(device), targets.to(device)
        with pm.loss_context():
            if count_correct:  # a classifier's logits are small: [batch, classes]
                with autocast_context(device, cfg.train.autocast_dtype):
                    logits = pm.module(inputs)
                loss = token_loss(logits, targets)
                correct.append(correct_predictions(logits, targets))
            else:
                loss = loss_of(pm.module, inputs, targets, autocast_dtype=cfg.train.autocast_dtype, device=device,
                               targets_kwarg=pm.targets_kwarg(cfg),
                               model_kwargs=document_ids_kwargs(pm.plan, document_ids, device))
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
    return losses, correct


def evaluate(pm: ParallelModel, val_loader, cfg, device) -> dict[str, float]:
    """{"val_loss": mean loss over the evaluation batches' loss tokens, "val_ppl": exp of it} and,
    for a classifier (ViT), "val_accuracy": the fraction of the evaluated images it labels right.
    Every rank calls it at the same step (it is collective) and gets the same figures."""
    was_training = pm.module.training
    pm.module.eval()
    count_correct = is_image_run(cfg)
    loss_sum, tokens, right = 0.0, 0, 0.0
    try:
        with torch.no_grad():
            for index in range(cfg.train.eval_batches):
                micro_batches = split_for_context(pm, val_loader.batch_of_step(index))
                losses, correct = micro_batch_losses(pm, micro_batches, cfg, device, count_correct=count_correct)
                if losses:  # this rank computed them (a pipeline's last stage; every rank otherwise)
                    counts = [loss_tokens(micro_batch_parts(micro_batch)[1]) for micro_batch in micro_batches]
                    loss_sum += sum(loss * count for loss, count in zip(losses, counts))
                    tokens += sum(counts)
                if count_correct:
                    share = sum(correct) / (len(correct) * cfg.train.micro_batch_size) if correct else 0.0
                    right += mean_over_dp(share, pm.dims)
    finally:
        pm.module.train(was_training)
    val_loss = token_weighted_mean(loss_sum, tokens, pm.dims, device)
    figures = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}
    if count_correct:
        figures["val_accuracy"] = right / cfg.train.eval_batches
    return figures


def token_weighted_mean(loss_sum: float, tokens: int, dims, device) -> float:
    """The loss per loss token over every rank's evaluated tokens (summed over all ranks: a tensor-
    parallel copy adds the same to both sums, a rank without losses nothing)."""
    if dims.is_distributed:
        sums = torch.tensor([loss_sum, tokens], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        loss_sum, tokens = float(sums[0]), float(sums[1])
    return loss_sum / max(tokens, 1)
