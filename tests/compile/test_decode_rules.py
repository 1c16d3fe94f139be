"""The decode rules (compile/rules/registry.py's DECODE_RULES): the inference engine's compiled
decode step on CPU takes a linear over 16-63 fp32 rows as (W @ x^T)^T. The replacement equals the
pattern forward and backward, and near misses are left alone; the engine's test
(tests/generation/test_engine.py) counts them on the decode step and compares its tokens."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.compile.rules import small_batch_linear
from shardwise.compile.rules.backend import count_matches, run_rewritten
from shardwise.compile.rules.registry import DECODE_RULES, RULES


@pytest.mark.parametrize("rows", [16, 40, 63])
@pytest.mark.parametrize("pattern", [small_batch_linear.pattern, small_batch_linear.tied_head_pattern])
def test_replacement_equals_pattern_forward_and_backward(pattern, rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 1, 24, requires_grad=True)
    weight = torch.randn(40, 24, requires_grad=True)
    want = pattern(x, weight)
    got = small_batch_linear.replacement(x, weight)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # one fp32 product, summed in another order
    grad = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (x, weight), grad), torch.autograd.grad(want, (x, weight), grad)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-5)


def step(x, weight, bias, head):
    return F.linear(x, weight, None), F.linear(x, weight, bias), x @ head.t()  # as nn.Linear calls it


def test_they_fire_on_16_to_63_fp32_rows_only_and_the_result_is_unchanged():
    torch.manual_seed(0)
    weight, bias, head = torch.randn(40, 24), torch.randn(40), torch.randn(50, 24)
    names = {rule.name: 0 for rule in DECODE_RULES}
    for rows, dtype, fires in [(16, torch.float32, True), (63, torch.float32, True), (15, torch.float32, False),
                               (64, torch.float32, False), (16, torch.float64, False)]:
        x = torch.randn(rows, 1, 24, dtype=dtype)
        args = (x, weight.to(dtype), bias.to(dtype), head.to(dtype))
        out, fired = run_rewritten(step, *args, rules=DECODE_RULES)
        # the linear with a bias is a near miss: never rewritten
        assert fired == ({"small_batch_linear": 1, "small_batch_tied_head": 1} if fires else names), (rows, dtype)
        for got, want in zip(out, step(*args)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_the_training_rules_do_not_include_them():
    """A training step's linears take thousands of rows; the rules of its blocks stay as they were."""
    assert not {rule.name for rule in DECODE_RULES} & {rule.name for rule in RULES}
    x = torch.randn(32, 24)
    assert count_matches(step, x, torch.randn(40, 24), torch.randn(40), torch.randn(50, 24)) == {
        rule.name: 0 for rule in RULES}
