"""Ring and all-to-all attention against full attention on one process: outputs and gradients of
q, k, v, causal and not, zigzag and contiguous chunks, GQA; and the block kernels against their
plain-torch definition."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.distributed.context_parallel import RingAttention, UlyssesAttention, local_positions
from shardwise.distributed.ring_attention import (
    block_backward,
    block_forward,
    math_block_backward,
    math_block_forward,
)

B, H, KV_H, S, D = 2, 4, 2, 32, 8


def full_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64).float() for h in (H, KV_H, KV_H))
    dout = torch.randn(B, H, S, D, generator=gen)
    return q, k, v, dout


def full_attention(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)


def reference(causal, seed=0):
    q, k, v, dout = full_inputs(seed)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = full_attention(q, k, v, causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def cp_attention_job(mode: str, causal: bool, load_balance: bool, seed: int = 0):
    """Every rank: its share of q, k, v (the chunks the layout gives it), attention across the
    ranks, backward of its share of dout; returns (positions, out, dq, dk, dv) of its share."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    rank = mesh.get_local_rank()
    positions = local_positions(S, cp, rank, load_balance=load_balance)
    q, k, v, dout = (t[:, :, positions] for t in full_inputs(seed))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if mode == "ring":
        attention = RingAttention(mesh.get_group(), load_balance=load_balance)
        from shardwise.distributed.ring_attention import ring_attention

        out = ring_attention(q, k, v, ring=attention.ring, chunks_of=attention.chunks_of, causal=causal,
                             work=attention.work)
    else:
        out = UlyssesAttention(mesh.get_group())(q, k, v)
    out.backward(dout)
    return positions, out.detach(), q.grad, k.grad, v.grad


def assemble(by_rank):
    full = [torch.zeros(B, h, S, D) for h in (H, H, KV_H, KV_H)]
    for positions, *pieces in by_rank:
        for whole, piece in zip(full, pieces):
            whole[:, :, positions] = piece
    return full


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["zigzag", "contiguous"])
def test_ring_attention_equals_full_attention_cp2(pool2, causal, load_balance):
    got = assemble(pool2.run(cp_attention_job, "ring", causal, load_balance))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference(causal)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_equals_full_attention_cp4(pool4, causal):
    got = assemble(pool4.run(cp_attention_job, "ring", causal, True))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference(causal)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_alltoall_attention_equals_full_attention_cp2(pool2):
    got = assemble(pool2.run(cp_attention_job, "alltoall", True, False))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference(True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_matches_its_definition(causal):
    q, k, v, dout = full_inputs(1)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scale = D ** -0.5
    out, lse = block_forward(q, k, v, causal, scale)
    ref_out, ref_lse = math_block_forward(q, k, v, causal, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    grads = block_backward(dout, q, k, v, out, lse, causal, scale)
    ref_grads = math_block_backward(dout, q, k, v, ref_out, ref_lse, causal, scale)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=1e-4, atol=1e-5)


def test_zigzag_positions_cover_the_sequence_once():
    for cp in (1, 2, 4):
        for balance in (True, False):
            seen = torch.cat([local_positions(16, cp, r, load_balance=balance) for r in range(cp)])
            assert sorted(seen.tolist()) == list(range(16))
    assert local_positions(16, 2, 0, load_balance=True).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1, load_balance=True).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
