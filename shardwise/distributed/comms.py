"""Collectives as autograd.Functions, each with its math.

All-to-all for Ulysses context parallelism, on a group of p ranks. With X the full [B, H, S, D]
tensor, rank r holds X[:, :, S_r, :] (its sequence share S_r, all heads) and needs
X[:, H_r, :, :] (heads H_r = r·H/p .. (r+1)·H/p, the whole sequence):

    sequence_to_heads:  Y_r = concat_s X_s[:, H_r]     (along the sequence, in rank order)
    heads_to_sequence:  the inverse, X_r[:, H_s] = Y_s[:, :, S_r]

Each is the other's backward (an all-to-all's adjoint is the all-to-all with the roles of
sender and receiver exchanged). Bytes per rank and call: (p-1)/p of the local tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i."""
    send = send.contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def sequence_to_heads(x_BHSD: torch.Tensor, group) -> torch.Tensor:
    p = dist.get_world_size(group)
    B, H, S, D = x_BHSD.shape
    send = x_BHSD.reshape(B, p, H // p, S, D).transpose(0, 1)          # [p, B, H/p, S_local, D]
    got = _all_to_all(send, group)                                      # [p (source), B, H/p, S_local, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // p, p * S, D)


def heads_to_sequence(y_BHSD: torch.Tensor, group) -> torch.Tensor:
    p = dist.get_world_size(group)
    B, Hp, S, D = y_BHSD.shape
    send = y_BHSD.reshape(B, Hp, p, S // p, D).permute(2, 0, 1, 3, 4)   # [p, B, H/p, S_local, D]
    got = _all_to_all(send, group)                                      # [p (source heads), B, H/p, S_local, D]
    return got.transpose(0, 1).reshape(B, p * Hp, S // p, D)


class AllToAll(torch.autograd.Function):
    """`forward_fn` in forward, its adjoint `backward_fn` (the reverse all-to-all) in backward."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def all_to_all_sequence_to_heads(x_BHSD: torch.Tensor, group) -> torch.Tensor:
    return AllToAll.apply(x_BHSD, group, sequence_to_heads, heads_to_sequence)


def all_to_all_heads_to_sequence(y_BHSD: torch.Tensor, group) -> torch.Tensor:
    return AllToAll.apply(y_BHSD, group, heads_to_sequence, sequence_to_heads)
