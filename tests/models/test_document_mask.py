"""Packed batches with document masks (models/common/document_mask.py): the loss of a packed batch
equals the per-token losses of the same examples run one by one, for llama (grouped-query
attention, a sliding window shorter than the examples) and gpt2 (learned positions).

fp32 on CPU, tiny random models; tolerance rtol = atol = 1e-5: the packed and the lone forward
run the same ops on the same values, except that the packed attention's softmax spans masked
keys (exp(-inf) = 0) and its matmuls run over a longer row, which moves the last bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardwise.config.presets import model_config
from shardwise.models.build import build_on_meta
from shardwise.models.common.attention import causal_attention
from shardwise.models.common.document_mask import (dense_document_mask, document_mask, document_mask_mod,
                                                   document_positions)

RTOL = ATOL = 1e-5
LENGTHS = [[8, 13, 6], [11, 9, 5]]
"""Tokens of each example (inputs are all but the last), packed per row; row 1 ends in padding."""
SEQ_LEN = 25


def tiny_model(preset: str, **overrides):
    model = build_on_meta(dataclasses.replace(model_config(preset), **overrides))
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return model.eval()


def examples(vocab: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (n,), generator=gen) for n in row] for row in LENGTHS]


def packed(rows: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, document_ids) [rows, SEQ_LEN]: each example's (tokens[:-1], tokens[1:]) with
    document id k, then padding (target -100) under the next id, as the contract's packer lays them out."""
    inputs, targets, ids = [], [], []
    for row in rows:
        x = torch.cat([ex[:-1] for ex in row])
        y = torch.cat([ex[1:] for ex in row])
        d = torch.cat([torch.full((len(ex) - 1,), k) for k, ex in enumerate(row)])
        pad = SEQ_LEN - len(x)
        inputs.append(F.pad(x, (0, pad)))
        targets.append(F.pad(y, (0, pad), value=-100))
        ids.append(F.pad(d, (0, pad), value=len(row)))
    return torch.stack(inputs), torch.stack(targets), torch.stack(ids)


def one_by_one_token_losses(model, rows) -> torch.Tensor:
    """Every example's per-token losses, each example run alone, in packed order."""
    losses = []
    for row in rows:
        for ex in row:
            logits = model(ex[None, :-1])
            losses.append(F.cross_entropy(logits[0], ex[1:], reduction="none"))
    return torch.cat(losses)


MODELS = {
    "llama-gqa-window": ("debug", dict(sliding_window=4)),
    "llama-gqa": ("debug", {}),
    "gpt2": ("gpt2-debug", {}),
}


@pytest.mark.parametrize("name", MODELS)
def test_packed_batch_loss_equals_examples_one_by_one(name):
    preset, overrides = MODELS[name]
    model = tiny_model(preset, **overrides)
    assert name == "gpt2" or model.cfg.n_kv_heads < model.cfg.n_heads
    rows = examples(model.cfg.vocab_size)
    inputs, targets, ids = packed(rows)
    with torch.no_grad():
        expected = one_by_one_token_losses(model, rows)
        logits = model(inputs, document_ids_BS=ids)
        token_losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        got = token_losses[targets.flatten() != -100]
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        # the chunked loss the training step takes: the mean over the packed batch's loss tokens
        chunked = model(inputs, targets_BS=targets, document_ids_BS=ids)
        torch.testing.assert_close(chunked, expected.mean(), rtol=RTOL, atol=ATOL)
        # without the document ids the examples see each other: the check above can fail
        crossed = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
        assert not torch.allclose(crossed[targets.flatten() != -100], expected, rtol=RTOL, atol=ATOL)


def test_packed_batch_gradients_equal_examples_one_by_one():
    """Backward too (the dense mask's SDPA backward): the summed loss's gradients agree."""
    model = tiny_model("debug", sliding_window=4)
    rows = examples(model.cfg.vocab_size)
    inputs, targets, ids = packed(rows)
    F.cross_entropy(model(inputs, document_ids_BS=ids).flatten(0, 1), targets.flatten(), reduction="sum").backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    one_by_one_token_losses(model, rows).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_positions_restart_per_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 2, 2]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 0, 1]]


def test_dense_mask_is_causal_within_documents_and_window():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    allowed = dense_document_mask(ids, window=2)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [0, 1, 1, 0, 0, 0],
                       [0, 0, 0, 1, 0, 0],
                       [0, 0, 0, 1, 1, 0],
                       [0, 0, 0, 0, 1, 1]]


def test_document_ids_refuse_explicit_positions_and_caches():
    model = tiny_model("debug")
    inputs, _, ids = packed(examples(model.cfg.vocab_size))
    with pytest.raises(ValueError, match="document_ids_BS.*positions_S"):
        model(inputs, positions_S=torch.arange(SEQ_LEN), document_ids_BS=ids)


def test_one_document_per_row_is_plain_causal_attention():
    """A batch whose rows are one document each attends as the unmasked (is_causal) path does."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    mask = document_mask(torch.zeros(2, 16, dtype=torch.long), kernel="sdpa")
    torch.testing.assert_close(causal_attention(q, k, v, mask=mask), causal_attention(q, k, v), rtol=RTOL, atol=ATOL)


def test_flex_mask_rule_attends_as_the_dense_mask():
    """FlexAttention's mask rule (the GPU kernel's) allows what the dense mask allows. Eager flex on a
    CPU (forward only: torch 2.13 has no FlexAttention backward there) reads the rule element by
    element; the compiled kernel on a GPU is checked by benchmarks/document_attention.py's differences."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gen = torch.Generator().manual_seed(2)
    ids = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38, [0] * 100 + [1] * 28])
    q = torch.randn(2, 4, 128, 16, generator=gen)
    k, v = (torch.randn(2, 2, 128, 16, generator=gen) for _ in range(2))
    for window in (0, 24):
        dense = document_mask(ids, window=window, kernel="sdpa").attend(q, k, v)
        block_mask = create_block_mask(document_mask_mod(ids, window), 2, None, 128, 128, device="cpu")
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        torch.testing.assert_close(flex, dense, rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's kernel (the GPU's choice) needs CUDA")
@pytest.mark.parametrize("compiled_blocks", [False, True], ids=["eager_blocks", "compiled_blocks"])
def test_packed_batch_on_cuda_with_flex(compiled_blocks):
    """On a GPU the model attends through FlexAttention's compiled kernel (`document_kernel`), its
    blocks eager or compiled (the mask built outside them): the loss and gradients equal the
    examples' one by one. Tolerance 1e-4: the GPU's fp32 kernels (flex's and SDPA's for the lone
    examples) sum in different orders."""
    from shardwise.models.common.document_mask import document_kernel

    assert document_kernel(torch.device("cuda")) == "flex"
    model = tiny_model("debug", sliding_window=4).to("cuda")
    rows = examples(model.cfg.vocab_size)
    inputs, targets, ids = (t.cuda() for t in packed(rows))
    expected = one_by_one_token_losses(model, [[ex.cuda() for ex in row] for row in rows])
    expected.sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    if compiled_blocks:  # after the lone examples, whose lengths would each compile a graph
        for block in model.layers.values():
            block.compile(dynamic=False)
    loss = model(inputs, targets_BS=targets, document_ids_BS=ids) * int((targets != -100).sum())
    loss.backward()
    torch.testing.assert_close(loss, expected.sum(), rtol=1e-4, atol=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-4, atol=1e-4, msg=name)
