"""The rewrite rules (shardwise/compile/rules/): each fires on the Llama block graph, its
replacement equals its pattern forward and backward, and near misses are left alone."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.compile.rules import add_rms_norm, rms_norm, rope, swiglu
from shardwise.compile.rules.backend import count_matches
from shardwise.compile.rules.registry import RULES
from shardwise.compile.rules.report import block_matches
from shardwise.config.presets import model_config

D = 16


def rms_args():
    """fp32: the pattern's `.float()` would narrow fp64 (a constraint refuses that)."""
    return (torch.randn(2, 5, D, requires_grad=True), (torch.rand(D) + 0.5).requires_grad_(), 1e-5, torch.float32)


def rope_args():
    angles = torch.rand(5, D, dtype=torch.float64) * 6
    return torch.randn(2, 3, 5, D, dtype=torch.float64, requires_grad=True), angles.cos(), angles.sin()


EXAMPLES = {
    "rms_norm": (rms_norm, rms_args),
    "add_rms_norm": (add_rms_norm, lambda: (torch.randn(2, 5, D, requires_grad=True), *rms_args())),
    "swiglu": (swiglu, lambda: tuple(torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True) for _ in "ab")),
    "rope": (rope, rope_args),
}


def test_every_registered_rule_has_an_example_here():
    assert {rule.name for rule in RULES} == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_replacement_equals_pattern_forward_and_backward(name):
    module, make_args = EXAMPLES[name]
    torch.manual_seed(0)
    args = make_args()
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    outputs = {}
    for side in ("pattern", "replacement"):
        out = getattr(module, side)(*args)
        out = out if isinstance(out, tuple) else (out,)
        weights = [torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o) for o in out]
        loss = sum((o * w).sum() for o, w in zip(out, weights))
        outputs[side] = (out, torch.autograd.grad(loss, tensors))
    # fp64 examples agree to rounding; the norms run in fp32 (a fused kernel sums in another order)
    tol = 1e-10 if args[0].dtype == torch.float64 else 2e-6
    for got, want in zip(outputs["replacement"][0], outputs["pattern"][0]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for got, want in zip(outputs["replacement"][1], outputs["pattern"][1]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_rules_fire_on_the_llama_block_graph():
    """One block: the attention norm (rms_norm), the residual add feeding the MLP norm
    (add_rms_norm), the SwiGLU gate (swiglu), and RoPE on q and on k."""
    assert block_matches(model_config("debug"), 0) == {"add_rms_norm": 1, "rms_norm": 1, "swiglu": 1, "rope": 2}


class SwigluMLP(torch.nn.Module):
    def __init__(self, width: int = D, hidden: int = 48):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(width, hidden, bias=False), torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.slow
@pytest.mark.parametrize("rules", [False, True], ids=["inductor", "rules"])
def test_swiglu_rule_recomputes_the_product_instead_of_keeping_it(rules):
    """Compiled, the MLP keeps the gate's and the up projection's outputs for backward; without
    the rule inductor also keeps their product (the down projection's input), with it backward
    rebuilds the product. Gradients equal eager either way."""
    from shardwise.compile.rules.backend import rules_backend
    from shardwise.observe.activations import saved_activation_bytes

    torch.manual_seed(0)
    mlp, tokens = SwigluMLP(), 64
    x = torch.randn(tokens, D) * torch.ones(1, requires_grad=True)  # an activation, as in a model
    want = torch.autograd.grad(mlp(x).square().sum(), [x, *mlp.parameters()])
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=rules_backend if rules else "inductor", fullgraph=True, dynamic=False)
    compiled(x)  # compile first: what compiling holds is not the MLP's
    out, saved = saved_activation_bytes(compiled, x)
    got = torch.autograd.grad(out.square().sum(), [x, *mlp.parameters()])
    torch._dynamo.reset()
    hidden_width_tensors = (saved - x.numel() * x.element_size()) / (tokens * 48 * 4)
    assert hidden_width_tensors == (2 if rules else 3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


class NearMisses(torch.nn.Module):
    """Code that looks like the patterns but is not what they replace."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(D))
        self.column_weight = torch.nn.Parameter(torch.ones(4, 1))
        self.down_weight = torch.nn.Parameter(torch.ones(3, D))

    def forward(self, x, a, b_wide, cos, sin):
        x32 = x.float()
        over_batch = self.column_weight * (x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + 1e-5)).to(x.dtype)
        to_bf16 = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
        centred = x32 - x32.mean(-1, keepdim=True)  # LayerNorm, not RMSNorm
        layer_norm = self.weight * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        gelu_gate = F.gelu(a) * a
        broadcast_gate = F.silu(a[..., :1]) * b_wide  # shapes differ: not SwiGLU's two projections
        broadcast_down = F.linear(F.silu(a[..., :1]) * b_wide, self.down_weight)
        gelu_down = F.linear(F.gelu(a) * b_wide, self.down_weight)
        x1, x2 = x.chunk(2, dim=-1)
        wrong_sign = x * cos + torch.cat((x2, -x1), dim=-1) * sin
        return over_batch, to_bf16, layer_norm, gelu_gate, broadcast_gate, broadcast_down, gelu_down, wrong_sign


def test_near_misses_are_not_rewritten():
    angles = torch.rand(4, D)
    args = (torch.randn(4, D), torch.randn(4, D), torch.randn(4, D), angles.cos(), angles.sin())
    assert count_matches(NearMisses(), *args) == {rule.name: 0 for rule in RULES}


@pytest.mark.slow
def test_compiled_block_with_rules_equals_eager():
    from shardwise.compile.rules import backend
    from shardwise.models.common.rope import RopeSpec, rope_cos_sin
    from shardwise.models.llama.model import Block

    cfg = model_config("debug")
    torch.manual_seed(0)
    block = Block(cfg, 0)
    for param in block.parameters():
        torch.nn.init.normal_(param, mean=1.0 if param.dim() == 1 else 0.0, std=0.1)
    x = torch.randn(2, 16, cfg.dim, requires_grad=True)
    cos, sin = rope_cos_sin(RopeSpec.of(cfg), torch.arange(16), x.dtype)
    eager = block(x, cos, sin)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x, *block.parameters()])
    before = sum(backend.FIRED.values())
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend.rules_backend, fullgraph=True, dynamic=False)
    out = compiled(x, cos, sin)
    grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    torch._dynamo.reset()
    assert sum(backend.FIRED.values()) - before == 5
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_shardwise_rules_lists_every_rule_with_its_count(capsys):
    from shardwise.cli.main import main

    assert main(["rules", "--model.preset", "llama3-8b"]) in (0, None)
    out = capsys.readouterr().out
    for rule in RULES:
        assert rule.name in out
    assert "rope                           2           64" in out
    assert "linear_cross_entropy" in out
