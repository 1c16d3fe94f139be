"""The training loss, one function for every path (one process, data/tensor/context parallel,
and the pipeline's last stage)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the predictions whose target is not -100 (a masked LM's unmasked
    tokens), in fp32 whatever the compute dtype: a bf16 log-softmax over a large vocabulary loses
    the small probabilities that carry the gradient. The logits are [..., classes] with the targets'
    shape before the last dimension: [B, S, vocab] for a language model, [B, classes] for a
    classifier (ViT)."""
    return F.cross_entropy(logits_BSV.float().flatten(0, -2), targets_BS.flatten())


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> int:
    """How many predictions (argmax of the logits) equal their target: a classifier's accuracy
    numerator."""
    return int((logits.argmax(dim=-1) == targets).sum())


def autocast_context(device: torch.device, dtype_name: str):
    """`train.autocast_dtype`: float32 runs as is, bfloat16 under torch.autocast."""
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype_name))


def loss_of(module, inputs_BS, targets_BS, *, autocast_dtype: str, device: torch.device,
            targets_kwarg: str | None = None) -> torch.Tensor:
    """The loss of one micro-batch: the forward under autocast, `token_loss` in fp32; with
    `targets_kwarg`, the model takes the targets and returns the loss itself (chunked)."""
    with autocast_context(device, autocast_dtype):
        if targets_kwarg:
            return module(inputs_BS, **{targets_kwarg: targets_BS})
        logits = module(inputs_BS)
    return token_loss(logits, targets_BS)
