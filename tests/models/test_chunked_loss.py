"""The chunked linear-cross-entropy (models/common/chunked_loss.py) equals the logits-then-loss
path, forward and backward, and holds no [tokens, vocab] buffer beyond one chunk."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.common.chunked_loss import linear_cross_entropy
from shardwise.models.common.loss import loss_of, token_loss


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled_chunk"])
@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_equals_full_cross_entropy_in_fp64(chunk, fused):
    torch.manual_seed(0)
    h = torch.randn(3, 13, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 13))
    targets[0, 2] = -100  # ignored, as F.cross_entropy ignores it
    want = F.cross_entropy((h @ weight.t()).flatten(0, 1), targets.flatten())
    got = linear_cross_entropy(h, weight, targets, chunk=chunk, fused=fused)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(3 * got, (h, weight)), torch.autograd.grad(3 * want, (h, weight))):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_second_backward_through_the_same_loss_is_refused_in_one_line():
    """Backward scales the kept gradients in place, so it cannot run twice on them."""
    h = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    loss = linear_cross_entropy(h, weight, torch.randint(0, 16, (4,)))
    (2 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran already: .* compute the loss again"):
        loss.backward()


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled_chunk"])
def test_bf16_autocast_matches_token_loss(fused):
    """Under autocast the chunk's logits are bf16 matmuls, the loss fp32, as in token_loss."""
    torch.manual_seed(0)
    h = torch.randn(2, 32, 64, requires_grad=True)
    weight = (torch.randn(300, 64) * 0.1).requires_grad_()
    targets = torch.randint(0, 300, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = token_loss(h @ weight.t(), targets)
        got = linear_cross_entropy(h, weight, targets, chunk=16, fused=fused)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got, (h, weight)), torch.autograd.grad(want, (h, weight))):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-4)  # bf16 matmuls on both sides, summed in other orders


def test_on_cpu_every_chunk_and_call_writes_its_logits_into_one_kept_buffer():
    """Calls of different vocabularies and chunk sizes share the one fp64 buffer (grown once, to the
    largest chunk) and each still equals the full cross-entropy: no chunk reads another's logits."""
    from shardwise.models.common import chunked_loss

    chunked_loss.CPU_LOGITS_BUFFERS.pop(torch.float64, None)
    torch.manual_seed(0)
    addresses = set()
    for vocab, chunk in ((50, 7), (90, 4), (30, 11), (90, 4)):
        h = torch.randn(2, 13, 16, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(vocab, 16, dtype=torch.float64, requires_grad=True)
        targets = torch.randint(0, vocab, (2, 13))
        want = F.cross_entropy((h @ weight.t()).flatten(0, 1), targets.flatten())
        got = linear_cross_entropy(h, weight, targets, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for g, w in zip(torch.autograd.grad(got, (h, weight)), torch.autograd.grad(want, (h, weight))):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        addresses.add(chunked_loss.CPU_LOGITS_BUFFERS[torch.float64].data_ptr())
    assert len(addresses) == 2  # made for 7 x 50, grown once for 4 x 90 (> 350), then reused
    assert chunked_loss.CPU_LOGITS_BUFFERS[torch.float64].numel() == 4 * 90


def test_model_returns_the_same_loss_through_targets():
    from shardwise.config.presets import model_config
    from shardwise.models.llama.model import Llama

    for tie in (False, True):
        torch.manual_seed(0)
        model = Llama(model_config("debug", tie_embeddings=tie))
        model.init_weights(0)
        inputs, targets = torch.randint(0, 512, (2, 24)), torch.randint(0, 512, (2, 24))
        want = loss_of(model, inputs, targets, autocast_dtype="float32", device=torch.device("cpu"))
        want_grads = torch.autograd.grad(want, list(model.parameters()))
        got = loss_of(model, inputs, targets, autocast_dtype="float32", device=torch.device("cpu"),
                      targets_kwarg="targets_BS")
        got_grads = torch.autograd.grad(got, list(model.parameters()))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled_chunk"])
def test_no_gradients_are_made_when_none_are_wanted(fused):
    h, weight = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 10, (4,))
    with torch.no_grad():
        loss = linear_cross_entropy(h, weight, targets, fused=fused)
        torch.testing.assert_close(loss, F.cross_entropy(h @ weight.t(), targets))
    assert loss.grad_fn is None


def test_saves_no_vocabulary_wide_activation():
    """What the graph holds for backward is the h- and weight-shaped gradients, not logits."""
    from shardwise.observe.activations import saved_activation_bytes

    h = torch.randn(1, 256, 32, requires_grad=True)
    weight = torch.randn(4096, 32, requires_grad=True)
    targets = torch.randint(0, 4096, (1, 256))
    _, full = saved_activation_bytes(lambda: token_loss((h * 1) @ weight.t(), targets))
    _, chunked = saved_activation_bytes(lambda: linear_cross_entropy(h * 1, weight, targets, chunk=64))
    logits_bytes = 256 * 4096 * 4
    assert full >= logits_bytes
    assert chunked <= (256 * 32 + 4096 * 32) * 4 + 256 * 32 * 4  # grad_h, grad_w, the input h * 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's fp32-accumulating matmul and Triton need CUDA")
def test_on_cuda_the_compiled_chunk_equals_the_eager_one_in_bf16():
    """On CUDA the compiled chunk runs as Triton kernels and the weight gradient accumulates in
    cuBLAS's fp32 output (`add_weight_gradient`): both paths equal the full fp32 loss."""
    torch.manual_seed(0)
    h = torch.randn(2, 512, 256, device="cuda", requires_grad=True)
    weight = (torch.randn(5000, 256, device="cuda") * 0.05).requires_grad_()
    targets = torch.randint(0, 5000, (2, 512), device="cuda")
    targets[0, :7] = -100
    results = []
    for fused in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, weight, targets, chunk=300, fused=fused)
        results.append((loss, *torch.autograd.grad(loss, (h, weight))))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-4)  # bf16 logits, summed in other orders
