"""The output projection and the cross-entropy as one chunked operation that never holds the
full [tokens, vocab] logits: the module-level rewrite rule of `shardwise/compile/rules/`.

    loss = linear_cross_entropy(h_ND, weight_VD, targets_N)

equals `F.cross_entropy((h @ weight.T).float(), targets)` (mean over the tokens whose target
is not `IGNORE_INDEX`). Tokens are taken LOSS_CHUNK_ELEMENTS[device] // vocab at a time
(config/units.py): each chunk's logits are computed in the compute dtype (autocast's, else
h's), their log-sum-exp and the gradient softmax - onehot in fp32, and the chunk's gradients
of h and of the weight are made there and then, in the forward (as Liger-Kernel's fused linear
cross-entropy does): the backward only scales them by the incoming gradient, in place, so
nothing is recomputed and nothing of vocabulary width is saved. The memory the loss needs
beyond its inputs is one chunk of fp32 logits and their gradient, plus the h and weight
gradients it returns, instead of the bf16 logits, their fp32 copy, the log-softmax and its
gradient (about 14 bytes per logit); planner/memory.py counts it, tests/planner/test_loss_memory.py
holds the count to the measured peak.

Why a module-level replacement and not a graph rule: the model returns logits and the loss
is taken outside the compiled blocks; the chunk loop is a Python loop whose per-chunk work
must not be fused back into one [tokens, vocab] buffer, which a graph rewrite followed by
inductor would not guarantee.
"""

from __future__ import annotations

import functools

import torch

from shardwise.core.units import loss_chunk_tokens

IGNORE_INDEX = -100


CPU_LOGITS_BUFFERS: dict[torch.dtype, torch.Tensor] = {}
"""One chunk's logits buffer per dtype, kept between calls on a CPU (see `logits_buffer`)."""


