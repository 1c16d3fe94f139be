"""The chunked loss under tensor parallelism (distributed/vocab_parallel_loss.py):
each rank takes its rows of a head weight split by vocabulary (a DTensor, torch.chunk's uneven
pieces), a chunk of tokens at a time, and all-reduces the softmax's row maxima and sums. Against one
process's loss on full logits: the loss and both gradients; against the planner: its peak memory."""

import pytest
import torch

from shardwise.core.model import ModelConfig
from shardwise.models.families import validate_model
from shardwise.planner.layout import Layout
from shardwise.planner.memory import loss_bytes, norm_saved_tensors

pytestmark = pytest.mark.slow

TOKENS, VOCAB, DIM = 96, 515, 16  # 515 over 2 ranks: 258 and 257 rows


def operands(tokens=TOKENS, vocab=VOCAB, dim=DIM):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, tokens // 2, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * 0.5
    targets = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    targets[0, :5] = -100  # ignored tokens
    targets[1, :3] = torch.tensor([0, vocab // 2 + 1, vocab - 1])  # both ranks' first and last rows
    return h, weight, targets


def vocab_parallel_job(sequence_parallel: bool, chunk: int) -> dict:
    """The loss and gradients on this rank, with h replicated or split by sequence (as sp hands it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardwise.distributed.vocab_parallel_loss import vocab_parallel_operands
    from shardwise.models.common.chunked_loss import linear_cross_entropy

    mesh = init_device_mesh("cpu", (2,))
    h, weight, targets = operands()
    table = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    leaf = h.clone().requires_grad_()
    h_in = DTensor.from_local(leaf, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]) if sequence_parallel else leaf
    loss = linear_cross_entropy(h_in, table, targets, chunk=chunk, split_vocabulary=vocab_parallel_operands)
    loss.backward()
    return {"loss": loss.item(), "h_grad": leaf.grad, "weight_grad": table.grad.full_tensor(),
            "rows": table.to_local().shape[0]}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("chunk", [40, None], ids=["3-chunks", "one-chunk"])
def test_vocab_parallel_chunked_loss_equals_the_full_loss(pool2, sequence_parallel, chunk):
    from shardwise.models.common.loss import token_loss

    h, weight, targets = operands()
    h.requires_grad_()
    weight.requires_grad_()
    expected = token_loss(h @ weight.t(), targets)
    expected.backward()
    for rank, result in enumerate(pool2.run(vocab_parallel_job, sequence_parallel, chunk)):
        assert result["rows"] == [258, 257][rank]
        # fp32: the ranks' sums of exp and the chunks' sums add in another order than one softmax
        torch.testing.assert_close(torch.tensor(result["loss"]), expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["h_grad"], h.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(result["weight_grad"], weight.grad, rtol=1e-5, atol=1e-7)


def peak_job(tokens: int, vocab: int, dim: int) -> int:
    """Peak bytes of the loss's forward and backward on this rank, beyond its inputs and their
    gradients (`PeakLiveBytes`), h replicated as plain tensor parallelism hands it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardwise.distributed.vocab_parallel_loss import vocab_parallel_operands
    from shardwise.models.common import chunked_loss
    from shardwise.observe.activations import PeakLiveBytes

    chunked_loss.CPU_LOGITS_BUFFERS.clear()  # the kept chunk buffer is counted when it is made
    mesh = init_device_mesh("cpu", (2,))
    h, weight, targets = operands(tokens, vocab, dim)
    h.requires_grad_()
    table = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    h.grad, table.grad = torch.zeros_like(h), torch.zeros_like(table)  # the gradients exist either way
    local = table.to_local()
    with PeakLiveBytes() as live:
        chunked_loss.linear_cross_entropy(h, table, targets, split_vocabulary=vocab_parallel_operands).backward()
    assert local.untyped_storage().data_ptr() == table.to_local().untyped_storage().data_ptr()
    return live.peak


def test_vocab_parallel_loss_memory_is_the_planners_count(pool2):
    """The rank with more rows, at 1,024 tokens and vocabulary 32,769 (16,385 and 16,384 rows; both
    take 511 tokens a chunk, the larger piece's count, or their all-reduces would not pair up):
    measured against `loss_bytes` under tp = 2."""
    tokens, vocab, dim = 1024, 32769, 64
    measured = max(pool2.run(peak_job, tokens, vocab, dim))
    model = validate_model(ModelConfig(dim=dim, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=dim, vocab_size=vocab))
    layout = Layout(micro_batch=1, seq_len=tokens, tp=2, chunked_loss=True, dtype="fp32")
    kept, workspace = loss_bytes(model, layout, tokens, 4, "cpu")
    predicted = kept + workspace - norm_saved_tensors(model) * dim * 4 * tokens
    # 2%, as in tests/planner/test_loss_memory.py: the count leaves out the per-token vectors
    assert predicted == pytest.approx(measured, rel=0.02), (measured / 2**20, predicted / 2**20)


def empty_shard_job() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardwise.distributed.vocab_parallel_loss import vocab_parallel_operands
    from shardwise.models.common.chunked_loss import linear_cross_entropy

    table = distribute_tensor(torch.randn(1, DIM), init_device_mesh("cpu", (2,)), [Shard(0)])  # rank 1: no rows
    try:
        linear_cross_entropy(torch.randn(4, DIM), table, torch.zeros(4, dtype=torch.long),
                             split_vocabulary=vocab_parallel_operands)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_rank_without_vocabulary_rows_is_refused_on_every_rank_alike(pool2):
    """Decided from the global shape, so no rank is left waiting in an all-reduce the others skip."""
    messages = pool2.run(empty_shard_job)
    assert messages[0] == messages[1]
    assert "needs vocabulary rows on every one of 2 tensor-parallel ranks; 1 rows leave one without" in messages[0]
