"""The training step's loss on hand-built micro-batches (train/step.py): with uneven loss tokens it is
the global batch's token mean (the sum of its token losses over their count), not a mean of the
micro-batches' means; a micro-batch without loss tokens adds nothing (no NaN); packed micro-batches
carry their document ids to the model; plain text keeps its mean of means bit for bit; context
parallelism refuses a packed batch.

One process, the debug model in fp32; tolerance rtol = atol = 1e-5 where two computations sum in a
different order (one loss over all tokens against the step's weighted micro-batch means).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.parallelize import parallelize_config
from shardwise.models.common.loss import loss_of
from shardwise.train.step import forward_backward, split_for_context

CPU = torch.device("cpu")
SEQ_LEN = 16


def laid_out(tiny_config, **overrides):
    cfg = tiny_config(**{"train.seq_len": SEQ_LEN, "train.global_batch_size": 6, **overrides})
    return cfg, parallelize_config(cfg, ParallelDims.from_config(cfg.parallel, 1), device=CPU)


def uneven_micro_batches(vocab: int) -> list[tuple[torch.Tensor, ...]]:
    """Three packed micro-batches of 2 rows: 27, 0 and 5 loss tokens; two documents a row."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for loss_tokens in ([15, 12], [0, 0], [5, 0]):
        inputs = torch.randint(0, vocab, (2, SEQ_LEN), generator=gen)
        targets = torch.randint(0, vocab, (2, SEQ_LEN), generator=gen)
        for row, kept in enumerate(loss_tokens):
            targets[row, kept:] = -100
        document_ids = (torch.arange(SEQ_LEN) >= 7).long().expand(2, SEQ_LEN).clone()
        batches.append((inputs, targets, document_ids))
    return batches


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked_loss", "logits_loss"])
def test_step_loss_is_the_global_batch_token_mean(tiny_config, chunked):
    cfg, pm = laid_out(tiny_config, **{"data.format": "prompt_completion", "data.packing": True,
                                       "train.chunked_loss": chunked})
    reference = copy.deepcopy(pm.model)
    batches = uneven_micro_batches(cfg.model.vocab_size)
    loss = forward_backward(pm, batches, cfg, CPU)
    token_losses = [F.cross_entropy(reference(x, document_ids_BS=d).flatten(0, 1), y.flatten(), reduction="sum")
                    for x, y, d in batches]
    expected = sum(token_losses) / 32
    expected.backward()
    torch.testing.assert_close(torch.tensor(loss), expected.detach(), rtol=1e-5, atol=1e-5)
    for (name, param), ref in zip(pm.model.named_parameters(), reference.parameters()):
        assert torch.isfinite(param.grad).all(), name
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-5, msg=name)
    # a mean of the micro-batches' means would weigh the 5-token micro-batch as the 27-token one
    assert abs(loss - sum(float(t.detach()) / n for t, n in zip(token_losses, (27, 1, 5))) / 3) > 1e-3


def test_validation_loss_is_the_token_mean_over_the_evaluated_batches(tiny_config):
    from shardwise.train.evaluate import evaluate

    cfg, pm = laid_out(tiny_config, **{"data.format": "prompt_completion", "data.packing": True,
                                       "train.eval_batches": 2})
    batches = uneven_micro_batches(cfg.model.vocab_size)
    loader = SimpleNamespace(batch_of_step=lambda index: batches[:2] if index == 0 else batches[2:])
    with torch.no_grad():
        summed = sum(F.cross_entropy(pm.model(x, document_ids_BS=d).flatten(0, 1), y.flatten(), reduction="sum")
                     for x, y, d in batches)
    assert evaluate(pm, loader, cfg, CPU)["val_loss"] == pytest.approx(float(summed) / 32, rel=1e-6)


def test_plain_text_step_is_the_mean_of_micro_batch_means_bit_for_bit(tiny_config):
    """Text windows hold equal loss tokens: the step divides each micro-batch's mean by the number of
    micro-batches, exactly as before the token count existed."""
    cfg, pm = laid_out(tiny_config)
    reference = copy.deepcopy(pm.model)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, cfg.model.vocab_size, (2, SEQ_LEN), generator=gen) for _ in range(2))
               for _ in range(3)]
    loss = forward_backward(pm, batches, cfg, CPU)
    expected = torch.zeros(())
    for x, y in batches:
        micro = loss_of(reference, x, y, autocast_dtype="float32", device=CPU, targets_kwarg="targets_BS") / 3
        micro.backward()
        expected += micro.detach()
    assert loss == float(expected)
    for (name, param), ref in zip(pm.model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, ref.grad), name


def test_a_packed_batch_never_reaches_context_parallel_attention():
    pm = SimpleNamespace(context=object(), dims=SimpleNamespace(cp=2))
    packed = [(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4))]
    with pytest.raises(ValueError, match=r"parallel.cp = 2 takes no packed or document-masked batches"):
        split_for_context(pm, packed)
