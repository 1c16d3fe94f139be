"""Ring attention (Liu et al., 2023) over the `cp` mesh axis, forward and backward, on any backend.

Each of the cp ranks holds the queries, keys and values of some chunks of the sequence. The key/
value block of every rank travels once around the ring; each rank attends its queries to the
block it holds, and the partial results are merged with the log-sum-exp rule (online softmax):

    for blocks a, b of keys:  lse = log(exp(lse_a) + exp(lse_b))
                              O   = exp(lse_a - lse) * O_a + exp(lse_b - lse) * O_b

so after cp steps every query has attended to the whole (causal) sequence exactly as one
softmax over all keys would. The send of the next block is started before the current block is
computed (`batch_isend_irecv`), so the transfer overlaps the computation where the backend
runs it in the background (gloo and NCCL both do).

Backward (as FlashAttention-2's, per block): with the final O and lse of each query, a block's
probabilities are P = exp(S - lse) and its gradients follow from dO and D = rowsum(dO * O)
alone, so the blocks are independent. dQ accumulates locally; dK and dV of a block travel with
it around the ring, each rank adding its part, and one last send brings them home. A rank
computes its part for the block it holds before it waits for the part the earlier ranks sent,
so that transfer overlaps computation too.

Causal masking works on chunks: a query chunk attends fully to earlier key chunks, causally to
its own chunk, and not at all to later ones (those pairs are skipped, not computed masked), so
the work per rank follows the chunking. With the zigzag (load-balanced) chunking of
`context_parallel.chunk_ids` every rank computes the same number of blocks at every step.

The block kernel returns the log-sum-exp: on CPU torch's fused flash kernel for CPU
(`_scaled_dot_product_flash_attention_for_cpu` and its backward); on CUDA in bf16/fp16 the
flash-attention kernel (not yet run on a GPU: no accelerator was available when it was written);
elsewhere (and as the reference in tests) the same math in plain torch.
Written by hand because PyTorch's context-parallel attention needs CUDA kernels (not gloo/CPU).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

FULL, CAUSAL, SKIP = "full", "causal", "skip"


def block_relation(query_chunk: int, key_chunk: int, causal: bool) -> str:
    """How a chunk of queries attends to a chunk of keys (chunks numbered along the sequence)."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return CAUSAL if key_chunk == query_chunk else SKIP


def blocks_to_compute(query_chunks: list[int], key_chunks: list[int], causal: bool):
    """(query chunk index, key chunk index, whether it is a causal diagonal block) of every pair
    that is not skipped, in a fixed order (forward and backward visit the same blocks)."""
    for i, query_chunk in enumerate(query_chunks):
        for j, key_chunk in enumerate(key_chunks):
            relation = block_relation(query_chunk, key_chunk, causal)
            if relation != SKIP:
                yield i, j, relation == CAUSAL


# -- the block kernel: attention of one query chunk to one key chunk, with its log-sum-exp ------------

def math_block_forward(q, k, v, causal: bool, scale: float):
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v.float()
    return out.to(q.dtype), lse


