"""The training loss, one function for every path (one process, data/tensor/context parallel,
and the pipeline's last stage), and what a micro-batch holds (the micro-batch contract:
(inputs, targets) or, packed, (inputs, targets, document_ids), int64 [B, S]; target -100 = no loss)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from shardwise.models.common.chunked_loss import IGNORE_INDEX


def token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the predictions whose target is not -100 (a masked LM's unmasked
    tokens), in fp32 whatever the compute dtype: a bf16 log-softmax over a large vocabulary loses
    the small probabilities that carry the gradient. The logits are [..., classes] with the targets'
    shape before the last dimension: [B, S, vocab] for a language model, [B, classes] for a
    classifier (ViT). A micro-batch without loss tokens (all targets -100: a packed or masked row
    can leave one) has loss 0 and zero gradients, where the mean would be 0/0."""
    loss = F.cross_entropy(logits_BSV.float().flatten(0, -2), targets_BS.flatten())
    return torch.where(targets_BS.ne(IGNORE_INDEX).any(), loss, 0.0)


def loss_tokens(targets_BS: torch.Tensor) -> int:
    """How many predictions of a micro-batch carry a loss (target not -100)."""
    return int(targets_BS.ne(IGNORE_INDEX).sum())


def micro_batch_parts(micro_batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, document ids or None) of a micro-batch of either form."""
    inputs, targets, *rest = micro_batch
    return inputs, targets, (rest[0] if rest else None)


def document_ids_kwargs(plan, document_ids_BS: torch.Tensor | None, device: torch.device) -> dict:
    """The model's keyword arguments for a micro-batch's document ids (none for a plain batch)."""
    if document_ids_BS is None:
        return {}
    if plan.document_ids_kwarg is None:
        raise ValueError("this model family takes no document ids: data.packing and data.document_mask are "
                         "for decoder language models (llama, gpt2); set them to false")
    return {plan.document_ids_kwarg: document_ids_BS.to(device)}


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
            targets_kwarg: str | None = None, model_kwargs: dict | None = None) -> torch.Tensor:
    """The mean loss of one micro-batch over its loss tokens: the forward under autocast,
    `token_loss` in fp32; with `targets_kwarg`, the model takes the targets and returns the loss
    itself (chunked). `model_kwargs`: further inputs of the model (a packed batch's document ids)."""
    model_kwargs = model_kwargs or {}
    with autocast_context(device, autocast_dtype):
        if targets_kwarg:
            return module(inputs_BS, **model_kwargs, **{targets_kwarg: targets_BS})
        logits = module(inputs_BS, **model_kwargs)
    return token_loss(logits, targets_BS)
