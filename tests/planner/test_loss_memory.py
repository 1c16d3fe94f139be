"""The planner's loss memory against the measured loss: the chunked linear-cross-entropy
(`Layout.chunked_loss`) and the loss on full logits, peak bytes over forward and backward, on the
CPU counted tensor by tensor (`observe.activations.PeakLiveBytes`), on CUDA (where one is present)
by the caching allocator's high-water mark."""

import json

import pytest
import torch

from shardwise.core.model import ModelConfig
from shardwise.models.common import chunked_loss
from shardwise.models.families import validate_model
from shardwise.models.common.loss import token_loss
from shardwise.observe.activations import PeakLiveBytes
from shardwise.planner.layout import Layout
from shardwise.planner.memory import loss_bytes, loss_is_chunked, norm_saved_tensors


def measured_loss_peak(tokens: int, vocab: int, dim: int, *, chunked: bool, autocast: bool) -> int:
    chunked_loss.CPU_LOGITS_BUFFERS.clear()  # the kept chunk buffer is counted when it is made
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, dim, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), generator=gen)
    h.grad, weight.grad = torch.zeros_like(h), torch.zeros_like(weight)  # the gradients exist either way
    with PeakLiveBytes() as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (chunked_loss.linear_cross_entropy(h, weight, targets) if chunked
                    else token_loss(h @ weight.t(), targets))
        loss.backward()
    return live.peak


def measured_cuda_loss_peak(tokens: int, vocab: int, dim: int, *, chunked: bool, fused: bool, autocast: bool) -> int:
    """As `measured_loss_peak`, on CUDA: the allocator's high-water mark above what is allocated once the
    inputs and their gradients exist, on a second call (the first compiles the fused chunk and makes
    cuBLAS's workspace, which stay)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, tokens, dim, device="cuda", generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, dim, device="cuda", generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device="cuda", generator=gen)
    h.grad, weight.grad = torch.zeros_like(h), torch.zeros_like(weight)

    def loss_and_backward():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = (chunked_loss.linear_cross_entropy(h, weight, targets, fused=fused) if chunked
                    else token_loss(h @ weight.t(), targets))
        loss.backward()

    loss_and_backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss_and_backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def loss_model(dim: int, vocab: int, *, n_layers: int = 1, family: str = "llama") -> ModelConfig:
    """A model of two heads and an MLP as wide as `dim`: only its width and vocabulary reach the loss's count."""
    return validate_model(ModelConfig(family=family, dim=dim, n_layers=n_layers, n_heads=2, n_kv_heads=2, ffn_dim=dim,
                                      vocab_size=vocab))


def predicted_loss_peak(tokens: int, vocab: int, dim: int, *, chunked: bool, autocast: bool, device: str = "cpu",
                        compiled: bool = False) -> float:
    model = loss_model(dim, vocab)
    layout = Layout(micro_batch=1, seq_len=tokens, dtype="fp32", compute_dtype="bf16" if autocast else "",
                    chunked_loss=chunked, compile=compiled)
    assert loss_is_chunked(model, layout) == chunked
    element = 2 if autocast else 4
    kept, workspace = loss_bytes(model, layout, tokens, element, device)
    return kept + workspace - norm_saved_tensors(model) * dim * element * tokens  # the final norm is not run here