def math_block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    dout = dout.float()
    dv = probs.transpose(-1, -2) @ dout
    dprobs = dout @ v.float().transpose(-1, -2)
    delta = (dout * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    return dscores @ k.float(), dscores.transpose(-1, -2) @ q.float(), dv


def uses_cuda_flash(q: torch.Tensor) -> bool:
    """FlashAttention on CUDA takes half precision only; fp32 on CUDA uses the math kernel."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def block_forward(q, k, v, causal: bool, scale: float):
    """(O [B, H, Sq, D], lse [B, H, Sq] in fp32) of softmax(q k^T * scale) v."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    if uses_cuda_flash(q):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse.float()
    return math_block_forward(q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dQ, dK, dV) of one block, given the final O and lse of these queries over all keys."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if uses_cuda_flash(q):
        # The backward takes the forward's bookkeeping outputs (sequence offsets, RNG state), as
        # autograd passes them for SDPA; a block's forward is re-run to get them (cheap next to
        # the backward, and they do not depend on the values).
        _, _, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.to(torch.float32), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return math_block_backward(dout, q, k, v, out, lse, causal, scale)


def merge(out, lse, block_out, block_lse):
    """The log-sum-exp merge of a block's partial result into the running one (fp32)."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse)[..., None] + block_out.float() * torch.exp(block_lse - new_lse)[..., None]
    return out, new_lse


# -- the ring -----------------------------------------------------------------------------------------

class Ring:
    """Point-to-point exchange with the neighbours on the cp group: send to rank+1, receive from rank-1."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        self.size, self.rank, self.group = len(ranks), dist.get_rank(group), group
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def start(self, tensor: torch.Tensor):
        """Send `tensor` on and start receiving the previous rank's; returns (buffer, wait)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return wait


def split_chunks(x_BHSD: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    return list(x_BHSD.chunk(num_chunks, dim=2))


def expand_kv(x_BHSD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA: repeat each kv head for the query heads it serves (head h uses kv head h // repeats)."""
    repeats = num_heads // x_BHSD.shape[1]
    return x_BHSD if repeats == 1 else x_BHSD.repeat_interleave(repeats, dim=1)


def reduce_kv_grad(g_BHSD: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    B, H, S, D = g_BHSD.shape
    return g_BHSD if H == num_kv_heads else g_BHSD.view(B, num_kv_heads, H // num_kv_heads, S, D).sum(2)


class RingAttentionFunction(torch.autograd.Function):
    """O = softmax(Q K^T / sqrt(d) + causal mask) V over the whole sequence, with Q, K, V and O
    split by sequence chunks over the ring: `chunks_of[r]` are the chunk numbers rank r holds, in
    its local order. Keys and values may have fewer heads (GQA); they travel unexpanded."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, chunks_of: list[list[int]], causal: bool, work: list):
        scale = 1.0 / math.sqrt(q.shape[-1])
        mine = chunks_of[ring.rank]
        q_chunks = split_chunks(q, len(mine))
        outs, lses = [None] * len(mine), [None] * len(mine)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            wait = ring.start(kv) if step < ring.size - 1 else None
            theirs = chunks_of[(ring.rank - step) % ring.size]
            k_chunks = split_chunks(expand_kv(kv[0], q.shape[1]), len(theirs))
            v_chunks = split_chunks(expand_kv(kv[1], q.shape[1]), len(theirs))
            for i, j, diagonal in blocks_to_compute(mine, theirs, causal):
                start = time.perf_counter()
                o, lse = block_forward(q_chunks[i], k_chunks[j], v_chunks[j], diagonal, scale)
                outs[i], lses[i] = merge(outs[i], lses[i], o, lse)
                work[0] += q_chunks[i].shape[2] * k_chunks[j].shape[2] // (2 if diagonal else 1)
                work[1] += time.perf_counter() - start
            if wait is not None:
                kv = wait()
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.chunks_of, ctx.causal, ctx.scale, ctx.work = ring, chunks_of, causal, scale, work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, chunks_of, causal, scale = ctx.ring, ctx.chunks_of, ctx.causal, ctx.scale
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        mine = chunks_of[ring.rank]
        q_chunks, out_chunks = split_chunks(q, len(mine)), split_chunks(out, len(mine))
        dout_chunks, lse_chunks = split_chunks(dout.contiguous(), len(mine)), list(lse.chunk(len(mine), dim=2))
        dq = torch.zeros_like(q, dtype=torch.float32)
        dq_chunks = split_chunks(dq, len(mine))
        kv = torch.stack([k, v])
        incoming_dkv = None  # the gradients earlier ranks computed for the block this rank holds next
        for step in range(ring.size):
            wait_kv = ring.start(kv) if step < ring.size - 1 else None
            theirs = chunks_of[(ring.rank - step) % ring.size]
            k_full, v_full = expand_kv(kv[0], num_heads), expand_kv(kv[1], num_heads)
            dk_full = torch.zeros_like(k_full, dtype=torch.float32)
            dv_full = torch.zeros_like(v_full, dtype=torch.float32)
            k_chunks, v_chunks = split_chunks(k_full, len(theirs)), split_chunks(v_full, len(theirs))
            dk_chunks, dv_chunks = split_chunks(dk_full, len(theirs)), split_chunks(dv_full, len(theirs))
            for i, j, diagonal in blocks_to_compute(mine, theirs, causal):
                start = time.perf_counter()
                dqb, dkb, dvb = block_backward(dout_chunks[i], q_chunks[i], k_chunks[j], v_chunks[j],
                                               out_chunks[i], lse_chunks[i], diagonal, scale)
                dq_chunks[i] += dqb
                dk_chunks[j] += dkb
                dv_chunks[j] += dvb
                ctx.work[1] += time.perf_counter() - start
            dkv = torch.stack([reduce_kv_grad(dk_full, num_kv_heads), reduce_kv_grad(dv_full, num_kv_heads)])
            if incoming_dkv is not None:
                dkv += incoming_dkv()
            # The block's gradients go on with it (the transfer overlaps the next step's blocks);
            # the last send brings each block's completed gradients home to its owner.
            incoming_dkv = ring.start(dkv)
            if wait_kv is not None:
                kv = wait_kv()
        dkv = incoming_dkv()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


@torch.compiler.disable
def ring_attention(q, k, v, *, ring: Ring, chunks_of: list[list[int]], causal: bool = True, work=None):
    """Ring attention of this rank's queries (see RingAttentionFunction); `work`, a list
    [score elements, seconds], accumulates the query-key score elements computed in forward (a
    causal block counts half) and the seconds spent in block kernels, forward and backward.

    Eager under train.compile, between the block's compiled graphs, as an opaque attention kernel
    is: dynamo cannot trace the ring's point-to-point ops, and `work` is counted in Python as it
    runs. Traced, it broke into a dozen small graphs (each compiled for forward and backward) and
    recompiled some of them at the second step."""
    return RingAttentionFunction.apply(q, k, v, ring, chunks_of, causal, work if work is not None else [0, 0.0])
