"""The MoE layer against definitions written as plain loops over tokens (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.families import counts_of, validate_model
from shardwise.models.common.moe import (
    MoE,
    _segment_matmul,
    grouped_matmul,
    load_balance_loss,
    moe_layers,
    z_loss,
)
from shardwise.core.model import ModelConfig
from shardwise.models.llama.model import build_model
from shardwise.config.presets import model_config

DIM, N_EXPERTS = 16, 4


def moe_config(**overrides) -> ModelConfig:
    fields = dict(dim=DIM, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab_size=64, max_seq_len=32,
                  n_experts=N_EXPERTS, experts_per_token=2, init_std=0.3)
    return ModelConfig(**(fields | overrides))


def make_moe(seed: int = 0, **overrides) -> MoE:
    cfg = moe_config(**overrides)
    validate_model(cfg)
    layer = MoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def tokens_x(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, n, DIM, generator=torch.Generator().manual_seed(seed))


def expert_out(layer: MoE, e: int, x_D: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return (F.silu(x_D @ ex.gate_proj[e]) * (x_D @ ex.up_proj[e])) @ ex.down_proj[e]


def reference(layer: MoE, x_BSD: torch.Tensor, *, capacity_factor: float = 0.0) -> torch.Tensor:
    """Token by token: route, skip assignments past capacity (first come, first served), sum."""
    x = x_BSD.reshape(-1, DIM)
    k, E = layer.top_k, layer.n_experts
    slots = math.ceil(capacity_factor * x.shape[0] * k / E) if capacity_factor else None
    used = [0] * E
    # Capacity is granted in (expert, token) order: every token's choice of e before the next expert.
    choices = []
    for t in range(x.shape[0]):
        logits = layer.router.weight @ x[t]
        scores = logits.softmax(-1) if layer.router.score == "softmax" else logits.sigmoid()
        select = scores + (layer.router.score_bias if layer.router.score_bias is not None else 0)
        ids = select.topk(k).indices
        w = scores[ids]
        if layer.router.norm_topk:
            w = w / w.sum()
        choices.append((ids.tolist(), w))
    kept = set()
    for e in range(E):
        for t, (ids, _) in enumerate(choices):
            if e in ids and (slots is None or used[e] < slots):
                used[e] += 1
                kept.add((t, e))
    out = []
    for t, (ids, w) in enumerate(choices):
        y = sum((w[j] * expert_out(layer, e, x[t]) for j, e in enumerate(ids) if (t, e) in kept), torch.zeros(DIM))
        if layer.shared_experts is not None:
            shared = layer.shared_experts(x[t])
            y = y + (torch.sigmoid(layer.shared_gate(x[t])) * shared if layer.shared_gate is not None else shared)
        out.append(y)
    return torch.stack(out).view_as(x_BSD)


CASES = {
    "mixtral-top2": dict(),
    "switch-top1-raw-prob": dict(experts_per_token=1, router_norm_topk=False),
    "qwen2moe-shared-gated-unnormalised": dict(router_norm_topk=False, n_shared_experts=2, shared_expert_gate=True),
    "deepseek-sigmoid-shared": dict(router_score="sigmoid", n_shared_experts=1, experts_per_token=3),
    "moe-ffn-dim": dict(moe_ffn_dim=8),
}


@pytest.mark.parametrize("case", CASES)
def test_dropless_matches_token_loop(case):
    layer = make_moe(**CASES[case]).eval()
    x = tokens_x()
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)


def test_sigmoid_bias_changes_selection_not_weights():
    layer = make_moe(router_score="sigmoid", router_bias_update_rate=1e-3).eval()
    x = tokens_x()
    before = layer(x)
    with torch.no_grad():
        layer.router.score_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # forces experts 0 and 1
    _, _, ids, weights = layer.router(x.view(-1, DIM))
    assert set(ids.flatten().tolist()) == {0, 1}
    scores = F.linear(x.view(-1, DIM), layer.router.weight).sigmoid().gather(-1, ids)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))
    after = layer(x)
    torch.testing.assert_close(after, reference(layer, x), rtol=1e-5, atol=1e-5)
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_capacity_dropping_matches_its_definition(factor):
    layer = make_moe(seed=3, capacity_factor=factor).train()
    x = tokens_x(n=16, seed=4)
    torch.testing.assert_close(layer(x), reference(layer, x, capacity_factor=factor), rtol=1e-5, atol=1e-5)
    stats = layer.take_stats()
    slots = math.ceil(factor * 16 * 2 / N_EXPERTS)
    assert float(stats["dropped"]) == sum(max(0.0, c - slots) for c in stats["tokens"].tolist())
    if factor < 1.5:
        assert float(stats["dropped"]) > 0  # the case really drops
    if float(stats["dropped"]) > 0:  # at 1.5 this draw's busiest expert (10 tokens) fits its 12 slots
        assert not torch.allclose(layer(x), reference(layer, x))  # and dropping changes the output


@pytest.mark.parametrize("case, factor", [*((case, 0.0) for case in CASES), ("mixtral-top2", 0.5),
                                          ("mixtral-top2", 1.0)])
def test_every_expert_path_of_a_compiled_no_grad_forward_matches_the_token_loop(case, factor, monkeypatch):
    """The static-shape path a compiled forward without gradients takes (the engine's decode step),
    run eagerly here by making the layer see itself compiled: same definition, capacity drops included."""
    layer = make_moe(seed=3, capacity_factor=factor, **CASES[case]).eval()
    x = tokens_x(n=16, seed=4)
    taken = []
    every_expert = layer.every_expert
    monkeypatch.setattr(layer, "every_expert", lambda *args: taken.append(1) or every_expert(*args))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        got = layer(x)
    assert taken
    torch.testing.assert_close(got, reference(layer, x, capacity_factor=factor), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dim", [5, 8])  # 5: not 16-byte aligned, the expert loop; 8: _grouped_mm where it works
def test_grouped_matmul_equals_segment_loop_and_its_gradients(out_dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=gen, requires_grad=True)
    w = torch.randn(3, 8, out_dim, generator=gen, requires_grad=True)
    counts = torch.tensor([4, 0, 5])
    y = grouped_matmul(x, w, counts)
    torch.testing.assert_close(y, _segment_matmul(x, w, [4, 0, 5]))
    y.sum().backward()  # a stride-0 gradient, which _grouped_mm's own backward refuses
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    _segment_matmul(x, w, [4, 0, 5]).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_load_balance_and_z_loss_definitions():
    uniform = torch.full((8, 4), 0.25)
    assert float(load_balance_loss(uniform, torch.tensor([4, 4, 4, 4]), top_k=2)) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    # All 16 assignments of 8 tokens on experts 0 and 1: 4 / 16 * (8 * 0.7 + 8 * 0.1) = 1.6
    assert float(load_balance_loss(skewed, torch.tensor([8, 8, 0, 0]), top_k=2)) == pytest.approx(1.6)
    logits = torch.randn(5, 4)
    assert float(z_loss(logits)) == pytest.approx(float((torch.logsumexp(logits, -1) ** 2).mean()))


def test_aux_losses_add_their_gradient_scaled_like_the_loss():
    layer = make_moe(aux_loss_coef=0.1, z_loss_coef=0.01).train()
    layer.aux_loss_scale = 0.25
    x = tokens_x()
    layer(x).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    # The same gradient, written out: main loss + scale * (coef * L_aux + coef * L_z).
    layer.zero_grad()
    layer.eval()
    x2 = x.view(-1, DIM)
    logits, scores, ids, _ = layer.router(x2)
    counts = torch.bincount(ids.flatten(), minlength=N_EXPERTS)
    aux = 0.1 * load_balance_loss(scores, counts, 2) + 0.01 * z_loss(logits)
    (layer(x).pow(2).mean() + 0.25 * aux).backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    assert (grads["router.weight"] - 0).abs().max() > 0
    stats = layer.take_stats()
    assert float(stats["aux_loss"]) == pytest.approx(float(0.1 * load_balance_loss(scores, counts, 2).detach()))


def test_bias_update_rule():
    layer = make_moe(router_score="sigmoid", router_bias_update_rate=0.01)
    layer.router.score_bias.zero_()
    layer.update_bias(torch.tensor([9.0, 1.0, 5.0, 5.0]), 0.01)  # mean 5
    torch.testing.assert_close(layer.router.score_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


@pytest.mark.parametrize("overrides", [dict(), dict(n_shared_experts=2, shared_expert_gate=True, moe_layer_step=2,
                                                     moe_ffn_dim=12, tie_embeddings=False)])
def test_parameter_counts(overrides):
    cfg = moe_config(**overrides)
    model, counts = build_model(cfg), counts_of(cfg)
    assert counts.num_params() == sum(p.numel() for p in model.parameters())
    per_expert = 3 * DIM * cfg.expert_ffn_dim
    moe_count = len(moe_layers(model))
    assert counts.num_params() - counts.num_active_params() == moe_count * (N_EXPERTS - 2) * per_expert
    dense = counts_of(dataclasses.replace(cfg, n_experts=0))
    active_over_dense = counts.num_active_params() - dense.num_params()
    assert counts.flops_per_token(32) - dense.flops_per_token(32) == 6 * active_over_dense


def test_published_presets():
    mixtral = counts_of(model_config("mixtral-8x7b"))
    assert round(mixtral.num_params() / 1e9, 1) == 46.7 and round(mixtral.num_active_params() / 1e9, 1) == 12.9
    tiny, dense = model_config("moe-debug"), model_config("debug")
    routers = tiny.n_layers * tiny.dim * tiny.n_experts
    assert counts_of(tiny).num_active_params() == counts_of(dense).num_params() + routers


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_experts=1), "model.n_experts = 1 is invalid: use 0 (dense) or at least 2"),
        (dict(experts_per_token=5), "model.experts_per_token = 5 is invalid: use at most model.n_experts (4)"),
        (dict(router_score="relu"), "model.router_score = 'relu' is invalid: use softmax or sigmoid"),
        (dict(capacity_factor=-1.0), "model.capacity_factor = -1.0 is invalid"),
        (dict(moe_layer_step=0), "model.moe_layer_step = 0 is invalid"),
        (dict(shared_expert_gate=True), "model.shared_expert_gate = True is invalid"),
    ],
)
def test_invalid_moe_config(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_model(moe_config(**overrides))


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_training_writes_moe_metrics_and_the_loss_includes_aux_losses(tiny_config, recompute):
    """Also under recomputation, whose second forward (inside backward) must not count again."""
    from shardwise.train.trainer import train

    cfg = tiny_config(**{"model.preset": "moe-debug", "model.capacity_factor": 1.0, "model.router_score": "sigmoid",
                         "model.router_bias_update_rate": 1e-3, "train.steps": 3, "train.recompute": recompute})
    result = train(cfg)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    for record in records:
        assert record["loss"] == pytest.approx(record["lm_loss"] + record["moe_aux_loss"] + record["moe_z_loss"])
        assert record["moe_aux_loss"] > 0 and record["moe_z_loss"] > 0
        loads = record["moe_tokens_per_expert"]
        assert sorted(loads) == ["0", "1"]
        assert all(sum(load) == tokens_per_step * 2 for load in loads.values())
        assert 0 < record["moe_dropped_fraction"] < 1
    # The bias moved by the rate every step, against the load.
    from shardwise.infer.load import load_run

    _, model, _ = load_run(result.run_dir)
    bias = model.layers["0"].mlp.router.score_bias / 1e-3  # in units of the rate: each step moved it by -1, 0 or 1
    assert bias.abs().max() > 0 and bias.abs().max() <= 3 + 1e-4
    assert (bias - bias.round()).abs().max() < 1e-3