@pytest.mark.parametrize("tokens,vocab,dim,chunked,autocast", [
    (1024, 32768, 64, True, False),  # 4 chunks of 256 tokens
    (1024, 32768, 64, True, True),
    (4096, 16384, 32, True, False),  # 8 chunks; the input's gradient is half the weight's
    (1024, 16384, 64, False, False),  # full logits, fp32: 12 bytes a logit
])
def test_predicted_loss_memory_equals_the_measured_peak(tokens, vocab, dim, chunked, autocast):
    measured = measured_loss_peak(tokens, vocab, dim, chunked=chunked, autocast=autocast)
    predicted = predicted_loss_peak(tokens, vocab, dim, chunked=chunked, autocast=autocast)
    # 2%: the counts leave out what is not [tokens, vocab], [vocab, width] or [tokens, width] (the
    # per-token log-sum-exp, the targets); 1.2% at the smallest shape tried.
    assert predicted == pytest.approx(measured, rel=0.02), (measured / 2**20, predicted / 2**20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's chunk and its compiled softmax need CUDA")
@pytest.mark.parametrize("chunked,fused,autocast", [
    (True, False, False), (True, False, True),  # eager chunk: fp32 in place; bf16 with its fp32 copy
    (True, True, False), (True, True, True),  # compiled chunk (`train.compile` on a GPU): logits in, gradient out
    (False, False, False),  # full logits, fp32
])
def test_on_cuda_predicted_loss_memory_equals_the_measured_peak(chunked, fused, autocast):
    """The planner's GPU count (256M logits a chunk: 4 chunks of 2,093 tokens at Llama 3's vocabulary)
    against CUDA's allocator, eager and compiled chunk."""
    tokens, vocab, dim = 8192, 128256, 1024
    measured = measured_cuda_loss_peak(tokens, vocab, dim, chunked=chunked, fused=fused, autocast=autocast)
    predicted = predicted_loss_peak(tokens, vocab, dim, chunked=chunked, autocast=autocast, device="cuda",
                                    compiled=fused)
    # 2%, as above (0.7% at most on an H200)
    assert predicted == pytest.approx(measured, rel=0.02), (measured / 2**20, predicted / 2**20)


def test_chunked_loss_holds_far_less_than_full_logits_at_a_large_vocabulary():
    """The planner's two counts at Llama 3's vocabulary and 8k tokens, width 256 (the shape of
    benchmarks/loss_memory.py): the chunked loss at least 4x below full logits (issue 16's goal)."""
    full = predicted_loss_peak(8192, 128256, 256, chunked=False, autocast=False)
    chunked = predicted_loss_peak(8192, 128256, 256, chunked=True, autocast=False)
    assert full / chunked > 4


def test_under_tp_the_loss_is_chunked_over_each_ranks_columns():
    """Each rank chunks ceil(V/tp) columns: tokens a chunk grow with tp, the head's gradients shrink."""
    model = loss_model(64, 32768 + 1, n_layers=4)
    one, two = (loss_bytes(model, Layout(chunked_loss=True, tp=tp, dtype="fp32"), 4096, 4, "cpu") for tp in (1, 2))
    assert loss_is_chunked(model, Layout(chunked_loss=True, tp=2))
    # kept: the input gradient (every token) + the weight gradient (the larger rank's 16,385 rows)
    assert one[0] - two[0] == (32769 - 16385) * 64 * 4
    # beyond them, one chunk of fp32 logits: 255 tokens x 32,769 columns; under tp 511 x 16,385
    assert (one[1], two[1]) == (255 * 32769 * 4, 511 * 16385 * 4)


@pytest.mark.parametrize("change,family", [({"pp": 2}, "llama"), ({}, "bert"), ({}, "t5")])
def test_the_loss_is_chunked_only_where_the_runtime_chunks_it(change, family):
    model = loss_model(64, 512, n_layers=4, family=family)
    layout = Layout(chunked_loss=True, **change)
    assert not loss_is_chunked(model, layout)
    assert loss_bytes(model, layout, 128, 4, "cuda") == loss_bytes(model, Layout(**change), 128, 4, "cuda")


@pytest.mark.parametrize("chunked", [True, False])
def test_auto_mode_plans_with_the_configs_loss(chunked):
    """parallel.mode = "auto" counts the loss the trainer will take (`train.chunked_loss`)."""
    from shardwise.config.loader import load_config
    from shardwise.train.auto_layout import plan_request
    from shardwise.planner.hardware import preset
    from shardwise.planner.search import plan

    cfg = load_config(overrides={"model.preset": "demo", "train.chunked_loss": chunked})
    results, _ = plan(plan_request(cfg, 2, preset("cpu")))
    single_stage = [r.layout for r in results if r.layout.tp == 1 and r.layout.pp == 1]
    assert single_stage and all(layout.chunked_loss == chunked for layout in single_stage)
    assert all(("chunked-loss" in layout.describe()) == chunked for layout in single_stage)


def test_plan_counts_the_chunked_loss_unless_told_full_logits_and_compiles_when_told(capsys):
    from shardwise.cli.main import main

    args = ["plan", "--model", "llama3-8b", "--devices", "16", "--global-batch-tokens", "1048576", "--seq-len", "4096",
            "--top", "1", "--json"]
    main(args)
    chunked = json.loads(capsys.readouterr().out)["layouts"][0]
    main(args + ["--full-logits"])
    full = json.loads(capsys.readouterr().out)["layouts"][0]
    assert chunked["layout"]["chunked_loss"] and not full["layout"]["chunked_loss"]
    assert chunked["memory_gib"]["logits"] < full["memory_gib"]["logits"]
    main(args + ["--compile"])
    compiled = json.loads(capsys.readouterr().out)["layouts"][0]
    assert compiled["layout"]["compile"] and "compiled" in compiled["description"]
    assert not chunked["layout"]["compile"]