def logits_buffer(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a chunk's logits are written (and, in place, their gradient). On a CPU one buffer is kept
    and reused by every chunk and call: a fresh one is new memory from the system each time once it
    reaches glibc's 32 MiB mmap ceiling (vocabulary 8192 at 1,024 tokens a chunk), and writing into
    it page by page cost 10 ms of a 25 ms logits matmul (measured, 2-core CPU). The loss runs one
    chunk at a time and is done with it before the next, so one buffer serves; it is never returned.
    On an accelerator the caching allocator already reuses memory."""
    if device.type != "cpu":
        return torch.empty(rows, vocab, dtype=dtype, device=device)
    buffer = CPU_LOGITS_BUFFERS.get(dtype)
    if buffer is None or buffer.numel() < rows * vocab:
        buffer = CPU_LOGITS_BUFFERS[dtype] = torch.empty(rows * vocab, dtype=dtype)
    return buffer[:rows * vocab].view(rows, vocab)


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, chunk: int, fused: bool = False, shard=None):
        dtype = compute_dtype(h_ND)
        needs_weight_grad = ctx.needs_input_grad[1]
        needs_grad = ctx.needs_input_grad[0] or needs_weight_grad
        wide = torch.promote_types(dtype, torch.float32)  # fp32 at least, fp64 for fp64 inputs
        with torch.autocast(h_ND.device.type, enabled=False):
            weight = weight_VD.to(dtype)
            valid = targets_N != IGNORE_INDEX
            count = valid.sum().clamp(min=1).to(wide)
            total = torch.zeros((), dtype=wide, device=h_ND.device)
            grad_h = torch.empty_like(h_ND) if needs_grad else None
            # A frozen head (LoRA) takes no [vocab, width] gradient: its sum is neither made nor kept.
            grad_w = torch.zeros(weight_VD.shape, dtype=wide, device=h_ND.device) if needs_weight_grad else None
            for start in range(0, h_ND.shape[0], chunk):
                h = h_ND[start:start + chunk].to(dtype)
                # ignored tokens pick class 0 and are masked out by `keep`
                targets, keep = targets_N[start:start + chunk].clamp(min=0), valid[start:start + chunk]
                logits = torch.mm(h, weight.t(), out=logits_buffer(h.shape[0], weight.shape[0], dtype, h.device))
                if shard is not None:
                    loss, grad = eager_chunk_loss_and_gradient(logits, targets, keep, count, needs_grad, shard)
                else:
                    chunk_loss = fused_chunk() if fused else eager_chunk_loss_and_gradient
                    loss, grad = chunk_loss(logits, targets, keep, count, needs_grad)
                total += loss
                if needs_grad:
                    write_input_gradient(grad_h[start:start + chunk], grad, weight)
                    if needs_weight_grad:
                        add_weight_gradient(grad_w, grad, h)
                # Released before the next chunk's are made, not when the names are rebound after it:
                # one chunk of logits and of their gradient alive at a time (planner/memory.py).
                del logits, grad
        if needs_grad:
            ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        # The kept gradients are scaled in place and handed on: no second h- and weight-sized pair
        # while both are alive (Liger-Kernel's fused linear cross-entropy does the same). So this
        # backward runs once per forward.
        if getattr(ctx, "scaled", False):
            raise RuntimeError("linear_cross_entropy's backward ran already: its gradients are scaled in place, "
                               "so a second backward through the same loss (retain_graph=True) is not supported; "
                               "compute the loss again")
        ctx.scaled = True
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w.mul_(grad_loss.to(grad_w.dtype))
        return grad_h.mul_(grad_loss.to(grad_h.dtype)), grad_w, None, None, None, None


def write_input_gradient(grad_h: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor) -> None:
    """grad_h = grad @ weight, the matmul writing straight into the chunk's rows when the dtypes
    agree (no temporary, no copy)."""
    if grad_h.dtype == grad.dtype:
        torch.mm(grad, weight, out=grad_h)
    else:
        grad_h.copy_(grad @ weight)


def add_weight_gradient(grad_w: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w += grad.T @ h. On CUDA with 16-bit inputs cuBLAS accumulates the product straight into
    the fp32 sum (`out_dtype`): no 16-bit [vocab, width] product to round, convert and add (three
    passes over a weight-sized tensor per chunk). Where the dtypes agree the matmul accumulates in
    place (`addmm_`); otherwise (CPU has no out_dtype matmul) the product is made in the inputs'
    dtype and added."""
    if grad_w.is_cuda and grad.dtype in (torch.bfloat16, torch.float16) and grad_w.dtype == torch.float32:
        torch.addmm(grad_w, grad.t(), h, out_dtype=torch.float32, out=grad_w)
    elif grad_w.dtype == grad.dtype:
        grad_w.addmm_(grad.t(), h)
    else:
        grad_w += (grad.t() @ h).to(grad_w.dtype)


def eager_chunk_loss_and_gradient(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor,
                                  count: torch.Tensor, needs_grad: bool, shard=None):
    """`chunk_loss_and_gradient` eagerly, in place over one fp32 copy of the chunk's logits: the
    least memory the chunk can take outside a compiled kernel. With a `shard` (a
    `distributed/vocab_parallel_loss.VocabShard`), `logits` are this rank's columns of the
    vocabulary: the shard sums the row maxima and the sums (of exp, and of the target's logit,
    which one rank holds) over the ranks, so every rank gets the whole vocabulary's log-sum-exp and
    loss, and the gradient of its own columns."""
    dtype = logits.dtype
    logits = logits.to(torch.promote_types(dtype, torch.float32))
    targets, owned = shard.local_targets(targets, logits.shape[1]) if shard is not None else (targets, None)
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    if owned is not None:
        picked = torch.where(owned, picked, 0.0)
    # one exp over the chunk, in place: it gives both the log-sum-exp and the softmax
    top = logits.amax(dim=-1, keepdim=True)
    if shard is not None:
        top = shard.all_reduce(top, "max")
    probs = logits.sub_(top).exp_()
    sum_exp = probs.sum(dim=-1)
    if shard is not None:
        sum_exp, picked = shard.all_reduce(torch.stack([sum_exp, picked]), "sum")
    lse = top.squeeze(1) + sum_exp.log()
    loss = ((lse - picked) * keep).sum()
    if not needs_grad:
        return loss, None
    # d(mean loss)/d(logits) = (softmax - onehot) / count on kept tokens
    scale = keep / count
    grad = probs.mul_((scale / sum_exp)[:, None])
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= scale if owned is None else scale * owned
    return loss, grad.to(dtype)


def chunk_loss_and_gradient(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, count: torch.Tensor,
                            needs_grad: bool):
    """One chunk's summed loss over its kept tokens and, with `needs_grad`, d(mean loss)/d(logits)
    in the logits' dtype: `eager_chunk_loss_and_gradient`'s steps written functionally, for inductor to fuse
    into two passes over the logits (their log-sum-exp, then the gradient) instead of the ~10 passes
    over fp32 logits the eager steps take. Its softmax is exp(logit - lse) rather than the eager
    exp(logit - max) / sum: equal up to rounding."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    top = wide.amax(dim=-1, keepdim=True)
    lse = top + (wide - top).exp().sum(dim=-1, keepdim=True).log()
    loss = ((lse - wide.gather(1, targets[:, None])).squeeze(1) * keep).sum()
    if not needs_grad:
        return loss, None
    scale = (keep / count)[:, None]
    is_target = torch.arange(wide.shape[1], device=wide.device) == targets[:, None]
    grad = (wide - lse).exp() * scale - is_target * scale
    return loss, grad.to(logits.dtype)


@functools.cache
def fused_chunk():
    """`chunk_loss_and_gradient` under torch.compile, made once per process; it compiles once per
    shape (the chunk and the last, shorter one; later shapes compile dynamically)."""
    return torch.compile(chunk_loss_and_gradient)


def linear_cross_entropy(h: torch.Tensor, weight_VD: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None, fused: bool = False, split_vocabulary=None) -> torch.Tensor:
    """Mean cross-entropy of the logits h @ weight.T against targets, chunked (see the module
    docstring). h: [..., D], targets: [...]. `fused`: each chunk's softmax and gradient run compiled
    (`chunk_loss_and_gradient`; the model's blocks are compiled: `train.compile`).
    `split_vocabulary`: where a layout split the head weight by vocabulary over ranks, a function
    (h, weight) -> (h, this rank's weight rows, its shard) that the layout hands the model
    (`distributed/vocab_parallel_loss.py`): each rank then makes its columns' logits a chunk at a
    time and the shard sums their softmax statistics over the ranks, so no rank holds
    [tokens, vocab / tp] logits either; those chunks run eagerly."""
    shard = None
    if split_vocabulary is not None:
        h, weight_VD, shard = split_vocabulary(h, weight_VD)
        fused = False
    h_ND, targets_N = h.flatten(0, -2), targets.flatten()
    if not torch.is_grad_enabled():  # evaluation: no gradients to make in the forward
        h_ND, weight_VD = h_ND.detach(), weight_VD.detach()
    chunk = chunk or loss_chunk_tokens(shard.rows if shard else weight_VD.shape[0], h.device.type)
    return LinearCrossEntropy.apply(h_ND, weight_VD, targets_N, chunk, fused, shard)
